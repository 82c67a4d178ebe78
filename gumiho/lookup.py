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


def attach_chain(tree: DraftTree, chain: Tensor, valid: Tensor) -> DraftTree:
    """The tree with a chain of L candidate tokens below its root (L more nodes).

    chain (L,) tokens, valid (L,) bool: True for a prefix of the slots (a shorter chain is
    padded at the end, as `chain_to_device` packs it). The chain's leading
    tokens that the tree already holds as a path from the root become dead slots (each a
    sibling of the node it repeats), the rest hangs below the deepest shared node; padding
    is dead too. Chain slot d always sits at depth d + 1.

    A fixed, small number of tensor ops whatever L (no host sync, no loop over the chain):
    on a GPU a recorded step costs about what its kernels number, and walking the chain a
    slot at a time took ~14 kernels a slot (157 for the demo's 10 slots on a 64-node tree,
    against 51 now). The merged mask is built from the tree's own: slot d's ancestors are
    those of its parent plus the live slots above it. Should two siblings hold the same
    token (no drafter here makes such a tree), the deepest shared node is taken, the
    lowest index among equals.
    """
    k, length = tree.size, chain.shape[0]
    if length == 0:
        return tree
    device = chain.device
    slots = torch.arange(length, device=device)  # (L,)
    depths = tree.depths
    # A tree node at depth t >= 1 repeats chain slot t - 1 when their tokens agree and the
    # slot is valid (so are those before it); the root agrees with the empty prefix.
    slot_of = (depths - 1).clamp(0, length - 1)  # (K,)
    agrees = ((tree.tokens == chain[slot_of]) & valid[slot_of] & (depths <= length)
              | (depths == 0))
    shared = ~(tree.mask & ~agrees).any(1)  # (K,) the node's whole path is a chain prefix
    order = torch.arange(k - 1, -1, -1, device=device)  # ties: the lowest index wins
    deepest = torch.where(shared, depths * k + order, -1).argmax(0, keepdim=True)  # (1,)
    matched = depths[deepest]  # (1,) slots 0 .. matched - 1 repeat the tree's path
    path = tree.mask[deepest]  # (1, K) the deepest shared node and its ancestors
    on_path = (path & (depths == slots[:, None])).long().argmax(1)  # (L,) the path at depth d
    merging = slots <= matched  # slot d hangs below the path's node at depth d
    parents = torch.where(merging, on_path, k + slots - 1)
    # ancestors of each slot: its parent's (the path's, above the first new slot) ...
    above = tree.mask[torch.where(merging, on_path, deepest)]  # (L, K)
    # ... and itself and the new slots above it
    later = slots[None, :]  # (1, L) the slot seen; slots[:, None]: the one seeing
    among_new = (later <= slots[:, None]) & ((later == slots[:, None]) | (later >= matched))
    mask = torch.cat([torch.cat([tree.mask, tree.mask.new_zeros(k, length)], 1),
                      torch.cat([above, among_new], 1)])
    tokens = torch.where(valid, chain, tree.tokens[0])  # dead slots still need a real id
    old_dead = tree.dead if tree.dead is not None else torch.zeros(k, dtype=torch.bool,
                                                                   device=device)
    priority = None
    if tree.priority is not None:  # lookup nodes come last for a smaller budget
        priority = torch.cat([tree.priority, tree.priority.new_full((length,), -float("inf"))])
    return DraftTree(tokens=torch.cat([tree.tokens, tokens]),
                     parents=torch.cat([tree.parents, parents]),
                     depths=torch.cat([depths, slots + 1]), mask=mask,
                     dead=torch.cat([old_dead, (slots < matched) | ~valid]), priority=priority)


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


def attach_fn(tokens: Tensor, parents: Tensor, depths: Tensor, mask: Tensor, *rest: Tensor
              ) -> tuple[Tensor, ...]:
    """`attach_chain` on a tree's fields, tensors only (a recorded step): rest is the tree's
    `dead` (bool) and `priority` (float), those it has, then the packed chain. Returns the
    merged tree's tokens, parents, depths, mask, dead and (if the tree had one) priority."""
    *extra, packed = rest
    fields = {"dead" if x.dtype == torch.bool else "priority": x for x in extra}
    merged = attach_chain(DraftTree(tokens, parents, depths, mask, **fields),
                          *unpack_chain(packed))
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
    Eager steps only: captured ones keep one tree shape. With `trust` (the default), only
    while the last continuation found was right about its first token: whether it was is
    free to check (the token the target emitted next, whether or not that chain was
    verified). After a wrong one the next continuation's first `short` tokens go beside
    the drafter's tree instead, until one is right again: a chain whose first token fails
    costs a wide verify for one token and skips a drafter that would have emitted ~2 (in
    one code answer with the shipped SmolLM2 drafter, 9 of the 15 chains verified alone
    emitted one token). On a 2-core CPU: the demo's prompt 1.22x -> 1.26x plain (tau 1.58
    -> 1.65), six benchmarks level (1.55x, 1.54x), every answer identical (docs/methods.md,
    "Prompt lookup that trusts only what was right").

    With `static_shape`, attaching the chain (51 kernels whatever its length) is one step
    of `engine` (graphs.py), recorded by captured engines."""

    def __init__(self, inner, tokens: int = 10, max_n: int = 3, min_n: int = 2,
                 static_shape: bool = False, first: bool = False, short: int = 2,
                 engine: str = "eager", trust: bool = True):
        super().__init__(inner)
        self.tokens, self.static_shape = tokens, static_shape
        self.max_n, self.min_n, self.short = max_n, min_n, short
        self.first, self.trust = first and not static_shape, trust
        self.name = "lookup" if inner.name == "ar" else f"{inner.name}+lookup"
        self.max_nodes += tokens
        self.draft_depth += tokens
        self._attach_step = StaticStep(attach_fn, engine)

    def begin(self, target, capacity: int) -> None:
        self.inner.begin(target, capacity)
        self.index = NgramIndex(self.max_n, self.min_n)
        self.device = target.device
        self.guess = None  # the first token of the continuation found for this cycle
        self.right = True  # whether the last continuation's guess was the target's token

    def observe(self, features: Tensor, next_tokens: Tensor,
                tokens: list[int] | None = None) -> None:
        self.inner.observe(features, next_tokens, tokens)
        self.root = next_tokens[-1:]
        if tokens is None:  # not from the loop: read them (a host sync)
            tokens = next_tokens.tolist()
        if self.guess is not None:  # tokens[0]: what the target emitted after the root
            self.right, self.guess = tokens[0] == self.guess, None
        self.index.extend(tokens)

    def propose(self) -> DraftTree:
        # host ints: deciding costs no sync; a shorter match is a weaker guess
        found = self.index.chain(self.tokens, self.short)[1]
        if self.first and found:
            self.guess = found[0]
            if self.right or not self.trust:  # the chain alone; the drafter catches up later
                chain, valid = unpack_chain(chain_to_device(found, len(found), self.device))
                return attach_chain(DraftTree.chain(self.root), chain, valid)
            found = found[: self.short]  # the last guess was wrong: a short chain beside
        tree = self.inner.propose()
        slots = self.tokens if self.static_shape else len(found)
        if not slots:
            return tree
        packed = chain_to_device(found, slots, self.device)
        if not self.static_shape:
            return attach_chain(tree, *unpack_chain(packed))  # a new tree: no FTA splice
        extra = tuple(x for x in (tree.dead, tree.priority) if x is not None)
        fields = self._attach_step(tree.tokens, tree.parents, tree.depths, tree.mask, *extra,
                                   packed)
        return DraftTree(*fields[:4], dead=fields[4],
                         priority=fields[5] if len(fields) > 5 else None)
