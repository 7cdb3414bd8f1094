"""`pdflow check --mutants --mutant NAME`: one mutant, its catching run's trace written, and a
command printed that catches it again at the same seed."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from pdflow.cli import main


def test_one_mutant_is_caught_traced_and_reproducible(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # the reproduce run writes to the default trace folder
    traces = tmp_path / "traces"
    assert main(["check", "--mutants", "--mutant", "noop_fence", "--steps", "150",
                 "--trace-dir", str(traces)]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "1/1 mutants caught" in out
    command, trace = re.search(r"reproduce: pdflow (.+); trace: (\S+)", out).groups()  # type: ignore[union-attr]
    assert Path(trace).is_file() and Path(trace).parent == traces / "noop_fence"
    assert main(shlex.split(command)) == 0
    again = capsys.readouterr().out
    caught_at = re.search(r"caught  noop_fence +seed +(\d+)", out).group(1)  # type: ignore[union-attr]
    assert re.search(rf"caught  noop_fence +seed +{caught_at} ", again)


def test_mutants_caught_at_one_seed_keep_a_trace_each(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Both are caught at seed 0: their traces used to go to one file, the second overwriting
    the first, so the first hint pointed at the other mutant's run."""
    names = ("duplicate_claim_accepted", "unopened_abort_not_acked")
    args = ["check", "--mutants", "--trace-dir", str(tmp_path)]
    assert main([*args, *(arg for name in names for arg in ("--mutant", name))]) == 0
    out = capsys.readouterr().out
    traces = dict(re.findall(r"--mutant (\w+) --seed 0 .*; trace: (\S+)", out))
    assert sorted(traces) == sorted(names)
    assert {Path(trace).parent.name for trace in traces.values()} == set(names)
    contents = {Path(trace).read_bytes() for trace in traces.values()}
    assert len(contents) == 2  # two runs recorded, neither overwritten


def test_an_unknown_mutant_or_one_without_mutants_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["check", "--mutants", "--mutant", "no_such_bug"]) == 2
    assert "noop_fence" in capsys.readouterr().out  # the names to choose from
    assert main(["check", "--mutant", "noop_fence"]) == 2


def test_a_failed_world_is_shown_before_the_coverage_with_what_to_run_next(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The failure came after some 25 lines of coverage, its reproduce command dropped the
    trace folder given, and nothing pointed at the trace tools."""
    from pdflow.sim.mutants import applied, by_name

    monkeypatch.chdir(tmp_path)  # --mutant writes its trace to the default folder

    traces = tmp_path / "traces"
    mutant = by_name("noop_fence")
    with applied(mutant):
        assert main(["check", "--mutants", "--mutant", "noop_fence", "--steps", "150"]) == 0
        seed = int(re.search(r"caught  noop_fence +seed +(\d+)",  # type: ignore[union-attr]
                             capsys.readouterr().out).group(1))  # fmt: skip
        assert main(["check", "--seed", str(seed), "--examples", "1", "--steps", "150",
                     "--trace-dir", str(traces)]) == 1  # fmt: skip
    out = capsys.readouterr().out
    assert out.index(f"FAILED seed {seed}") < out.index("spec coverage")
    assert f"--trace-dir {traces}`" in out
    trace = re.search(r"  trace: (\S+)", out).group(1)  # type: ignore[union-attr]
    assert Path(trace).is_file()
    assert f"pdflow trace show {trace}" in out
    # The replay named steps through the room the use-after-free names.
    room = re.search(r"write \d+ of room (\d+)/", out).group(1)  # type: ignore[union-attr]
    assert f"step through room {room} as replayed: pdflow replay {trace} --room {room}\n" in out
    assert out.rstrip().splitlines()[-1].startswith("FAILED: 1 of 1 worlds")


def test_a_mutant_trace_names_its_mutant_and_replay_says_it_diverges_where_it_acts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Replay could only guess that a mutant core was the likely cause: the trace did not say
    which mutant, if any, recorded it."""
    from pdflow.trace.format import TraceHeader, decode_line, encode_line, read_trace

    assert main(["check", "--mutants", "--mutant", "ack_before_drain", "--trace-dir",
                 str(tmp_path)]) == 0  # fmt: skip
    trace = re.search(r"; trace: (\S+)", capsys.readouterr().out).group(1)  # type: ignore[union-attr]
    headers = [line for line in read_trace(Path(trace)) if isinstance(line, TraceHeader)]
    assert headers and {header.mutant for header in headers} == {"ack_before_drain"}
    assert main(["replay", trace]) == 1
    out = capsys.readouterr().out
    assert "what to do: recorded under mutant ack_before_drain: it diverges where the " \
           "mutant acts" in out  # fmt: skip
    assert "if `pdflow check --mutants` wrote it" not in out, "no guess once the trace says"
    # A header written before the field existed still loads, naming no mutant.
    older = encode_line(headers[0]).replace(b',"mutant":"ack_before_drain"', b"")
    assert b"mutant" not in older
    loaded = decode_line(older)
    assert isinstance(loaded, TraceHeader) and loaded.mutant is None
