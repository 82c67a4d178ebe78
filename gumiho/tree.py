"""The draft tree as a value: tokens, parents, depths, ancestor mask and root-to-leaf paths.

Nodes are in topological order: node 0 is the root (the last committed token, not yet in
the target's cache) and every parent index is smaller than its child's. All derived fields
are computed with tensor ops, one step per tree level, never per node.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class DraftTree:
    tokens: Tensor  # (K,) long; tokens[0] is the root
    parents: Tensor  # (K,) long; parents[0] == -1, parents[i] < i
    depths: Tensor  # (K,) long; depth of the root is 0
    mask: Tensor  # (K, K) bool; mask[i, j]: j is i or an ancestor of i
    paths: Tensor  # (P, D + 1) long; node indices of each root-to-leaf path, -1 padded

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    @property
    def max_depth(self) -> int:
        return self.paths.shape[1] - 1

    @staticmethod
    def from_parents(tokens: Tensor, parents: Tensor) -> DraftTree:
        """Derive depths, the ancestor mask and the paths from tokens (K,) and parents (K,)."""
        k = tokens.shape[0]
        device = tokens.device
        parents = parents.to(device=device, dtype=torch.long)
        later = parents[1:] >= torch.arange(1, k, device=device)
        if k == 0 or parents[0] != -1 or bool(later.any()):
            raise ValueError("parents must be topological: parents[0] == -1 and parents[i] < i")
        nodes = torch.arange(k, device=device)
        mask = torch.eye(k, dtype=torch.bool, device=device)
        ancestor = parents.clone()  # the d-th ancestor of every node, -1 once past the root
        while bool((ancestor >= 0).any()):
            has = ancestor >= 0
            mask[nodes[has], ancestor[has]] = True
            ancestor = torch.where(has, parents[ancestor.clamp(min=0)], ancestor)
        depths = mask.sum(1) - 1
        is_leaf = torch.ones(k, dtype=torch.bool, device=device)
        is_leaf[parents[1:]] = False
        leaves = nodes[is_leaf]
        paths = torch.full((leaves.shape[0], int(depths.max()) + 1), -1, dtype=torch.long,
                           device=device)
        rows, cols = mask[leaves].nonzero(as_tuple=True)
        paths[rows, depths[cols]] = cols
        return DraftTree(tokens=tokens.long(), parents=parents, depths=depths, mask=mask,
                         paths=paths)

    @staticmethod
    def chain(tokens: Tensor) -> DraftTree:
        """A single path: root followed by tokens[1:]."""
        k = tokens.shape[0]
        parents = torch.arange(-1, k - 1, device=tokens.device)
        return DraftTree.from_parents(tokens, parents)

    def children(self, node: int) -> Tensor:
        """Indices of node's children, in tree order (used by rejection sampling)."""
        return (self.parents == node).nonzero().flatten()
