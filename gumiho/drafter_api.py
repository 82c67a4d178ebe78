"""The drafter interface every method sits behind, and the base of drafters that wrap one.

The loop (engine.py) talks to a drafter through three calls:

* `begin(target, capacity)`: a new sequence starts.
* `observe(features, next_tokens, tokens)`: the target committed tokens. features (n, H)
  are the target's post-norm last hidden states `f_t` at the committed positions and
  next_tokens (n,) the token that follows each (`x_{t+1}`); the last next token is the new
  root, which the target has not yet seen. `tokens` is next_tokens as a host list (the loop
  has it without a sync; None from other callers).
* `propose() -> DraftTree`: a tree rooted at the newest root token.

The methods' drafters are in drafters.py and serial_drafter.py, `load_drafter` in
drafters.py; the wrappers (a prompt-lookup chain, lookup.py; the drafting gate, gate.py)
build on `DrafterWrapper` here, so drafters.py can put them together without importing
itself back.
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

from gumiho.tree import DraftTree


class Drafter(Protocol):
    """What the loop asks of a drafter (engine.py): `begin` once a generation, with the
    target and the cache capacity; `observe` the target's features (N, H) for the tokens
    just accepted and the tokens (N,) that follow each of them (`tokens`: the same as host
    ints, where the loop has them); `propose` a DraftTree whose root is the newest token,
    for the target to verify. Plain decoding, Gumiho, EAGLE-2, Medusa and the wrappers (a
    prompt-lookup chain, the drafting gate) all are one."""

    name: str
    max_nodes: int  # the largest tree `propose` returns, root included
    draft_depth: int  # the deepest node such a tree can have

    def begin(self, target, capacity: int) -> None: ...

    def observe(self, features: Tensor, next_tokens: Tensor,
                tokens: list[int] | None = None) -> None: ...

    def propose(self) -> DraftTree: ...


class DrafterWrapper:
    """A drafter around another one (`inner`), e.g. a prompt-lookup chain or a gate: the
    inner one's name, sizes and tree settings unless the wrapper says otherwise, and the
    loop's profiler reaches the inner drafter's phases."""

    def __init__(self, inner):
        self.inner, self.tree = inner, getattr(inner, "tree", None)
        self.name, self.max_nodes, self.draft_depth = (inner.name, inner.max_nodes,
                                                       inner.draft_depth)

    @property
    def timer(self):
        return getattr(self.inner, "timer", None)

    @timer.setter
    def timer(self, timer) -> None:
        self.inner.timer = timer
