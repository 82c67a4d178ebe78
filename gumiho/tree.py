"""The draft tree as a value: tokens, parents, depths, ancestor mask and root-to-leaf paths.

Nodes are in topological order: node 0 is the root (the last committed token, not yet in
the target's cache) and every parent index is smaller than its child's. All derived fields
are computed with tensor ops, one step per tree level, never per node.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor


@dataclass(frozen=True)
class DraftTree:
    tokens: Tensor  # (K,) long; tokens[0] is the root
    parents: Tensor  # (K,) long; parents[0] == -1, parents[i] < i
    depths: Tensor  # (K,) long; depth of the root is 0
    mask: Tensor  # (K, K) bool; mask[i, j]: j is i or an ancestor of i
    # Root-to-leaf paths (P, D + 1), -1 padded. Derived from the mask when first read
    # (that needs host syncs, so the greedy fast path never reads it); set explicitly only
    # by the official FTA splice, whose paths are not the tree's own.
    spliced_paths: Tensor | None = None
    # (K,) float: the order a smaller budget would keep nodes in (higher first; the root
    # +inf). Set by score-ranked selection and static trees; used by `--total-tokens auto`.
    priority: Tensor | None = None
    # (K,) bool: slots that are verified (one shape every step) but never accepted, e.g. a
    # lookup chain's tokens that the tree already had (lookup.py).
    dead: Tensor | None = None

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    @property
    def max_depth(self) -> int:
        return self.paths.shape[1] - 1

    @property
    def paths(self) -> Tensor:
        if self.spliced_paths is not None:
            return self.spliced_paths
        cached = self.__dict__.get("_paths")
        if cached is None:
            cached = leaf_paths(self.parents, self.depths, self.mask)
            object.__setattr__(self, "_paths", cached)
        return cached

    @staticmethod
    def from_parents(tokens: Tensor, parents: Tensor, max_depth: int | None = None
                     ) -> DraftTree:
        """Derive depths and the ancestor mask from tokens (K,) and parents (K,).

        With `max_depth` (a bound the caller knows, e.g. the drafter's depth) the parents
        are trusted and the ancestor walk runs exactly that many steps: no host sync, so a
        drafter can build its tree without stalling the device queue. Without it the
        parents are checked and the walk stops when every chain reaches the root.
        """
        k = tokens.shape[0]
        device = tokens.device
        parents = parents.to(device=device, dtype=torch.long)
        if max_depth is None:
            later = parents[1:] >= torch.arange(1, k, device=device)
            if k == 0 or parents[0] != -1 or bool(later.any()):
                raise ValueError("parents must be topological: parents[0] == -1 and "
                                 "parents[i] < i")
        # Column k is a spare slot that takes the writes of nodes already past the root.
        mask = torch.eye(k, k + 1, dtype=torch.bool, device=device)
        ancestor = parents.clone()  # the d-th ancestor of every node, -1 once past the root
        step = 0
        while (step < max_depth) if max_depth is not None else bool((ancestor >= 0).any()):
            has = ancestor >= 0
            # scatter_ takes True as a kernel argument (`mask[i, j] = True` would copy the
            # scalar to the device first: a host sync on a GPU)
            mask.scatter_(1, torch.where(has, ancestor, k)[:, None], True)
            ancestor = torch.where(has, parents[ancestor.clamp(min=0)], ancestor)
            step += 1
        mask = mask[:, :k].contiguous()
        return DraftTree(tokens=tokens.long(), parents=parents, depths=mask.sum(1) - 1,
                         mask=mask)

    @staticmethod
    def chain(tokens: Tensor) -> DraftTree:
        """A single path: root followed by tokens[1:]."""
        k = tokens.shape[0]
        parents = torch.arange(-1, k - 1, device=tokens.device)
        return DraftTree.from_parents(tokens, parents, max_depth=k - 1)

    def children(self, node: int) -> Tensor:
        """Indices of node's children, in tree order (used by rejection sampling)."""
        return (self.parents == node).nonzero().flatten()


def leaf_paths(parents: Tensor, depths: Tensor, mask: Tensor) -> Tensor:
    """(P, D + 1) node indices of each root-to-leaf path, -1 padded, leaves in node order."""
    k = parents.shape[0]
    is_leaf = torch.ones(k, dtype=torch.bool, device=parents.device)
    is_leaf[parents[1:]] = False
    leaves = is_leaf.nonzero().flatten()
    paths = torch.full((leaves.shape[0], int(depths.max()) + 1), -1, dtype=torch.long,
                       device=parents.device)
    rows, cols = mask[leaves].nonzero(as_tuple=True)
    paths[rows, depths[cols]] = cols
    return paths


# ---- building trees from a drafter's candidate pool -------------------------------------

LOGPROB_FLOOR = -1e4  # keeps -inf (underflow) out of the ranking arithmetic


@dataclass(frozen=True)
class Pool:
    """Draft candidates in level order: a node's parent (index into the pool, -1 = the
    root) always comes before it. scores are cumulative draft log-probs (root = 0)."""

    tokens: Tensor  # (M,)
    parents: Tensor  # (M,)
    scores: Tensor  # (M,)
    depths: Tensor  # (M,) root's children have depth 1

    @staticmethod
    def concat(levels: list[Pool]) -> Pool:
        return Pool(*(torch.cat([getattr(lv, f) for lv in levels])
                      for f in ("tokens", "parents", "scores", "depths")))


def expand_level(scores: Tensor, tokens: Tensor, logprobs: Tensor, keep: int,
                 first_index: int, depth: int) -> tuple[Pool, Tensor]:
    """Children of P nodes: candidates (P, c) with draft log-probs (P, c); keeps the `keep`
    best by cumulative score. Returns the new level (parents offset by `first_index`, the
    pool index of node 0 of the level being expanded) and each kept child's row in 0..P-1.
    """
    total = scores[:, None] + logprobs.clamp(min=LOGPROB_FLOOR)  # (P, c)
    best = total.flatten().topk(min(keep, total.numel()))
    row = best.indices // total.shape[1]
    level = Pool(tokens=tokens.flatten()[best.indices], parents=row + first_index,
                 scores=best.values, depths=torch.full_like(row, depth))
    return level, row


def select_tree(root: Tensor, pool: Pool, budget: int, max_depth: int | None = None
                ) -> tuple[DraftTree, Tensor]:
    """The `budget` best pool nodes by cumulative score under the root, as a DraftTree.

    A child's score never exceeds its parent's; a tiny per-depth penalty breaks ties in
    the parent's favour, so the selection is ancestor-closed. Returns the tree and the
    selected pool indices (tree node i + 1 is pool node selected[i]). max_depth: the
    pool's depth bound, if known (see DraftTree.from_parents).
    """
    key = pool.scores - 1e-6 * pool.depths
    chosen = key.topk(min(budget, key.shape[0])).indices.sort().values  # pool order is topological
    tree = tree_from_pool(root, pool, chosen, max_depth)
    priority = torch.cat([key.new_full((1,), float("inf")), key[chosen]])
    return replace(tree, priority=priority), chosen


def tree_from_pool(root: Tensor, pool: Pool, chosen: Tensor, max_depth: int | None = None
                   ) -> DraftTree:
    """A DraftTree of the root plus pool nodes `chosen` (sorted, ancestor-closed)."""
    position = torch.full((pool.tokens.shape[0],), -1, dtype=torch.long, device=chosen.device)
    position[chosen] = torch.arange(1, chosen.shape[0] + 1, device=chosen.device)
    pool_parents = pool.parents[chosen]
    parents = torch.where(pool_parents >= 0, position[pool_parents.clamp(min=0)], 0)
    tokens = torch.cat([root.view(1), pool.tokens[chosen]])
    root_parent = torch.full((1,), -1, dtype=torch.long, device=parents.device)
    return DraftTree.from_parents(tokens, torch.cat([root_parent, parents]), max_depth)


def static_tree(size: int, depth: int, head_accuracy: list[float], decay: float = 0.55,
                max_rank: int = 10) -> tuple[Tensor, Tensor, Tensor]:
    """A fixed (Medusa-style) tree of `size` nodes below the root: the paths of top-k ranks
    with the highest estimated probability prod_d acc[d] * decay ** rank_d. Estimates can
    come from measured per-head accuracies (the Medusa paper builds its tree the same way).

    Returns parents (size + 1,), depths (size + 1,), ranks (size + 1,), root first.
    """
    import heapq

    nodes = [(-1, 0, 0)]  # (parent, depth, rank)
    values = [1.0]
    frontier = [(-head_accuracy[0] * decay**r, 0, r) for r in range(max_rank)]
    heapq.heapify(frontier)
    while frontier and len(nodes) <= size:
        neg_value, parent, rank = heapq.heappop(frontier)
        nodes.append((parent, nodes[parent][1] + 1, rank))
        values.append(-neg_value)
        child_depth = nodes[-1][1]
        if child_depth < depth:
            for r in range(max_rank):
                heapq.heappush(frontier, (neg_value * head_accuracy[child_depth] * decay**r,
                                          len(nodes) - 1, r))
    parents, depths, ranks = (torch.tensor(col) for col in zip(*nodes, strict=True))
    return parents, depths, ranks
