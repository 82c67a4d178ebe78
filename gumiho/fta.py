"""Full Tree Attention (FTA): give short draft paths a chance to run as long as long ones.

Gumiho's paper supplements shorter candidate paths with tokens from longer paths at no
extra verification tokens. Three modes:

* `off`: the plain dynamic tree.
* `official`: the released code's splice. Into each short path's missing columns it puts
  the most common node of that column among the full-length paths. Those nodes' target
  logits were computed in another branch's context, so accepting a spliced token after the
  first one is NOT lossless (the first is checked against the short leaf's own logits and
  adds nothing beyond the bonus token). Kept to reproduce the paper's numbers.
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


def splice_official(tree: DraftTree) -> DraftTree:
    """The released FTA: fill short paths' empty columns with each column's most common
    node among the longest paths. Only `paths` changes; the mask keeps real ancestry."""
    paths = tree.paths
    lengths = (paths >= 0).sum(1)
    longest = lengths == paths.shape[1]
    if bool(longest.all()):
        return tree
    fill = paths[longest].mode(0).values  # (D + 1,)
    return replace(tree, spliced_paths=torch.where(paths >= 0, paths, fill[None]))


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
