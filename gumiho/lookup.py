"""Prompt-lookup candidates: n-gram continuations from the text so far, no network.

The idea is prompt lookup decoding (Saxena 2023; in Hugging Face `generate` as
`prompt_lookup_num_tokens`): when the last few tokens occurred before (in the prompt or the
answer so far), the tokens that followed them then are a cheap guess for what follows now.
Summaries, code edits and answers that quote gain the most.

`LookupDrafter` adds such a chain as extra branches under the root of any drafter's tree
(plain decoding included: that is the `lookup` method). The chain is merged into the tree:
its leading tokens that the tree already has under the root are not repeated (those slots
are kept but marked dead, so every step has one shape), and the rest hangs below the
deepest shared node. Verification is unchanged, so the output stays exactly the target's.
The n-gram search runs on the host over the tokens the loop already brought back; the
chain reaches the device in one non-blocking copy.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import numpy as np
import torch
from torch import Tensor

from gumiho.drafter_api import DrafterWrapper
from gumiho.graphs import StaticStep
from gumiho.hostsync import upload
from gumiho.tree import DraftTree


class NgramIndex:
    """The end of the latest earlier occurrence of every n-gram (n = 1..max_n) of a growing
    token list, so that `continuation` is O(max_n) per call."""

    def __init__(self, max_n: int = 3, min_n: int = 1):
        self.max_n, self.min_n = max_n, min_n
        self.tokens: list[int] = []
        self.last: dict[tuple[int, ...], int] = {}  # n-gram -> end of its latest occurrence
        self.previous: dict[tuple[int, ...], int] = {}  # ... and of the one before

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            self.tokens.append(token)
            end = len(self.tokens)
            for n in range(1, min(self.max_n, end) + 1):
                key = tuple(self.tokens[end - n :])
                if key in self.last:
                    self.previous[key] = self.last[key]
                self.last[key] = end

    def find(self, length: int) -> tuple[int, list[int]]:
        """(n, continuation): the length of the longest suffix n-gram that occurred before
        (longest first, down to min_n; 0: none recurs) and up to `length` tokens that
        followed its latest earlier occurrence (empty when none recurs)."""
        end = len(self.tokens)
        for n in range(min(self.max_n, end), self.min_n - 1, -1):
            start = self.previous.get(tuple(self.tokens[end - n :]))
            if start is not None:
                return n, self.tokens[start : start + length]
        return 0, []

    def chain(self, length: int, short: int) -> tuple[int, list[int]]:
        """`find`, except that a match shorter than max_n keeps only its first `short`
        tokens (LookupDrafter's rule; scripts/lookup_chains.py replays it)."""
        n, found = self.find(length)
        return n, found if n == self.max_n else found[:short]


def attach_chain(tree: DraftTree, chain: Tensor, valid: Tensor, max_depth: int) -> DraftTree:
    """The tree with a chain of L candidate tokens below its root (L more nodes).

    chain (L,) tokens, valid (L,) bool (a shorter chain is padded). The chain's leading
    tokens that the tree already holds as a path from the root become dead slots, the rest
    hangs below the deepest shared node; padding is dead too. Tensor ops only, a fixed
    number of them (no host sync). max_depth bounds the new tree's depth.
    """
    k, length = tree.size, chain.shape[0]
    cur = torch.zeros((), dtype=torch.long, device=chain.device)  # where the chain sits
    merging = torch.ones((), dtype=torch.bool, device=chain.device)
    parents, dead = [], []
    for d in range(length):
        match = (tree.parents == cur) & (tree.tokens == chain[d])  # (K,) the same child
        found = match.any() & merging & valid[d]
        # a new node hangs below `cur` while still merging, else below the previous one
        parents.append(torch.where(merging, cur, k + d - 1))
        dead.append(found | ~valid[d])
        cur = torch.where(found, match.long().argmax(), cur)
        merging = merging & found
    parents_t, dead_t = torch.stack(parents), torch.stack(dead)
    tokens = torch.where(valid, chain, tree.tokens[0])  # dead slots still need a real id
    merged = DraftTree.from_parents(torch.cat([tree.tokens, tokens]),
                                    torch.cat([tree.parents, parents_t]), max_depth)
    old_dead = tree.dead if tree.dead is not None else torch.zeros(k, dtype=torch.bool,
                                                                   device=chain.device)
    priority = None
    if tree.priority is not None:  # lookup nodes come last for a smaller budget
        priority = torch.cat([tree.priority, tree.priority.new_full((length,), -float("inf"))])
    return replace(merged, dead=torch.cat([old_dead, dead_t]), priority=priority)


def chain_to_device(tokens: list[int], length: int, device: torch.device) -> Tensor:
    """The chain padded to L = `length` slots and its valid flags, packed (2L,) = [chain,
    valid], on the device in one copy that does not stall the host (pinned memory,
    non-blocking, on an accelerator); `unpack_chain` splits it."""
    packed = np.zeros(2 * length, dtype=np.int64)
    packed[: len(tokens)] = tokens
    packed[length : length + len(tokens)] = 1
    return upload(packed, device)


def unpack_chain(packed: Tensor) -> tuple[Tensor, Tensor]:
    """(chain (L,), valid (L,) bool) of `chain_to_device`'s (2L,)."""
    length = packed.shape[0] // 2
    return packed[:length], packed[length:].bool()


def attach_fn(max_depth: int, tokens: Tensor, parents: Tensor, depths: Tensor, mask: Tensor,
              *rest: Tensor) -> tuple[Tensor, ...]:
    """`attach_chain` on a tree's fields, tensors only (a recorded step): rest is the tree's
    `dead` (bool) and `priority` (float), those it has, then the packed chain. Returns the
    merged tree's tokens, parents, depths, mask, dead and (if the tree had one) priority."""
    *extra, packed = rest
    fields = {"dead" if x.dtype == torch.bool else "priority": x for x in extra}
    merged = attach_chain(DraftTree(tokens, parents, depths, mask, **fields),
                          *unpack_chain(packed), max_depth)
    return (merged.tokens, merged.parents, merged.depths, merged.mask, merged.dead,
            *(() if merged.priority is None else (merged.priority,)))


class LookupDrafter(DrafterWrapper):
    """Any drafter plus a prompt-lookup chain of up to `tokens` candidates under the root.

    Captured engines (`static_shape`) always attach `tokens` slots, dead where the chain
    is shorter, so every step has one shape. Eager steps attach only the continuation
    found, and nothing when there is none: a step then costs what the inner drafter's
    does (plain decoding: one token), as in transformers' prompt lookup.

    A continuation needs a recurring n-gram of at least `min_n` = 2 tokens: a single
    recurring token is a poor guess that still costs its chain's verify width (SmolLM2 on
    10 held-out ShareGPT prompts, 2-core CPU: lookup 1.24x -> 1.43x plain, Gumiho +
    lookup 1.33x -> 1.44x; docs/methods.md). A match shorter than
    `max_n` proposes only its first `short` tokens: on plain decoding's answers (six
    benchmarks and held-out ShareGPT; scripts/lookup_chains.py) a 2-gram match's first
    token is accepted in 33-66% of cycles and its mean run is 0.6-3.4 tokens, a 3-gram's
    in 67-100% with runs of 2.7-7.4, while on this 2-core CPU verifying 3 tokens costs
    1.10 plain steps and 11 tokens 1.75 (docs/cpu_costs.md).

    `first`: a cycle with a continuation verifies the chain alone and skips the drafter
    (its features wait in `observe`'s queue and are caught up at its next draft), so
    copy-heavy stretches cost what prompt lookup costs and the drafter runs elsewhere.
    Eager steps only: captured ones keep one tree shape.

    With `static_shape`, attaching the chain (about 14 kernels a slot) is one step of
    `engine` (graphs.py), recorded by captured engines."""

    def __init__(self, inner, tokens: int = 10, max_n: int = 3, min_n: int = 2,
                 static_shape: bool = False, first: bool = False, short: int = 2,
                 engine: str = "eager"):
        super().__init__(inner)
        self.tokens, self.static_shape = tokens, static_shape
        self.max_n, self.min_n, self.short = max_n, min_n, short
        self.first = first and not static_shape
        self.name = "lookup" if inner.name == "ar" else f"{inner.name}+lookup"
        self.max_nodes += tokens
        self.draft_depth += tokens
        self._attach_step = StaticStep(partial(attach_fn, self.draft_depth), engine)

    def begin(self, target, capacity: int) -> None:
        self.inner.begin(target, capacity)
        self.index = NgramIndex(self.max_n, self.min_n)
        self.device = target.device

    def observe(self, features: Tensor, next_tokens: Tensor,
                tokens: list[int] | None = None) -> None:
        self.inner.observe(features, next_tokens, tokens)
        self.root = next_tokens[-1:]
        if tokens is None:  # not from the loop: read them (a host sync)
            tokens = next_tokens.tolist()
        self.index.extend(tokens)

    def propose(self) -> DraftTree:
        # host ints: deciding costs no sync; a shorter match is a weaker guess
        found = self.index.chain(self.tokens, self.short)[1]
        if self.first and found:  # the chain alone; the drafter catches up next time
            chain, valid = unpack_chain(chain_to_device(found, len(found), self.device))
            return attach_chain(DraftTree.chain(self.root), chain, valid, self.draft_depth)
        tree = self.inner.propose()
        slots = self.tokens if self.static_shape else len(found)
        if not slots:
            return tree
        packed = chain_to_device(found, slots, self.device)
        if not self.static_shape:
            return attach_chain(replace(tree, spliced_paths=None), *unpack_chain(packed),
                                self.draft_depth)
        extra = tuple(x for x in (tree.dead, tree.priority) if x is not None)
        fields = self._attach_step(tree.tokens, tree.parents, tree.depths, tree.mask, *extra,
                                   packed)
        return DraftTree(*fields[:4], dead=fields[4],
                         priority=fields[5] if len(fields) > 5 else None)
