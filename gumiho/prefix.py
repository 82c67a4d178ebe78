"""Prefix reuse: a prompt that begins with the last sequence skips its prefill there.

A conversation sends its whole history each turn (`gumiho chat`, an API client), and on a
CPU the prefill of 1,000 tokens of history costs SmolLM2 0.5 s in bf16, 1.4 s in float32
(2-core AMX Xeon), as long as ~50-100 decoded tokens. With `reuse_prefix`, a generation
leaves its target cache as it is, with the token ids and the target's features (last hidden
states) of the entries committed there; the next generation with `reuse_prefix` whose
prompt begins with those tokens keeps those entries and prefills only the rest (at least
its last token, whose logits the first token needs). On a CPU the last four such sequences
are kept (each in its own cache: 23 MB a thousand tokens for SmolLM2 in bf16), elsewhere
the last one. The drafter is told the whole prompt's
features as without reuse: its own prefill (one layer) runs over all of it.

What changes: the reused entries were computed in other shapes (an earlier prefill, the
verify steps), so the logits differ from a fresh prefill's in the last bits, and at a near
tie a greedy answer can differ from the one without reuse. Speculative decoding stays
lossless against plain decoding with the same reuse (the verify is unchanged), which the
tests check. Off by default (`generate`, the evaluation and the demo measure fresh
prompts); `gumiho chat` turns it on. The idea is vLLM's automatic prefix caching and
SGLang's radix cache, here for a few whole sequences.
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
    spoiled: bool = False  # entries committed that a prefill of their tokens would not make

    def add(self, tokens: list[int], features: Tensor) -> None:
        """Entries a cycle committed: their tokens and features (len(tokens), H)."""
        self.tokens += tokens
        self.features.append(features)

    def usable(self) -> bool:
        """Whether the cache holds exactly these tokens, as a prefill of them makes them
        (a generation stopped inside a cycle, between the cache's commit and `add`, leaves
        it unusable; so does a cycle of the official FTA that spliced, whose nodes attended
        to more than their ancestors)."""
        return not self.spoiled and self.cache.length == len(self.tokens) == sum(
            f.shape[0] for f in self.features)


def shared_length(cached: list[int], prompt: list[int]) -> int:
    """How many leading tokens `prompt` shares with `cached`, leaving at least its last
    token to prefill."""
    limit = min(len(cached), len(prompt) - 1)
    n = 0
    while n < limit and cached[n] == prompt[n]:
        n += 1
    return n


class Prefixes:
    """The sequences a runner's caches still hold, the most recently used last, at most
    `size`. An eager runner gives each sequence a cache of its own, so several can be kept
    (a chat client's side requests, a title or a summary, then come between two turns of a
    conversation); a captured engine's one cache holds only its last."""

    def __init__(self, size: int):
        self.size = size
        self.kept: list[Prefix] = []

    @property
    def latest(self) -> Prefix | None:
        return self.kept[-1] if self.kept else None

    def best(self, prompt_ids: list[int]) -> tuple[Prefix | None, int]:
        """The kept sequence sharing the longest start with `prompt_ids`, and its length."""
        found, most = None, 0
        for prefix in self.kept:
            n = shared_length(prefix.tokens, prompt_ids) if prefix.usable() else 0
            if n > most:
                found, most = prefix, n
        return found, most

    def keep(self, prefix: Prefix) -> None:
        """Keep `prefix` as the most recently used (the oldest past `size` go)."""
        self.kept = ([p for p in self.kept if p is not prefix] + [prefix])[-self.size:]

    def clear(self) -> None:
        self.kept = []


def cache_reusing(runner, prompt_ids: list[int], capacity: int
                  ) -> tuple[KVCache, int, Tensor | None]:
    """The cache for a sequence of `capacity` slots from the runner (engine.TargetRunner),
    its first p slots holding a kept sequence's entries for prompt_ids[:p] (the longest such
    start), as committed entries: (cache, p, their features (p, H), or None when p is 0)."""
    prefix, p = runner.prefixes.best(prompt_ids)
    # (a captured engine's one cache is reset in place, its entries still there to keep)
    cache = runner.cache_for(capacity)
    if p == 0:
        return cache, 0, None
    if prefix in runner.prefixes.kept:
        runner.prefixes.keep(prefix)  # used: the last to go
    if cache is not prefix.cache:  # eager runs size a cache to each sequence: move them
        cache.storage[..., :p, :].copy_(prefix.cache.storage[..., :p, :])
    cache.commit(p)
    return cache, p, torch.cat(prefix.features)[:p]
