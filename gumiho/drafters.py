"""The drafter interface every method sits behind, and plain decoding as its trivial case.

The loop (generate.py) talks to a drafter through three calls:

* `begin(target, capacity)`: a new sequence starts.
* `observe(features, next_tokens)`: the target committed tokens. features (n, H) are the
  target's post-norm last hidden states `f_t` at the committed positions and next_tokens (n,)
  the token that follows each (`x_{t+1}`); the last next token is the new root, which the
  target has not yet seen.
* `propose() -> DraftTree`: a tree rooted at the newest root token.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol

from torch import Tensor

from gumiho.errors import GumihoError
from gumiho.tree import DraftTree


class Drafter(Protocol):
    name: str
    max_nodes: int  # the largest tree `propose` returns, root included

    def begin(self, target, capacity: int) -> None: ...

    def observe(self, features: Tensor, next_tokens: Tensor) -> None: ...

    def propose(self) -> DraftTree: ...


class PlainDrafter:
    """Plain autoregressive decoding: the tree is the root alone, so each cycle is one step."""

    name = "ar"
    max_nodes = 1

    def begin(self, target, capacity: int) -> None:
        self.root: Tensor | None = None
        self._single = None

    def observe(self, features: Tensor, next_tokens: Tensor) -> None:
        self.root = next_tokens[-1:]

    def propose(self) -> DraftTree:
        if self._single is None:
            self._single = DraftTree.chain(self.root)
        return replace(self._single, tokens=self.root)  # same one-node shape every cycle


def load_drafter(method: str, target, draft: str | None = None, **options) -> Drafter:
    """The drafter for `method` on `target`: from a checkpoint dir, or `random` weights."""
    if method == "ar":
        if draft is not None:
            raise GumihoError("--method ar takes no --draft: plain decoding has no drafter")
        return PlainDrafter()
    raise GumihoError(f"unknown method {method!r}: use one of {', '.join(METHODS)}")


METHODS = ("ar",)
