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
    # (K, K) bool: extra attention the official FTA splice adds for verification (a short
    # path's leaf also sees the nodes spliced after it); see `verify_mask` and fta.py.
    spliced_attend: Tensor | None = None
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
    def verify_mask(self) -> Tensor:
        """(K, K) bool: what each node attends to in the target's verification pass."""
        return self.mask if self.spliced_attend is None else self.mask | self.spliced_attend

    def unspliced(self) -> DraftTree:
        """The tree without an official FTA splice (to splice it again in another path
        order, see fta.py)."""
        if self.spliced_paths is None and self.spliced_attend is None:
            return self
        return replace(self, spliced_paths=None, spliced_attend=None)

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
        are trusted and the mask comes from a fixed number of tensor ops: no host sync, so a
        drafter can build its tree without stalling the device queue. Without it the
        parents are checked and the walk stops when every chain reaches the root.
        """
        k = tokens.shape[0]
        device = tokens.device
        parents = parents.to(device=device, dtype=torch.long)
        if max_depth is not None:
            mask = ancestor_mask(parents, max_depth)
        else:
            later = parents[1:] >= torch.arange(1, k, device=device)
            if k == 0 or parents[0] != -1 or bool(later.any()):
                raise ValueError("parents must be topological: parents[0] == -1 and "
                                 "parents[i] < i")
            mask = walk_ancestors(parents, None)
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


def ancestor_mask(parents: Tensor, max_depth: int) -> Tensor:
    """(K, K) bool: mask[i, j] when j is i or one of its ancestors, for topological parents
    (K,) (-1: the root's) and no node deeper than `max_depth`; no host sync.

    Repeated squaring of "self or parent" (a 0/1 matrix: reach within one step): after s
    squarings each row reaches every ancestor within 2^s steps, so ceil(log2(max_depth))
    products suffice. That is a fixed handful of kernels whatever the depth, against six
    per level for a walk, and a captured tree step on a GPU costs what its kernels number
    (they are tiny). The products are exact: 0/1 entries and integer sums of at most K, in
    float32 (TF32 inputs also hold 0 and 1 exactly). On a CPU the K^3 products lose to the
    walk past about 128 nodes (measured: 64 nodes 47 us against 94, 256 nodes 392 against
    113), so larger CPU trees walk.
    """
    k = parents.shape[0]
    if parents.device.type == "cpu" and k > 128:
        return walk_ancestors(parents, max_depth)
    # column k is a spare slot for the root's parent (none)
    reach = torch.eye(k, k + 1, dtype=torch.float32, device=parents.device)
    reach.scatter_(1, torch.where(parents >= 0, parents, k)[:, None], 1.0)
    reach = reach[:, :k]
    for _ in range(max(max_depth - 1, 0).bit_length()):  # ceil(log2(max_depth)) for >= 1
        reach = (reach @ reach).clamp_(max=1.0)
    return reach > 0


def walk_ancestors(parents: Tensor, steps: int | None) -> Tensor:
    """The ancestor mask of `ancestor_mask`, one tree level per step: `steps` of them, or
    (None) until every node's walk passed the root (a host sync per step)."""
    k = parents.shape[0]
    # Column k is a spare slot that takes the writes of nodes already past the root.
    mask = torch.eye(k, k + 1, dtype=torch.bool, device=parents.device)
    ancestor = parents.clone()  # the d-th ancestor of every node, -1 once past the root
    step = 0
    while (step < steps) if steps is not None else bool((ancestor >= 0).any()):
        has = ancestor >= 0
        # scatter_ takes True as a kernel argument (`mask[i, j] = True` would copy the
        # scalar to the device first: a host sync on a GPU)
        mask.scatter_(1, torch.where(has, ancestor, k)[:, None], True)
        ancestor = torch.where(has, parents[ancestor.clamp(min=0)], ancestor)
        step += 1
    return mask[:, :k].contiguous()


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

LOGPROB_FLOOR = -1e4  # draft log-probs floored here keep -inf (underflow) out of rankings


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
    """Children of P nodes: candidates (P, c) with draft log-probs (P, c), finite (a
    drafter floors them at LOGPROB_FLOOR); keeps the `keep` best by cumulative score.
    Returns the new level (parents offset by `first_index`, the pool index of node 0 of the
    level being expanded) and each kept child's row in 0..P-1.
    """
    total = scores[:, None] + logprobs  # (P, c)
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
    # In float32 the 1e-6 is rounded away below scores of about -16 (and at the
    # LOGPROB_FLOOR), so a child can tie its parent; rounding never puts it above. A stable
    # sort then takes the lower pool index, the parent, first (topk's order among ties is
    # unspecified: it took children without their parents).
    order = key.sort(descending=True, stable=True).indices
    chosen = order[:budget].sort().values  # pool order is topological
    tree = tree_from_pool(root, pool, chosen, max_depth)
    priority = torch.cat([key.new_full((1,), float("inf")), key[chosen]])
    return replace(tree, priority=priority), chosen


class Star:
    """`select_tree` for a pool that is one level (a depth-1 tree, `--depth 1`): every node
    is a child of the root and all of them fit the budget, so the tree's parents, depths
    and mask are the same every cycle and are made once (`device`, `size` children); a
    cycle makes the tokens and the priority (2 kernels, where the general selection makes
    ~35: on a CPU's eager loop each is a few microseconds of the cycle).
    `tree(root, scores, tokens)` equals `select_tree(root, Pool(tokens, -1, scores, 1),
    size)` field for field (tests/test_tree_build.py)."""

    def __init__(self, size: int, device: torch.device):
        at = torch.arange(size + 1, device=device)
        self.parents = torch.where(at > 0, 0, -1)
        self.depths = (at > 0).long()
        self.mask = (at[:, None] == at[None, :]) | (at[None, :] == 0)
        self.inf = torch.full((1,), float("inf"), device=device)

    def tree(self, root: Tensor, scores: Tensor, tokens: Tensor) -> tuple[Tensor, ...]:
        """The tree's fields and priority (tokens, parents, depths, mask, priority) for the
        root (1,) and its children's scores and tokens (size,), best first."""
        # the selection's key: a node's score less 1e-6 per level (select_tree)
        return (torch.cat([root.view(1), tokens]), self.parents, self.depths, self.mask,
                torch.cat([self.inf, scores - 1e-6]))


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
    # a host template (its user moves it to the device), whatever the default device
    parents, depths, ranks = (torch.tensor(col, device="cpu") for col in zip(*nodes, strict=True))
    return parents, depths, ranks
