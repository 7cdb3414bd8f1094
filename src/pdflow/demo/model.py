"""Tiny seeded decoder-only transformer and greedy generation over paged or contiguous KV.

The model is a llama-style stack (RMSNorm, RoPE, grouped-query attention, SwiGLU MLP) in
float32 on CPU, with weights drawn from a seeded ``torch.Generator``: no downloads, no global
RNG, and identical weights for identical configs in every process.

Besides attention the model carries one recurrent state, a ``d_model`` memory vector updated
token by token (``memory = decay * memory + embedding``) and mixed into every position's input:
the model-state component a PD transfer must move besides the KV (a stand-in for a Mamba
layer's state). A decode that starts from a zero memory generates other tokens.

Generation is split the way PD disaggregation splits it:

* ``prefill`` / ``prefill_sharded`` run the prompt, write its K/V into pages of one cache or of
  a TP group of caches, and return the first (greedy) output token;
* ``decode`` starts from KV pages that somebody else filled plus that first token;
* ``generate_reference`` does both in one process with contiguous (non-paged) KV.

Every path runs the same forward with the same tensor shapes per step (the whole prompt at
once, then one token per step), and paged reads return exactly the values written, so
``[prefill(...)] + decode(...)`` equals ``generate_reference(...)`` bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from pdflow.demo.kvcache import DTYPE, KVGeometry, PagedKVCache, PagedSequenceKV


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 257  # 256 byte values plus one spare id
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2  # < n_heads: grouped-query attention; == n_heads: multi-head
    head_dim: int = 16
    d_ff: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    page_size: int = 16
    seed: int = 0
    memory_decay: float = 0.9

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "d_model",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "head_dim",
            "d_ff",
            "page_size",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads {self.n_heads} must be a multiple of n_kv_heads {self.n_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {self.head_dim}")

    def kv_geometry(self) -> KVGeometry:
        return KVGeometry(self.n_layers, self.n_kv_heads, self.head_dim, self.page_size)


class KVStore(Protocol):
    """Where attention keeps one sequence's K/V; ``[n, n_kv_heads, head_dim]`` per call."""

    def write(self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None: ...

    def read(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]: ...


class ContiguousKV:
    """Non-paged KV of one sequence: the single-process reference store."""

    def __init__(self, config: ModelConfig, capacity_tokens: int) -> None:
        shape = (config.n_layers, capacity_tokens, config.n_kv_heads, config.head_dim)
        self._keys = torch.zeros(shape, dtype=DTYPE)
        self._values = torch.zeros(shape, dtype=DTYPE)

    def write(self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        self._keys[layer, start : start + keys.shape[0]] = keys
        self._values[layer, start : start + values.shape[0]] = values

    def read(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._keys[layer, :length], self._values[layer, :length]


@dataclass(frozen=True)
class LayerWeights:
    attn_norm: torch.Tensor
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    mlp_norm: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def rope_inverse_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    half = head_dim // 2
    return 1.0 / (theta ** (torch.arange(half, dtype=DTYPE) / half))


def apply_rope(
    x: torch.Tensor, positions: torch.Tensor, inverse_frequencies: torch.Tensor
) -> torch.Tensor:
    """Rotate ``x`` ``[count, heads, head_dim]`` by its positions (rotate-half convention)."""
    angles = positions[:, None].to(DTYPE) * inverse_frequencies  # [count, head_dim / 2]
    cos, sin = torch.cos(angles)[:, None, :], torch.sin(angles)[:, None, :]
    first, second = x.chunk(2, dim=-1)
    return torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)


class TinyTransformer:
    """Inference-only model; weights depend on ``config`` (including its seed) alone."""

    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        generator = torch.Generator().manual_seed(config.seed)

        def draw(rows: int, cols: int) -> torch.Tensor:
            # 1/sqrt(fan_in) keeps activations and logits O(1), so greedy picks vary.
            scale = 1.0 / math.sqrt(cols)
            return torch.randn((rows, cols), generator=generator, dtype=DTYPE) * scale

        d, q_width, kv_width = (
            config.d_model,
            config.n_heads * config.head_dim,
            (config.n_kv_heads * config.head_dim),
        )
        self.embedding = torch.randn((config.vocab_size, d), generator=generator, dtype=DTYPE)
        self.layers = [
            LayerWeights(
                attn_norm=torch.ones(d, dtype=DTYPE),
                wq=draw(q_width, d),
                wk=draw(kv_width, d),
                wv=draw(kv_width, d),
                wo=draw(d, q_width),
                mlp_norm=torch.ones(d, dtype=DTYPE),
                w_gate=draw(config.d_ff, d),
                w_up=draw(config.d_ff, d),
                w_down=draw(d, config.d_ff),
            )
            for _ in range(config.n_layers)
        ]
        self.final_norm = torch.ones(d, dtype=DTYPE)
        self.lm_head = draw(config.vocab_size, d)
        self.w_memory = draw(d, d)  # drawn last: the attention weights stay what they were
        self._inverse_frequencies = rope_inverse_frequencies(config.head_dim, config.rope_theta)

    def check_tokens(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Token ids as a tensor, or a ValueError naming the bad ids."""
        if len(token_ids) == 0:
            raise ValueError("token_ids must not be empty")
        bad = [t for t in token_ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:8]} outside [0, {self.config.vocab_size})")
        return torch.tensor(list(token_ids), dtype=torch.long)

    def new_memory(self) -> torch.Tensor:
        """The recurrent state before any token: zeros, ``[d_model]`` float32."""
        return torch.zeros(self.config.d_model, dtype=DTYPE)

    @torch.inference_mode()
    def forward(
        self, token_ids: torch.Tensor, start: int, kv: KVStore, memory: torch.Tensor
    ) -> torch.Tensor:
        """Logits ``[n, vocab]`` of tokens at positions ``[start, start + n)``.

        Appends their K/V to ``kv``, which must already hold positions ``[0, start)``, and
        advances ``memory`` (the state after position ``start - 1``) over them, in place.
        """
        config = self.config
        positions = torch.arange(start, start + token_ids.shape[0])
        hidden = self.embedding[token_ids]
        states = []
        for embedded in hidden:  # token by token in every path, so every path rounds alike
            memory.mul_(config.memory_decay).add_(embedded)
            states.append(memory.clone())
        hidden = hidden + torch.stack(states) @ self.w_memory.T
        for layer_index, layer in enumerate(self.layers):
            normed = _rms_norm(hidden, layer.attn_norm, config.norm_eps)
            hidden = hidden + self._attention(layer_index, layer, normed, positions, kv)
            normed = _rms_norm(hidden, layer.mlp_norm, config.norm_eps)
            gate = torch.nn.functional.silu(normed @ layer.w_gate.T)
            hidden = hidden + (gate * (normed @ layer.w_up.T)) @ layer.w_down.T
        return _rms_norm(hidden, self.final_norm, config.norm_eps) @ self.lm_head.T

    def _attention(
        self,
        layer_index: int,
        layer: LayerWeights,
        x: torch.Tensor,
        positions: torch.Tensor,
        kv: KVStore,
    ) -> torch.Tensor:
        config = self.config
        count = x.shape[0]
        queries = apply_rope(
            (x @ layer.wq.T).view(count, config.n_heads, config.head_dim),
            positions,
            self._inverse_frequencies,
        )
        keys = apply_rope(
            (x @ layer.wk.T).view(count, config.n_kv_heads, config.head_dim),
            positions,
            self._inverse_frequencies,
        )
        values = (x @ layer.wv.T).view(count, config.n_kv_heads, config.head_dim)
        start = int(positions[0])
        kv.write(layer_index, start, keys, values)
        all_keys, all_values = kv.read(layer_index, start + count)
        group = config.n_heads // config.n_kv_heads
        all_keys = all_keys.repeat_interleave(group, dim=1)  # [seq, n_heads, head_dim]
        all_values = all_values.repeat_interleave(group, dim=1)
        scores = queries.transpose(0, 1) @ all_keys.permute(1, 2, 0)  # [heads, count, seq]
        scores = scores / math.sqrt(config.head_dim)
        future = torch.arange(start + count) > positions[:, None]  # causal mask [count, seq]
        scores = scores.masked_fill(future, float("-inf"))
        mixed = torch.softmax(scores, dim=-1) @ all_values.transpose(0, 1)  # [heads, count, dim]
        return mixed.transpose(0, 1).reshape(count, -1) @ layer.wo.T


def _greedy(logits: torch.Tensor) -> int:
    return int(torch.argmax(logits[-1]))


def _run_prompt(
    model: TinyTransformer, tokens: torch.Tensor, kv: KVStore, memory: torch.Tensor
) -> int:
    return _greedy(model.forward(tokens, 0, kv, memory))


def _continue(
    model: TinyTransformer, token: int, position: int, max_new: int, kv: KVStore,
    memory: torch.Tensor,
) -> list[int]:  # fmt: skip
    generated: list[int] = []
    for step in range(max_new):
        token = _greedy(model.forward(torch.tensor([token]), position + step, kv, memory))
        generated.append(token)
    return generated


def prefill(
    model: TinyTransformer, token_ids: Sequence[int], cache: PagedKVCache, pages: Sequence[int],
    memory: torch.Tensor | None = None,
) -> int:  # fmt: skip
    """Write the prompt's K/V into ``pages`` of a TP=1 ``cache`` and its recurrent state into
    ``memory`` (when given); return the first token."""
    return prefill_sharded(model, token_ids, [cache], [pages], memory)


def prefill_sharded(
    model: TinyTransformer,
    token_ids: Sequence[int],
    caches: Sequence[PagedKVCache],
    pages_per_rank: Sequence[Sequence[int]],
    memory: torch.Tensor | None = None,
) -> int:
    """Prefill with KV laid out over a TP group: rank r's cache gets its slice of KV heads; the
    recurrent state after the prompt goes into ``memory`` (zeroed first) when given.

    The arithmetic is the full model's; only the storage is split, as in a TP instance.
    """
    tokens = model.check_tokens(token_ids)
    _check_caches_fit(model, caches)
    kv = PagedSequenceKV(caches, pages_per_rank, capacity_tokens=len(tokens))
    state = model.new_memory() if memory is None else memory.zero_()
    return _run_prompt(model, tokens, kv, state)


def decode(
    model: TinyTransformer,
    first_token: int,
    cache: PagedKVCache,
    pages: list[int],
    prompt_len: int,
    max_new: int,
    *,
    memory: torch.Tensor | None = None,
    allocate_pages: Callable[[int], list[int]] | None = None,
) -> list[int]:
    """Generate ``max_new`` tokens after ``first_token`` from a prompt KV already in ``pages``
    and the recurrent state after the prompt, ``memory`` (a copy is advanced; None: zeros, as
    if the state had been withheld).

    The pages hold the prompt's ``prompt_len`` tokens (filled by ``prefill`` or by a transfer).
    Pages for the tokens still to come are taken up front, all at once, from
    ``allocate_pages(count)`` (default: ``cache.allocator.allocate``) and appended to
    ``pages`` in place, so the caller frees the whole table when the sequence is done.
    """
    if not 0 <= first_token < model.config.vocab_size:
        raise ValueError(f"first_token {first_token} outside [0, {model.config.vocab_size})")
    if prompt_len <= 0 or max_new < 0:
        raise ValueError(f"need prompt_len > 0 and max_new >= 0, got {prompt_len}, {max_new}")
    _check_caches_fit(model, [cache])
    cache.check_pages(pages, prompt_len)
    total_tokens = prompt_len + max_new
    missing = cache.geometry.pages_for(total_tokens) - len(pages)
    if missing > 0:
        grown = [*pages, *(allocate_pages or cache.allocator.allocate)(missing)]
        cache.check_pages(grown, total_tokens)
        pages[:] = grown
    kv = PagedSequenceKV([cache], [pages], capacity_tokens=total_tokens)
    state = model.new_memory() if memory is None else memory.clone()
    return _continue(model, first_token, prompt_len, max_new, kv, state)


def generate_reference(model: TinyTransformer, token_ids: Sequence[int], max_new: int) -> list[int]:
    """Single-process, non-paged run: the first token followed by ``max_new`` more."""
    if max_new < 0:
        raise ValueError(f"max_new must be >= 0, got {max_new}")
    tokens = model.check_tokens(token_ids)
    kv = ContiguousKV(model.config, len(tokens) + max_new)
    memory = model.new_memory()
    first = _run_prompt(model, tokens, kv, memory)
    return [first, *_continue(model, first, len(tokens), max_new, kv, memory)]


def make_prompts(seed: int, n: int, prompt_len: int, *, token_limit: int = 256) -> list[list[int]]:
    """``n`` prompts of ``prompt_len`` token ids in ``[0, token_limit)``, fixed by ``seed``."""
    if n < 0 or prompt_len <= 0 or token_limit <= 0:
        raise ValueError(
            f"need n >= 0, prompt_len > 0, token_limit > 0; got {n}, {prompt_len}, {token_limit}"
        )
    generator = torch.Generator().manual_seed(seed)
    ids: list[list[int]] = torch.randint(
        0, token_limit, (n, prompt_len), generator=generator
    ).tolist()
    return ids


def _check_caches_fit(model: TinyTransformer, caches: Sequence[PagedKVCache]) -> None:
    expected = model.config.kv_geometry()
    for cache in caches:
        if cache.geometry != expected:
            raise ValueError(f"cache geometry {cache.geometry} does not match model {expected}")
