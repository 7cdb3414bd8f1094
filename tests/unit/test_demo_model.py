"""The demo model: paged prefill/decode equals the non-paged reference, across TP layouts."""

from __future__ import annotations

import pytest
import torch

from pdflow.demo.kvcache import (
    BYTES_PER_ELEMENT,
    K_INDEX,
    V_INDEX,
    KVGeometry,
    OutOfPagesError,
    PageAllocator,
    PagedKVCache,
    reshard_pages,
)
from pdflow.demo.model import (
    ContiguousKV,
    ModelConfig,
    TinyTransformer,
    apply_rope,
    decode,
    generate_reference,
    make_prompts,
    prefill,
    prefill_sharded,
    rope_inverse_frequencies,
)

GQA = ModelConfig(n_kv_heads=2, n_layers=2, seed=11)
MHA = ModelConfig(n_kv_heads=4, n_layers=3, seed=12)
PROMPT_LENGTHS = [1, 7, 15, 16, 17, 40]
MAX_NEW = 20  # crosses at least one page boundary for every prompt length above


@pytest.fixture(scope="module", params=[GQA, MHA], ids=["gqa", "mha"])
def model(request: pytest.FixtureRequest) -> TinyTransformer:
    return TinyTransformer(request.param)


def one_prompt(length: int, seed: int = 5) -> list[int]:
    return make_prompts(seed, 1, length)[0]


def scrambled_pages(count: int, num_pages: int, offset: int) -> list[int]:
    """Distinct, non-consecutive, non-sorted pages: exercises the page table indirection."""
    return [(offset + 5 * i) % num_pages for i in range(count)][::-1]


@pytest.mark.parametrize("prompt_len", PROMPT_LENGTHS)
def test_paged_prefill_and_decode_equal_reference(model: TinyTransformer, prompt_len: int) -> None:
    prompt = one_prompt(prompt_len)
    cache = PagedKVCache(model.config.kv_geometry(), num_pages=16)
    pages = scrambled_pages(cache.geometry.pages_for(prompt_len), 16, offset=3)
    memory = model.new_memory()
    first = prefill(model, prompt, cache, pages, memory)
    decoded = decode(model, first, cache, pages, prompt_len, MAX_NEW, memory=memory,
                     allocate_pages=lambda count: scrambled_pages(count, 16, offset=4))
    assert [first, *decoded] == generate_reference(model, prompt, MAX_NEW)
    assert len(pages) == cache.geometry.pages_for(prompt_len + MAX_NEW)


def test_a_decode_without_the_recurrent_state_generates_other_tokens(
    model: TinyTransformer,
) -> None:
    """The model state is needed: KV alone does not reproduce the reference."""
    prompt = one_prompt(30, seed=4)
    cache = PagedKVCache(model.config.kv_geometry(), num_pages=16)
    pages = cache.allocator.allocate(cache.geometry.pages_for(len(prompt)))
    first = prefill(model, prompt, cache, pages, model.new_memory())
    withheld = decode(model, first, cache, list(pages), len(prompt), MAX_NEW)
    assert [first, *withheld] != generate_reference(model, prompt, MAX_NEW)


def test_reference_matches_full_recompute_without_cache(model: TinyTransformer) -> None:
    prompt = one_prompt(23, seed=9)
    reference = generate_reference(model, prompt, MAX_NEW)
    fed = prompt + reference[:-1]
    # Recomputing everything from scratch checks the KV-cached path (positions, RoPE, mask).
    logits = model.forward(torch.tensor(fed), 0, ContiguousKV(model.config, len(fed)),
                           model.new_memory())
    predicted = logits[len(prompt) - 1:].argmax(dim=-1).tolist()
    assert predicted == reference
    assert len(set(reference)) > 3, "a degenerate model would make every comparison trivial"


@pytest.mark.parametrize("prompt_len", [1, 9, 16, 33])
def test_tp2_prefill_resharded_to_tp1_decodes_like_reference(
    model: TinyTransformer, prompt_len: int
) -> None:
    geometry = model.config.kv_geometry()
    prompt = one_prompt(prompt_len, seed=prompt_len)
    ranks = [PagedKVCache(geometry, 8, tp_rank=r, tp_size=2) for r in range(2)]
    num_prompt_pages = geometry.pages_for(prompt_len)
    rank_pages = [scrambled_pages(num_prompt_pages, 8, offset=r) for r in range(2)]
    memory = model.new_memory()
    first = prefill_sharded(model, prompt, ranks, rank_pages, memory)

    decode_cache = PagedKVCache(geometry, 16)
    decode_pages = decode_cache.allocator.allocate(num_prompt_pages)
    reshard_pages(ranks, rank_pages, [decode_cache], [decode_pages])
    decoded = decode(model, first, decode_cache, decode_pages, prompt_len, MAX_NEW,
                     memory=memory)
    assert [first, *decoded] == generate_reference(model, prompt, MAX_NEW)


def test_each_tp_rank_holds_exactly_its_half_of_the_kv_heads(model: TinyTransformer) -> None:
    geometry = model.config.kv_geometry()
    prompt = one_prompt(21)
    full = PagedKVCache(geometry, 4)
    ranks = [PagedKVCache(geometry, 4, tp_rank=r, tp_size=2) for r in range(2)]
    prefill(model, prompt, full, [0, 1])
    prefill_sharded(model, prompt, ranks, [[2, 3], [1, 0]])
    half = geometry.n_kv_heads // 2
    for layer in range(geometry.n_layers):
        for kind in (K_INDEX, V_INDEX):
            whole = full.buffer(layer, kind)[[0, 1]]
            assert torch.equal(ranks[0].buffer(layer, kind)[[2, 3]], whole[:, :, :half])
            assert torch.equal(ranks[1].buffer(layer, kind)[[1, 0]], whole[:, :, half:])


def test_reshard_tp1_to_tp2_and_back_round_trips(model: TinyTransformer) -> None:
    geometry = model.config.kv_geometry()
    source = PagedKVCache(geometry, 4)
    prefill(model, one_prompt(50), source, [3, 0, 2, 1])
    ranks = [PagedKVCache(geometry, 4, tp_rank=r, tp_size=2) for r in range(2)]
    reshard_pages([source], [[3, 0, 2, 1]], ranks, [[0, 1, 2, 3], [1, 2, 3, 0]])
    back = PagedKVCache(geometry, 4)
    reshard_pages(ranks, [[0, 1, 2, 3], [1, 2, 3, 0]], [back], [[3, 0, 2, 1]])
    assert all(torch.equal(a, b) for a, b in zip(source.buffers(), back.buffers(), strict=True))


def copy_bytes(source: torch.Tensor, source_offset: int, target: torch.Tensor,
               target_offset: int, nbytes: int) -> None:
    """What a transfer engine does: move raw bytes between two registered buffers."""
    source_bytes = source.view(-1).view(torch.uint8)
    target_bytes = target.view(-1).view(torch.uint8)
    target_bytes[target_offset:target_offset + nbytes] = (
        source_bytes[source_offset:source_offset + nbytes]
    )


def test_documented_byte_layout_is_enough_to_move_tp2_kv_into_tp1(
    model: TinyTransformer,
) -> None:
    geometry = model.config.kv_geometry()
    prompt = one_prompt(30, seed=2)
    ranks = [PagedKVCache(geometry, 4, tp_rank=r, tp_size=2) for r in range(2)]
    rank_pages = [[1, 3], [2, 0]]
    memory = model.new_memory()
    first = prefill_sharded(model, prompt, ranks, rank_pages, memory)
    target, target_pages = PagedKVCache(geometry, 8), [6, 4]
    # Per token slot, rank r's heads go to the r-th part of the TP=1 slot (module docstring).
    slot_bytes_per_rank = ranks[0].heads_local * geometry.head_dim * BYTES_PER_ELEMENT
    for buffer_index, target_buffer in enumerate(target.buffers()):
        for rank, cache in enumerate(ranks):
            source_buffer = cache.buffers()[buffer_index]
            for source_page, target_page in zip(rank_pages[rank], target_pages, strict=True):
                for slot in range(geometry.page_size):
                    copy_bytes(
                        source_buffer,
                        source_page * cache.bytes_per_page + slot * slot_bytes_per_rank,
                        target_buffer,
                        target_page * target.bytes_per_page
                        + slot * 2 * slot_bytes_per_rank + rank * slot_bytes_per_rank,
                        slot_bytes_per_rank,
                    )
    decoded = decode(model, first, target, target_pages, len(prompt), MAX_NEW, memory=memory)
    assert [first, *decoded] == generate_reference(model, prompt, MAX_NEW)


def test_buffer_addresses_follow_the_documented_layout() -> None:
    geometry = KVGeometry(n_layers=3, n_kv_heads=4, head_dim=16, page_size=16)
    cache = PagedKVCache(geometry, num_pages=5, tp_rank=1, tp_size=2)
    assert cache.bytes_per_page == 16 * 2 * 16 * 4
    assert cache.buffer_nbytes == 5 * cache.bytes_per_page
    assert cache.total_nbytes == 3 * 2 * cache.buffer_nbytes
    assert cache.head_range == range(2, 4)
    expected = [cache.base_ptr + i * cache.buffer_nbytes for i in range(6)]
    assert cache.data_ptrs() == expected
    element = cache.buffer(2, V_INDEX)[3, 7, 1]
    assert element.data_ptr() == (
        cache.base_ptr + (2 * 2 + V_INDEX) * cache.buffer_nbytes + 3 * cache.bytes_per_page
        + (7 * cache.heads_local + 1) * geometry.head_dim * BYTES_PER_ELEMENT
    )
    model = TinyTransformer(ModelConfig(n_kv_heads=4, n_layers=3))
    rank_zero = PagedKVCache(geometry, 5, tp_rank=0, tp_size=2)
    prefill_sharded(model, one_prompt(40), [rank_zero, cache], [[0, 1, 2], [4, 3, 2]])
    assert cache.data_ptrs() == expected, "buffers must never move once registered"


def test_rope_makes_attention_scores_depend_on_relative_position_only() -> None:
    generator = torch.Generator().manual_seed(0)
    query, key = torch.randn((2, 1, 1, 16), generator=generator)
    frequencies = rope_inverse_frequencies(16, 10000.0)

    def score(query_position: int, key_position: int) -> float:
        rotated_query = apply_rope(query, torch.tensor([query_position]), frequencies)
        rotated_key = apply_rope(key, torch.tensor([key_position]), frequencies)
        return float((rotated_query * rotated_key).sum())

    assert torch.equal(apply_rope(query, torch.tensor([0]), frequencies), query)
    assert score(9, 4) == pytest.approx(score(35, 30), rel=1e-5)
    assert abs(score(9, 4) - score(9, 8)) > 1e-3


def test_same_seed_gives_same_weights_prompts_and_tokens() -> None:
    first, second = TinyTransformer(GQA), TinyTransformer(GQA)
    assert torch.equal(first.embedding, second.embedding)
    assert all(torch.equal(a.wq, b.wq) for a, b in zip(first.layers, second.layers, strict=True))
    assert make_prompts(3, 4, 12) == make_prompts(3, 4, 12)
    prompt = make_prompts(3, 1, 12)[0]
    assert generate_reference(first, prompt, 10) == generate_reference(second, prompt, 10)
    other = TinyTransformer(ModelConfig(n_kv_heads=2, seed=GQA.seed + 1))
    assert not torch.equal(first.lm_head, other.lm_head)
    assert make_prompts(3, 4, 12) != make_prompts(4, 4, 12)
    assert all(0 <= t < 256 for p in make_prompts(3, 4, 12) for t in p)


def test_allocator_hands_out_lowest_pages_and_rejects_overdraw_without_change() -> None:
    allocator = PageAllocator(4)
    assert allocator.allocate(3) == [0, 1, 2]
    with pytest.raises(OutOfPagesError, match="need 2 pages but only 1 of 4 are free"):
        allocator.allocate(2)
    assert allocator.num_free == 1
    allocator.free([1])
    assert allocator.allocate(2) == [1, 3]
    assert allocator.num_free == 0
    with pytest.raises(ValueError, match="not allocated"):
        allocator.free([2, 2 + 10])
    assert allocator.is_allocated(2), "a rejected free must leave every page as it was"
    with pytest.raises(ValueError, match="duplicates"):
        allocator.free([0, 0])
    with pytest.raises(ValueError):
        allocator.allocate(-1)
    with pytest.raises(ValueError):
        PageAllocator(0)


def test_decode_that_cannot_get_pages_fails_before_touching_the_page_table() -> None:
    model = TinyTransformer(GQA)
    cache = PagedKVCache(model.config.kv_geometry(), num_pages=2)
    pages = cache.allocator.allocate(1)
    prompt = one_prompt(10)
    first = prefill(model, prompt, cache, pages)
    with pytest.raises(OutOfPagesError):
        decode(model, first, cache, pages, len(prompt), max_new=30)  # needs 3 pages, has 2
    assert pages == [0]
    assert cache.allocator.num_free == 1


@pytest.mark.parametrize(
    ("pages", "message"),
    [([0], "need 2 pages"), ([0, 9], r"outside \[0, 4\)"), ([1, 1], "duplicates")],
)
def test_prefill_rejects_bad_page_tables(pages: list[int], message: str) -> None:
    model = TinyTransformer(GQA)
    cache = PagedKVCache(model.config.kv_geometry(), num_pages=4)
    with pytest.raises(ValueError, match=message):
        prefill(model, one_prompt(20), cache, pages)
    assert not cache.buffers()[0].any(), "a rejected prefill must write nothing"


def test_bad_inputs_get_clear_errors() -> None:
    model = TinyTransformer(GQA)
    geometry = model.config.kv_geometry()
    cache = PagedKVCache(geometry, 4)
    with pytest.raises(ValueError, match="outside"):
        prefill(model, [1, 257], cache, [0])
    with pytest.raises(ValueError, match="empty"):
        prefill(model, [], cache, [0])
    with pytest.raises(ValueError, match="does not match model"):
        prefill(model, [1], PagedKVCache(ModelConfig(n_kv_heads=4).kv_geometry(), 4), [0])
    with pytest.raises(ValueError, match=r"ranks 0\.\.1"):
        ranks = [PagedKVCache(geometry, 4, tp_rank=r, tp_size=2) for r in (1, 0)]
        prefill_sharded(model, [1, 2], ranks, [[0], [0]])
    with pytest.raises(ValueError, match="cannot be split evenly"):
        PagedKVCache(geometry, 4, tp_rank=0, tp_size=4)
    with pytest.raises(ValueError, match="need 1 pages"):
        decode(model, 3, cache, [], prompt_len=5, max_new=1)
    with pytest.raises(ValueError, match="first_token"):
        decode(model, 999, cache, [0], prompt_len=5, max_new=1)
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        ModelConfig(n_heads=4, n_kv_heads=3)
