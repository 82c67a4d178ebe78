"""Draft only where drafting pays: a plain step instead of a drafter cycle that would lose.

A drafter cycle costs `c` plain steps (drafting plus a verify wider than one token) and
emits 1 + its accepted drafts; a plain step emits one token. So drafting pays exactly when
the drafter's tokens per cycle exceed `c`, the break-even. On a GPU c is close to 1 and a
drafter almost always pays; on a 2-core CPU c is 1.2-1.4 for the smallest trees and a
weak drafter on unfamiliar text does not reach it: on CNN/DM-like articles the shipped
SmolLM2 Gumiho drafter's cycles (those where prompt lookup found nothing) emitted 1.21
tokens at 1.33 plain steps each (docs/methods.md, "Drafting only where it pays").

`GatedDrafter` keeps a running mean of the tokens its drafter's cycles emitted in this
sequence (starting a quarter token above the break-even, `prior`) and, while that mean is
below the break-even, answers with the root alone (a plain step); after every `probe`
plain steps in that state a cycle drafts anyway (a probe), so the mean follows the text.
The decision reads host counts only (no timing, no sync): acceptance counts are far less
noisy than per-cycle timings of a few milliseconds (an earlier pacer that compared timed
rates mostly chose plain steps and lost the drafter's gains, see the issue 12 notes).
`--total-tokens auto` measures the break-even of the shape it picks from whole unprofiled
cycles (budget.py) and logs it.

Off by default (`--draft-gate X` turns it on): the running mean is too noisy to tell a
drafter at 1.15-1.2 tokens per cycle from one at 1.35-1.4 within one answer, and with the
12,288-conversation SmolLM2 drafter it cost more where the drafter pays than it saved
where it does not (six benchmarks, 2-core CPU: 1.33x plain gated, 1.36x ungated; docs/methods.md,
"Drafting only where it pays").

Skipped cycles cost the drafter nothing: its `observe` queue holds their tokens and the
next drafting cycle catches up on them. Verification is unchanged, so the output is
exactly the target's. Eager steps only: captured engines keep one tree shape.
"""

from __future__ import annotations

from torch import Tensor

from gumiho.drafter_api import DrafterWrapper
from gumiho.tree import DraftTree


class GatedDrafter(DrafterWrapper):
    """`inner` drafts while its running tokens per cycle reach `break_even` (in plain
    steps); below it, plain steps, with a drafting probe after every `probe` of them.

    prior: the tokens per cycle assumed before any is seen (default a quarter token above
    the break-even: about ten cycles of a drafter that does not pay before it stops).
    weight: how much each new drafter cycle moves the running mean (0.1: about the last
    ten cycles count)."""

    def __init__(self, inner, break_even: float, prior: float | None = None,
                 weight: float = 0.1, probe: int = 8):
        super().__init__(inner)
        self.break_even = break_even
        self.prior = break_even + 0.25 if prior is None else prior
        self.weight, self.probe = weight, probe

    def begin(self, target, capacity: int) -> None:
        self.inner.begin(target, capacity)
        self.rate = self.prior  # running tokens per drafter cycle in this sequence
        self.plain_steps = 0  # consecutive plain steps taken instead of drafting
        self.drafted = False  # whether the cycle now being verified is the drafter's
        self.counts = {"drafted": 0, "plain": 0}

    def observe(self, features: Tensor, next_tokens: Tensor,
                tokens: list[int] | None = None) -> None:
        self.inner.observe(features, next_tokens, tokens)
        self.root = next_tokens[-1:]
        if self.drafted:  # the drafter's cycle emitted this many tokens
            emitted = len(tokens) if tokens is not None else next_tokens.shape[0]
            self.rate += self.weight * (emitted - self.rate)
            self.drafted = False

    def drafting(self) -> bool:
        """Whether this cycle drafts: the running mean pays, or a probe is due."""
        return self.rate >= self.break_even or self.plain_steps >= self.probe

    def propose(self) -> DraftTree:
        if self.drafting():
            self.plain_steps, self.drafted = 0, True
            self.counts["drafted"] += 1
            return self.inner.propose()
        self.plain_steps += 1
        self.counts["plain"] += 1
        return DraftTree.chain(self.root)  # the root alone: one plain step
