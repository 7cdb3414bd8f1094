"""`pdflow chaos`: real prefill, decode and registry processes on separate network namespaces,
a seeded workload, a seeded nemesis whose whole schedule is written first, and a checker.

Modules: :mod:`netns` (hosts and links), :mod:`procs` (the processes), :mod:`agents` (what runs
inside each process), :mod:`workload` (the router), :mod:`nemesis` (faults), :mod:`checker`,
:mod:`report` and :mod:`run` (the whole run). See docs/chaos.md.
"""
