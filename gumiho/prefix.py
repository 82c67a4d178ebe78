"""Prefix reuse: a prompt that begins with the last sequence skips its prefill there.

A conversation sends its whole history each turn (`gumiho chat`, an API client), and on a
CPU the prefill of 1,000 tokens of history costs SmolLM2 0.5 s in bf16, 1.4 s in float32
(2-core AMX Xeon), as long as ~50-100 decoded tokens. With `reuse_prefix`, a generation
leaves its target cache as it is, with the token ids and the target's features (last hidden
states) of the entries committed there; the next generation with `reuse_prefix` whose
prompt begins with those tokens keeps those entries and prefills only the rest (at least
its last token, whose logits the first token needs). The drafter is told the whole prompt's
features as without reuse: its own prefill (one layer) runs over all of it.

What changes: the reused entries were computed in other shapes (an earlier prefill, the
verify steps), so the logits differ from a fresh prefill's in the last bits, and at a near
tie a greedy answer can differ from the one without reuse. Speculative decoding stays
lossless against plain decoding with the same reuse (the verify is unchanged), which the
tests check. Off by default (`generate`, the evaluation and the demo measure fresh
prompts); `gumiho chat` turns it on. The idea is vLLM's automatic prefix caching and
SGLang's radix cache, here for one sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from gumiho.kv_cache import KVCache


@dataclass
class Prefix:
    """What a runner's cache holds after a generation with `reuse_prefix`: the token ids of
    its committed entries, in order, and the target's features there ((n_i, H) pieces)."""

    cache: KVCache
    tokens: list[int]
    features: list[Tensor] = field(default_factory=list)

    def add(self, tokens: list[int], features: Tensor) -> None:
        """Entries a cycle committed: their tokens and features (len(tokens), H)."""
        self.tokens += tokens
        self.features.append(features)

    def usable(self) -> bool:
        """Whether the cache holds exactly these tokens (a generation stopped inside a
        cycle, between the cache's commit and `add`, leaves it unusable)."""
        return self.cache.length == len(self.tokens) == sum(f.shape[0] for f in self.features)


def shared_length(cached: list[int], prompt: list[int]) -> int:
    """How many leading tokens `prompt` shares with `cached`, leaving at least its last
    token to prefill."""
    limit = min(len(cached), len(prompt) - 1)
    n = 0
    while n < limit and cached[n] == prompt[n]:
        n += 1
    return n


def cache_reusing(runner, prompt_ids: list[int], capacity: int
                  ) -> tuple[KVCache, int, Tensor | None]:
    """The cache for a sequence of `capacity` slots from the runner (engine.TargetRunner),
    its first p slots holding the runner's last sequence's entries for prompt_ids[:p], as
    committed entries: (cache, p, their features (p, H), or None when p is 0)."""
    prefix = runner.prefix
    p = shared_length(prefix.tokens, prompt_ids) if prefix and prefix.usable() else 0
    # (a captured engine's cache is reset, in place; drops runner.prefix: it is this one's)
    cache = runner.cache_for(capacity)
    if p == 0:
        return cache, 0, None
    if cache is not prefix.cache:  # eager runs size a cache to each sequence: move them
        cache.storage[..., :p, :].copy_(prefix.cache.storage[..., :p, :])
    cache.commit(p)
    return cache, p, torch.cat(prefix.features)[:p]
