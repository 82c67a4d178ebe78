"""The target's preallocated KV cache: the only module that touches HF cache internals.

We build transformers' static cache layers: fixed-capacity (B, heads, capacity, head_dim)
tensors per layer, written in place, here all views of one storage tensor (layers, keys and
values, B, heads, capacity, head_dim). Our layers write new entries at one position tensor
shared by all of them (stock layers each keep and advance a counter of their own): `rewind(L)`
before a step makes the step write at L, and `compact(...)` moves the accepted tree nodes'
entries down to L..L+n-1 in every layer at once. Both are one or two kernels whatever the
depth of the model (a GPU pays per kernel launched outside a recorded step).
Entries past the committed length are stale but never read, because every attention mask we
build hides columns >= the committed length except the step's own tree columns.

Sliding-window layers (a model whose config has `sliding_window`, for all layers or for some
`layer_types`) keep every token too, not a ring buffer of the last `window`: slot j always
holds position j, so compaction and rollback stay the same for every layer. The window lives
in the mask instead: `attention_mask` returns one mask per kind of layer, and a sliding
layer's mask hides keys `window` or more positions behind each query's own position.

A trimmed cache (`trim=True`, for eager steps, whose shapes may change every step) lets
each step attend over the slots in use only, 0..length+U-1, instead of the whole capacity:
its layers hand attention that prefix and its masks have that many columns. A generation
sized for 1,024 new tokens that stops after 200 would otherwise attend over ~1,000 stale
slots every step. Captured steps need one shape, so they keep the whole capacity.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from transformers.cache_utils import Cache, StaticLayer, get_layer_types_and_kwargs

from gumiho.errors import GumihoError

FULL, SLIDING = "full_attention", "sliding_attention"


def attention_kinds(config) -> tuple[list[str], tuple[str, ...], int | None]:
    """(the kind of each layer, the distinct kinds in order of first use, the sliding window).

    config: a transformers decoder config. Only attention layers are supported: their KV
    entries can be compacted and a tree mask tells them what each token sees."""
    layer_types, _ = get_layer_types_and_kwargs(config)
    unknown = sorted(set(layer_types) - {FULL, SLIDING})
    if unknown:
        raise GumihoError(f"target has {', '.join(unknown)} layers: tree verification supports "
                          "full and sliding-window attention layers only")
    window = config.sliding_window if SLIDING in layer_types else None
    return list(layer_types), tuple(dict.fromkeys(layer_types)), window


class _SharedPositionLayer(StaticLayer):
    """A static layer whose keys/values are views of the cache's storage and that writes
    at the cache's shared position without advancing it; attention reads the first
    `cache.visible` slots."""

    def __init__(self, cache: KVCache):
        super().__init__(max_cache_len=cache.capacity)
        self.cache = cache
        self.cumulative_length = cache.position  # () long, shared; what HF reads as length

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs):
        slots = self.cache.slots(key_states.shape[-2])
        self.keys.index_copy_(2, slots, key_states)
        self.values.index_copy_(2, slots, value_states)
        seen = self.cache.visible
        return self.keys[:, :, :seen], self.values[:, :, :seen]


class KVCache:
    """A target KV cache of fixed capacity with accepted-path compaction."""

    def __init__(self, config, capacity: int, device: torch.device, dtype: torch.dtype,
                 trim: bool = False):
        """config: a transformers decoder config (the target's, or the drafter's Llama one).
        trim: each step attends over the slots in use only (module doc); eager steps only."""
        layer_types, self.kinds, self.window = attention_kinds(config)
        self.capacity, self.trim = capacity, trim
        self.visible = capacity  # slots the next step attends over (begin_step sets it)
        self.length = 0  # committed tokens; a Python int, known on the host without a sync
        self.device, self.dtype = device, dtype
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = (getattr(config, "head_dim", None)
                    or config.hidden_size // config.num_attention_heads)
        self.position = torch.zeros((), dtype=torch.long, device=device)  # next write slot
        self._slots: Tensor | None = None  # this step's write slots (`slots`)
        # (layers, keys/values, B, heads, capacity, head_dim): one tensor for every layer
        self.storage = torch.zeros(len(layer_types), 2, 1, heads, capacity, head_dim,
                                   dtype=dtype, device=device)
        # Full-length static layers for every layer, sliding ones included (module doc).
        layers = [_SharedPositionLayer(self) for _ in layer_types]
        self.hf = Cache(layers=layers)
        for i, layer in enumerate(layers):  # what HF's lazy initialisation would set
            layer.dtype, layer.device = dtype, torch.device(device)
            layer.batch_size, layer.num_heads = 1, heads
            layer.k_head_dim = layer.v_head_dim = head_dim
            layer.keys, layer.values = self.storage[i, 0], self.storage[i, 1]
            layer.is_initialized = True

    @classmethod
    def for_model(cls, model: torch.nn.Module, capacity: int, trim: bool = False) -> KVCache:
        weight = model.get_output_embeddings().weight
        return cls(model.config.get_text_config(decoder=True), capacity, weight.device,
                   weight.dtype, trim)

    def rewind(self, length: int) -> None:
        """Make the next forward write its K new entries at slots length..length+K-1."""
        self.position.fill_(length)
        self._slots = None

    def seek(self, write_at: Tensor) -> None:
        """Device-side `rewind`, for captured steps: write_at is a (1,) long tensor."""
        self.position.copy_(write_at[0])
        self._slots = None

    def slots(self, new_tokens: int) -> Tensor:
        """The slots a step of `new_tokens` tokens writes, position..position+K-1: made at
        its first layer and shared by the rest (two kernels a step, not two per layer; a
        small model's step on a GPU costs what its kernels number). Only `rewind` and `seek`
        move the position, and both drop them."""
        if self._slots is None or self._slots.shape[0] != new_tokens:
            self._slots = torch.arange(new_tokens, device=self.device) + self.position
        return self._slots

    def write_position(self, offset: int = 0) -> Tensor:
        """Where the next step writes, as the (1,) tensor a captured step takes."""
        return torch.full((1,), self.length + offset, dtype=torch.long, device=self.device)

    def reset(self) -> None:
        """Start a new sequence in the same memory (captured steps stay valid)."""
        self.length = 0
        self.rewind(0)

    def begin_step(self, new_tokens: int, offset: int = 0) -> None:
        """Prepare a forward over `new_tokens` tokens: they go to slots length + offset.. .

        offset > 0 stacks a step on uncommitted entries of earlier steps (the drafter's
        tree levels). Rewinding makes a step independent of what the last one left behind."""
        self.reserve(offset + new_tokens)
        self.rewind(self.length + offset)

    def reserve(self, slots: int) -> None:
        """The host side of `begin_step`, for steps that seek their own write positions
        (device tensors): check that `slots` uncommitted slots past the committed length fit,
        and let a trimmed cache's steps attend over them."""
        end = self.length + slots
        if end > self.capacity:
            raise GumihoError(f"KV cache full ({self.capacity} slots): raise the capacity")
        if self.trim:
            self.visible = end

    def attention_mask(self, tree_mask: Tensor, positions: Tensor | None = None) -> Tensor:
        """The (M, 1, K, visible) bool masks (visible: the capacity, or the slots in use
        when trimmed) for K new tokens, one per kind of layer
        (`self.kinds`; M = 1 unless full and sliding layers are mixed).

        tree_mask: (K, U) bool over the U uncommitted slots length..length+U-1 (earlier
        steps' entries, then the K new ones): [i, j] true where new token i may see slot
        length + j (itself and its ancestors). Every new token sees the committed context;
        in a sliding layer only the part less than `window` positions behind its own.
        positions: (K,) the new tokens' positions; needed when there is a window (then the
        K new tokens must be all the uncommitted ones, U == K).
        """
        return self.mask_at(tree_mask, self.write_position(), positions)

    def mask_at(self, tree_mask: Tensor, start: Tensor, positions: Tensor | None = None
                ) -> Tensor:
        """`attention_mask` with the committed length given as a device tensor, start (1,)
        long: the step's U uncommitted slots begin at slot `start`. The masks are made on
        the device from it, so a recorded step can use it (it may not read `length`, which
        a replay would see frozen). positions: as for `attention_mask`."""
        k, u = tree_mask.shape
        rel = torch.arange(self.visible, device=tree_mask.device) - start  # (visible,)
        new = tree_mask.index_select(1, rel.clamp(0, u - 1)) & (rel < u)  # (K, visible)
        mask = new | (rel < 0)
        if self.window is None:
            return mask[None, None]
        if positions is None or u != k:
            raise GumihoError("internal: a sliding-window mask needs the step's positions")
        # slot j < start holds position j; the new tokens' slots hold their own positions
        keys = torch.where(rel >= 0, positions[rel.clamp(0, k - 1)], rel + start)
        near = positions[:, None] - keys[None, :] < self.window  # HF: q - kv < window
        return torch.stack([mask & near if kind == SLIDING else mask
                            for kind in self.kinds])[:, None]

    def commit(self, num_tokens: int) -> None:
        """Accept the step's first `num_tokens` entries as they lie (a chain, e.g. prefill).
        (No rewind here: every step rewinds or seeks before it writes.)"""
        self.length += num_tokens

    def compact(self, accepted: Tensor) -> None:
        """Keep the step's entries at tree positions `accepted` (n,) as the next n tokens.

        accepted holds indices into the tokens of the last step (root first); their entries
        lie at slots length + accepted and move to length..length+n-1.
        """
        n = accepted.shape[0]
        src = self.length + accepted
        dst = torch.arange(self.length, self.length + n, device=accepted.device)
        # every layer's keys and values at once; index_select copies first, so overlapping
        # source and destination are safe
        self.storage.index_copy_(4, dst, self.storage.index_select(4, src))
        self.commit(n)

    def keys_values(self, layer: int) -> tuple[Tensor, Tensor]:
        """The committed (1, heads, length, head_dim) keys and values of one layer (for tests)."""
        entry = self.hf.layers[layer]
        return entry.keys[:, :, : self.length], entry.values[:, :, : self.length]


def reuse_or_allocate(current: KVCache | None, capacity: int, captured: bool,
                      allocate: Callable[[int, bool], KVCache]) -> tuple[KVCache, bool]:
    """The cache for a sequence that needs `capacity` slots, and whether it is new.
    allocate(capacity, trim) makes one.

    Eager runs get a trimmed cache of exactly that size. Captured steps are bound to a cache's
    memory, so captured engines reset and reuse `current` while it is big enough and
    otherwise allocate one rounded up to 512 slots; the caller rebuilds its steps when
    the cache is new."""
    if captured and current is not None and current.capacity >= capacity:
        current.reset()
        return current, False
    if captured:
        capacity = -(-capacity // 512) * 512
    return allocate(capacity, not captured), True
