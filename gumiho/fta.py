"""Full Tree Attention (FTA): give short draft paths a chance to run as long as long ones.

Gumiho's paper supplements shorter candidate paths with tokens from longer paths at no
extra verification tokens. Three modes:

* `off`: the plain dynamic tree.
* `official`: the released code's splice, exactly. On its list of root-to-leaf paths
  (-1 padded) it takes the columns after the first path's last node; each is filled, in
  every path that lacks it, with the most common node of that column among the paths
  that reach it (ties: the lowest node index), and the last real node of each of the
  first rows (as many as rows lack the column, at most as many as there are short rows)
  is made to attend to the fill in the target's verification pass. Greedy decoding lists
  paths shallow first, so the first path is a shortest one and exactly the short paths
  get their gaps filled and their leaves the extra attention. Sampling (T > 0) sorts the
  paths lexicographically first: the first is then the chain of each level's best child,
  which usually reaches the tree's depth, so usually nothing is spliced; when it does
  not, the same quirky rule applies to that order, and the released sampler walks the
  spliced paths too. Spliced tokens are accepted against logits computed in another
  branch's context, and the extra attention changes the leaves' own logits (even their
  bonus tokens): NOT lossless. Kept to reproduce the paper's numbers.
* `exact`: a lossless design of the same idea. Every leaf that the MLP heads can extend
  (depth >= 2) is completed to the full draft depth with real nodes of correct ancestry:
  the top-1 token of each remaining head of its own branch. To keep the verification
  budget, the dynamic selection shrinks to the largest size whose completed tree still
  fits. Every node is verified in its own context, so acceptance stays exact.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from gumiho.tree import DraftTree, Pool, select_tree, tree_from_pool


def splice_official(tree: DraftTree, sampling: bool = False) -> DraftTree:
    """The released FTA splice (see the module docstring) on the greedy path order, or
    with `sampling` on the lexicographic one. Sets `spliced_paths` (in that order) and
    `spliced_attend`; the tree itself (mask, depths) keeps its real ancestry.
    Host syncs (the released code's loop runs on the host too): official mode only."""
    paths = lexicographic(tree.paths) if sampling else tree.paths
    reach = paths >= 0
    columns = paths.shape[1]
    start = int(reach[0].sum())  # the columns after the first path's last node
    if start == columns:
        return tree
    k = tree.size
    short = int((~reach[:, -1]).sum())
    # each of the first `short` rows' last real node (a full row's index -1 wraps around)
    last = (reach.long().argmin(1) - 1) % columns
    leaves = paths.gather(1, last[:, None]).squeeze(1)[:short]
    filled = paths.clone()
    attend = torch.zeros(k, k, dtype=torch.bool, device=paths.device)
    for col in range(start, columns):
        counts = torch.bincount(paths[reach[:, col], col], minlength=k)
        fill = counts.argmax()  # most paths, then the lowest node index
        gap = ~reach[:, col]
        filled[:, col] = torch.where(gap, fill, paths[:, col])
        attend[leaves[: int(gap.sum())], fill] = True
    return replace(tree, spliced_paths=filled, spliced_attend=attend)


def official_for_sampling(tree: DraftTree) -> DraftTree:
    """A greedy-spliced tree re-spliced as the released code does at T > 0."""
    return splice_official(tree.unspliced(), sampling=True)


def lexicographic(paths: Tensor) -> Tensor:
    """The (P, D + 1) paths sorted as rows of node indices, -1 after every index (the
    released code's order at T > 0)."""
    rows = paths.tolist()
    order = sorted(range(len(rows)), key=lambda r: [v if v >= 0 else 1 << 30 for v in rows[r]])
    return paths[torch.tensor(order, device=paths.device)]


def complete_paths(root: Tensor, pool: Pool, chosen: Tensor, branch: Tensor,
                   chain_tokens: Tensor, first_mlp_depth: int) -> DraftTree:
    """Extend every leaf of the chosen pool nodes at depth >= first_mlp_depth - 1 with the
    top-1 chain of its own branch's remaining MLP heads.

    branch (M,): each pool node's row in chain_tokens (-1 above the MLP levels);
    chain_tokens (B, N): top-1 token of each of the N MLP heads per branch.
    """
    device = chosen.device
    m, n_heads = pool.tokens.shape[0], chain_tokens.shape[1]
    is_parent = torch.zeros(m, dtype=torch.bool, device=device)
    parents = pool.parents[chosen]
    is_parent[parents[parents >= 0]] = True
    leaves = chosen[~is_parent[chosen] & (branch[chosen] >= 0)]
    next_head = pool.depths[leaves] - (first_mlp_depth - 1)  # first head below each leaf
    counts = (n_heads - next_head).clamp(min=0)
    if int(counts.sum()) == 0:
        return tree_from_pool(root, pool, chosen)
    group = torch.repeat_interleave(torch.arange(leaves.shape[0], device=device), counts)
    starts = torch.cumsum(counts, 0) - counts
    offset = torch.arange(group.shape[0], device=device) - starts[group]
    new_index = m + torch.arange(group.shape[0], device=device)
    new_parents = torch.where(offset == 0, leaves[group], new_index - 1)
    extended = Pool(
        tokens=torch.cat([pool.tokens, chain_tokens[branch[leaves[group]],
                                                    next_head[group] + offset]]),
        parents=torch.cat([pool.parents, new_parents]),
        scores=torch.cat([pool.scores, pool.scores.new_zeros(group.shape[0])]),
        depths=torch.cat([pool.depths, pool.depths[leaves[group]] + offset + 1]),
    )
    return tree_from_pool(root, extended, torch.cat([chosen, new_index]))


def exact_fta_tree(root: Tensor, pool: Pool, budget: int, branch: Tensor,
                   chain_tokens: Tensor, first_mlp_depth: int) -> DraftTree:
    """The largest score-ranked selection whose completed tree fits in `budget` drafts."""
    lo, hi = 1, min(budget, pool.tokens.shape[0])
    best = None
    while lo <= hi:  # binary search on the selection size: about log2(budget) rounds
        mid = (lo + hi) // 2
        _, chosen = select_tree(root, pool, mid)
        tree = complete_paths(root, pool, chosen, branch, chain_tokens, first_mlp_depth)
        if tree.size - 1 <= budget:
            best, lo = tree, mid + 1
        else:
            hi = mid - 1
    return best if best is not None else select_tree(root, pool, budget)[0]
