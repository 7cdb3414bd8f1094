"""benchmarks/engine_notify_floor: a completion word through the raw engine, writer and receiver
in two processes. The figures are noise; what is checked is what the route rests on."""

from __future__ import annotations

import pytest
from benchmarks.engine_notify_floor import MODES, run


def test_a_word_written_after_the_batch_returned_never_arrives_before_the_kv() -> None:
    result = run(size=256 * 1024, ops=4, rounds=12, progress=lambda _: None)
    assert result["word_after_seen_before_kv"] == 0, result
    assert 0 <= result["word_in_batch_seen_before_kv"] <= 12
    for mode in MODES:
        summary = result[mode]
        assert 0 < summary["p10_us"] <= summary["median_us"] <= summary["p90_us"], (mode, result)
    assert result["ratio"] == pytest.approx(
        result["raw"]["median_us"] / result["word_after"]["median_us"]
    )


@pytest.mark.parametrize(("size", "ops", "rounds"), [(1000, 3, 1), (4096, 0, 1), (4096, 2, 0)])
def test_shapes_that_do_not_split_into_words_are_refused(size: int, ops: int, rounds: int) -> None:
    with pytest.raises(ValueError, match="dividing size"):
        run(size=size, ops=ops, rounds=rounds, progress=lambda _: None)
