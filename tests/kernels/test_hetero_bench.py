"""The hetero-TP benchmark on a tiny shape: both paths deliver identical KV through the hook."""

from benchmarks.hetero_tp import run

from pdflow.core.dataplane.planning import WriteOp
from pdflow.dataplane import Backend, memmove_write_ops


def test_both_paths_agree_and_use_the_injected_writer() -> None:
    seen: list[int] = []

    def counting_writer(ops: list[WriteOp]) -> None:
        seen.append(len(ops))
        memmove_write_ops(ops)

    result = run(
        tokens=40,
        layers=2,
        head_dim=16,
        page_size=16,
        prefill_tp=4,
        backend=Backend.NUMPY,
        write_ops=counting_writer,
    )
    per_slice_ops = 4 * (2 * 2) * 3 * 16  # ranks x buffers x pages x tokens
    assert result["per_slice"]["ops"] == per_slice_ops
    assert result["staged"]["ops"] == 4
    assert sum(seen) == per_slice_ops + 4
    assert result["payload_bytes"] == 2 * 2 * 3 * 16 * 8 * 16 * 2
