"""The target's preallocated KV cache: the only module that touches HF cache internals.

We wrap transformers' `StaticCache`: fixed-capacity (B, heads, capacity, head_dim) tensors
per layer, written in place. Its layers write new entries at their own `cumulative_length`
counter, so we own that counter: `rewind(L)` before a step makes the step write at L, and
`compact(...)` moves the accepted tree nodes' entries down to L..L+n-1. Entries past the
committed length are stale but never read, because every attention mask we build hides
columns >= the committed length except the step's own tree columns.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from transformers import StaticCache

from gumiho.errors import GumihoError


class KVCache:
    """A target KV cache of fixed capacity with accepted-path compaction."""

    def __init__(self, config, capacity: int, device: torch.device, dtype: torch.dtype):
        """config: a transformers decoder config (the target's, or the drafter's Llama one)."""
        window = getattr(config, "sliding_window", None)
        if window is not None and getattr(config, "use_sliding_window", True) and capacity > window:
            raise GumihoError(
                f"prompt + max_new_tokens + tree needs {capacity} cache slots but the target's "
                f"sliding window is {window}: lower --max-new-tokens or shorten the prompt"
            )
        self.capacity = capacity
        self.length = 0  # committed tokens; a Python int, known on the host without a sync
        self.device, self.dtype = device, dtype
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = (getattr(config, "head_dim", None)
                    or config.hidden_size // config.num_attention_heads)
        with torch.device(device):  # the layers' write counters are born on the device
            self.hf = StaticCache(config=config, max_cache_len=capacity)
            # Allocate now so compaction can run before the first write of a sequence.
            self.hf.early_initialization(batch_size=1, num_heads=heads, head_dim=head_dim,
                                         dtype=self.dtype, device=self.device)

    @classmethod
    def for_model(cls, model: torch.nn.Module, capacity: int) -> KVCache:
        weight = model.get_output_embeddings().weight
        return cls(model.config.get_text_config(decoder=True), capacity, weight.device,
                   weight.dtype)

    def rewind(self, length: int) -> None:
        """Make the next forward write its K new entries at slots length..length+K-1."""
        for layer in self.hf.layers:
            layer.cumulative_length.fill_(length)

    def seek(self, write_at: Tensor) -> None:
        """Device-side `rewind`, for captured steps: write_at is a (1,) long tensor."""
        for layer in self.hf.layers:
            layer.cumulative_length.copy_(write_at[0])

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
        if self.length + offset + new_tokens > self.capacity:
            raise GumihoError(f"KV cache full ({self.capacity} slots): raise the capacity")
        self.rewind(self.length + offset)

    def attention_mask(self, tree_mask: Tensor) -> Tensor:
        """The (1, 1, K, capacity) bool mask for K new tokens.

        tree_mask: (K, U) bool over the U uncommitted slots length..length+U-1 (earlier
        steps' entries, then the K new ones): [i, j] true where new token i may see slot
        length + j (itself and its ancestors). Every new token sees the committed context.
        """
        k, u = tree_mask.shape
        mask = torch.zeros(k, self.capacity, dtype=torch.bool, device=tree_mask.device)
        mask[:, : self.length] = True
        mask[:, self.length : self.length + u] = tree_mask
        return mask[None, None]

    def commit(self, num_tokens: int) -> None:
        """Accept the step's first `num_tokens` entries as they lie (a chain, e.g. prefill)."""
        self.length += num_tokens
        self.rewind(self.length)

    def compact(self, accepted: Tensor) -> None:
        """Keep the step's entries at tree positions `accepted` (n,) as the next n tokens.

        accepted holds indices into the tokens of the last step (root first); their entries
        lie at slots length + accepted and move to length..length+n-1.
        """
        n = accepted.shape[0]
        src = self.length + accepted
        dst = torch.arange(self.length, self.length + n, device=accepted.device)
        for layer in self.hf.layers:
            # index_select copies first, so overlapping source and destination are safe.
            layer.keys.index_copy_(2, dst, layer.keys.index_select(2, src))
            layer.values.index_copy_(2, dst, layer.values.index_select(2, src))
        self.commit(n)

    def keys_values(self, layer: int) -> tuple[Tensor, Tensor]:
        """The committed (1, heads, length, head_dim) keys and values of one layer (for tests)."""
        entry = self.hf.layers[layer]
        return entry.keys[:, :, : self.length], entry.values[:, :, : self.length]


def reuse_or_allocate(current: KVCache | None, capacity: int, captured: bool,
                      allocate: Callable[[int], KVCache]) -> tuple[KVCache, bool]:
    """The cache for a sequence that needs `capacity` slots, and whether it is new.

    Eager runs get a cache of exactly that size. Captured steps are bound to a cache's
    memory, so captured engines reset and reuse `current` while it is big enough and
    otherwise allocate one rounded up to 512 slots; the caller rebuilds its steps when
    the cache is new."""
    if captured and current is not None and current.capacity >= capacity:
        current.reset()
        return current, False
    if captured:
        capacity = -(-capacity // 512) * 512
    return allocate(capacity), True
