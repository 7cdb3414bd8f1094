"""`pdflow bench`: run the benchmark suites side by side, judge ratios, write JSON and PNGs."""

from pdflow.bench.plots import write_plots
from pdflow.bench.runner import SUITES, BenchReport, Check, SuiteResult, run_bench

__all__ = ["SUITES", "BenchReport", "Check", "SuiteResult", "run_bench", "write_plots"]
