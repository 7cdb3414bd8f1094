"""Triton kernels against the torch reference, bit for bit, over random shapes."""

import pytest
import torch

from kernels import reference, triton_kernels
from pdflow.core.dataplane.checksum import checksum_bytes

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOTAL_HEADS = 8


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """Integer view, so comparisons are bitwise (and NaN-proof)."""
    return tensor.view({4: torch.int32, 2: torch.int16}[tensor.element_size()])


def random_case(seed: int, dtype: torch.dtype, device: str) -> dict:
    gen = torch.Generator().manual_seed(seed)

    def pick(*options: int) -> int:
        return options[int(torch.randint(len(options), (1,), generator=gen))]

    num_pages, page_size, head_dim = pick(3, 5, 7), pick(1, 3, 16), pick(4, 8, 12)
    buffers = [
        torch.randn(num_pages, page_size, TOTAL_HEADS, head_dim, generator=gen).to(dtype)
        for _ in range(2 * pick(1, 2, 3))
    ]
    pages = torch.randperm(num_pages, generator=gen)[: pick(1, 2, 3)]
    return {
        "buffers": [b.to(device) for b in buffers],
        "pages": pages.to(device),
        "head_dim": head_dim,
        "gen": gen,
    }


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tp_ratio", [1, 2, 4, 8])
def test_gather_and_scatter_match_reference(dtype: torch.dtype, tp_ratio: int, device: str) -> None:
    case = random_case(tp_ratio * 31 + DTYPES.index(dtype), dtype, device)
    buffers, pages, head_dim = case["buffers"], case["pages"], case["head_dim"]
    heads = TOTAL_HEADS // tp_ratio
    rank = int(torch.randint(tp_ratio, (1,), generator=case["gen"]))
    col_start, col_count = rank * heads * head_dim, heads * head_dim
    size = len(buffers) * len(pages) * buffers[0].shape[1] * col_count

    expected = torch.zeros(size + 7, dtype=dtype, device=device)
    actual = torch.zeros_like(expected)
    reference.gather_to_staging(buffers, pages, col_start, col_count, expected)
    triton_kernels.gather_to_staging(buffers, pages, col_start, col_count, actual)
    assert torch.equal(bits(actual), bits(expected))
    assert not torch.equal(bits(expected[:size]), bits(torch.zeros_like(expected[:size])))

    incoming = torch.randn(size, generator=case["gen"]).to(dtype).to(device)
    want = [b.clone() for b in buffers]
    got = [b.clone() for b in buffers]
    reference.scatter_from_staging(incoming, want, pages, col_start, col_count)
    triton_kernels.scatter_from_staging(incoming, got, pages, col_start, col_count)
    for w, g, original in zip(want, got, buffers, strict=True):
        assert torch.equal(bits(g), bits(w))
        assert not torch.equal(bits(w), bits(original))


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_pages_matches_reference(dtype: torch.dtype, device: str) -> None:
    case = random_case(7 + DTYPES.index(dtype), dtype, device)
    buffers, src_pages = case["buffers"], case["pages"]
    num_pages = buffers[0].shape[0]
    dst_pages = torch.randperm(num_pages, generator=case["gen"])[: len(src_pages)].to(device)
    want = [torch.zeros_like(b) for b in buffers]
    got = [torch.zeros_like(b) for b in buffers]
    reference.copy_pages(buffers, want, src_pages, dst_pages)
    triton_kernels.copy_pages(buffers, got, src_pages, dst_pages)
    for w, g in zip(want, got, strict=True):
        assert torch.equal(bits(g), bits(w))


def test_copy_ranges_handles_odd_lengths_and_byte_words(device: str) -> None:
    src = torch.arange(300, dtype=torch.int16, device=device).view(torch.uint8)
    dst = torch.zeros_like(src)
    base_src, base_dst = src.data_ptr(), dst.data_ptr()
    triton_kernels.copy_ranges(
        [(base_src + 3, base_dst + 10, 101), (base_src + 200, base_dst, 8)], device=device
    )
    expected = torch.zeros_like(src)
    expected[10:111] = src[3:104]
    expected[0:8] = src[200:208]
    assert torch.equal(dst, expected)


@pytest.mark.parametrize("lengths", [[0], [1], [4095, 4096, 4097], [3 * 4096 + 5, 17, 0, 9000]])
def test_checksum_agrees_across_implementations(lengths: list[int], device: str) -> None:
    gen = torch.Generator().manual_seed(sum(lengths))
    chunks = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen) for n in lengths]
    expected = checksum_bytes(b"".join(c.numpy().tobytes() for c in chunks))
    on_device = [c.to(device) for c in chunks]
    assert reference.checksum(on_device) == expected
    assert triton_kernels.checksum(on_device) == expected
    assert expected.length == sum(lengths)


@pytest.mark.parametrize("dtype", DTYPES)
def test_checksum_of_typed_buffers(dtype: torch.dtype, device: str) -> None:
    buffers = random_case(99, dtype, device)["buffers"]
    raw = b"".join(b.cpu().contiguous().view(torch.uint8).numpy().tobytes() for b in buffers)
    assert triton_kernels.checksum(buffers) == reference.checksum(buffers) == checksum_bytes(raw)


def test_overlapping_copies_and_pages_outside_the_pool_are_refused(device: str) -> None:
    """One launch copies blocks in any order, so an overlapping copy corrupted bytes where
    memmove would not; and the kernels index raw addresses, so a page past the pool (or -1)
    read or wrote other memory where the reference refuses or wraps."""
    memory = torch.arange(4096, dtype=torch.uint8, device=device)
    base = memory.data_ptr()
    with pytest.raises(ValueError, match="overlaps"):
        triton_kernels.copy_ranges([(base, base + 8, 1024)], device=device)
    case = random_case(7, torch.float32, device)
    buffers, head_dim = case["buffers"], case["head_dim"]
    pool = buffers[0].shape[0]
    staging = torch.empty(len(buffers) * buffers[0].shape[1] * head_dim, device=device)
    for page in (pool, -1):
        with pytest.raises(IndexError, match=f"in \\[0, {pool}\\)"):
            triton_kernels.gather_to_staging(buffers, torch.tensor([page], device=device), 0,
                                             head_dim, staging)  # fmt: skip
