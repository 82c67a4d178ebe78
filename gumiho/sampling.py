"""Deciding which draft tokens the target accepts: greedy and lossless sampling.

Both return (accepted, bonus): `accepted` (n,) holds the tree indices of the accepted path
with the root first, `bonus` is the token the target itself emits after the last accepted
node. So every cycle emits n - 1 draft tokens plus the bonus token.

Greedy and sampling share one rule. The target picks a token at every tree node at once:
its argmax (T = 0), or a sample from softmax(logits / T), cut to its top-k tokens, its
top-p nucleus and its min-p floor where those are asked for (`cut`); where a repetition
penalty is asked for, each node's logits are first penalised over its own sequence
(penalty.py). The accepted path is the longest chain of nodes whose tokens equal the pick
at their parent, and the bonus token is the pick at its last node. For sampling this is
exactly the multi-candidate rejection rule of EAGLE-2 / SpecInfer for deterministic drafts
(each candidate's draft probability q(x) is 1):
trying the children x_1, x_2, ... in order, accepting x_j with probability p(x_j) after
zeroing and renormalising away the rejected ones, accepts x_j with probability exactly
p(x_j) and otherwise samples the residual: the same as drawing y ~ p and taking the child
whose token is y, if any (p is whatever distribution the target samples from, cut or
not: the rule never looks at how it was made). Siblings with equal tokens are matched only
at the first of them (the rejection rule gives a repeated token probability 0), so at most
one child matches.
Drawing every node's token up front keeps shapes static and costs one host sync a cycle.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from gumiho import rowgemm
from gumiho.tree import DraftTree


class Acceptance(NamedTuple):
    nodes: Tensor  # (n,) tree indices of the accepted path, root first
    bonus: Tensor  # () the token the target emits after the last accepted node
    tokens: list[int]  # the emitted tokens on the host: accepted drafts, then the bonus
    contiguous: bool  # nodes are 0..n-1: their cache entries already lie in place


def accept_greedy(tree: DraftTree, logits: Tensor) -> tuple[Tensor, Tensor]:
    """Longest root-to-leaf path whose every token equals the target's argmax at its parent.

    logits: (K, V) target logits at the tree nodes.
    """
    result = accept_greedy_tokens(tree, logits)
    return result.nodes, result.bonus


def accept_greedy_tokens(tree: DraftTree, logits: Tensor) -> Acceptance:
    """`accept_greedy`, plus the emitted tokens (accepted drafts, then the bonus) on the host."""
    picks = rowgemm.argmax(logits)  # (K,); torch's where rowgemm.c does not run
    if tree.spliced_paths is not None:  # the official FTA: follow its spliced paths
        return _accept_along_paths(tree, picks)
    return accept_matching(tree, picks)


def accept_matching(tree: DraftTree, picks: Tensor, step=None) -> Acceptance:
    """The accepted path for the target's pick at every node (K,), the bonus token and the
    emitted tokens on the host.

    One host sync: a single transfer brings back the accept length, the path's nodes and
    the tokens. `step`: `match_picks` as a (recorded) engine step, if the loop has one.
    """
    dead = tree.dead if tree.dead is not None else torch.zeros_like(tree.tokens, dtype=torch.bool)
    packed, order, bonus = (step or match_picks)(tree.tokens, tree.parents, tree.depths,
                                                 tree.mask, dead, picks)
    return matched(tree.size, packed, order, bonus)


def matched(k: int, packed: Tensor, order: Tensor, bonus: Tensor) -> Acceptance:
    """The Acceptance of `match_picks`' outputs for a K-node tree: one host sync, a single
    transfer of the accept length, the path's tokens and its nodes."""
    host = packed.tolist()  # the host sync of the cycle: length, tokens, nodes
    n = host[0]
    nodes = host[k + 1 : k + 1 + n]
    return Acceptance(order[: n + 1], bonus[0], host[1 : n + 1] + host[k : k + 1],
                      nodes == list(range(1, n + 1)))


def match_picks(tokens: Tensor, parents: Tensor, depths: Tensor, mask: Tensor, dead: Tensor,
                picks: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The device part of `accept_matching` (tensors only: it can be recorded).

    A node is reachable when it and all its ancestors match the pick at their parents; the
    deepest reachable node (the first in node order on a tie, which only greedy decoding
    can meet: equal token chains, so equal output) ends the accepted path. Returns packed
    (2K,) = [accept length, the path's K - 1 tokens (padded), bonus, its K - 1 nodes], the
    path's nodes ordered by depth (K + 1,) (valid up to the accept length) and the bonus (1,).
    """
    k = tokens.shape[0]
    matched = (tokens == picks[parents.clamp(min=0)]) & first_of_siblings(tokens, parents) & \
        ~dead
    # the root is already the target's; a slice takes True as a fill (`matched[0] = True`
    # copies a host scalar into the device tensor, which CUDA graph capture refuses)
    matched[:1] = True
    reachable = ~(mask & ~matched[None, :]).any(1)
    reach = torch.where(reachable, depths, -1)
    best = reach.argmax().view(1)  # indexing with a 0-dim tensor would read it on the host
    # best's ancestors ordered by depth (slot k collects the non-ancestors, then is dropped)
    order = torch.zeros(k + 1, dtype=torch.long, device=picks.device)
    order.scatter_(0, torch.where(mask[best][0], depths, k), torch.arange(k, device=picks.device))
    bonus = picks[best]
    packed = torch.cat([reach[best], tokens[order[1:k]], bonus, order[1:k]])
    return packed, order, bonus


def match_on_host(tree: DraftTree, picks: list[int]) -> Acceptance:
    """`match_picks`' rule walked in Python over the tree's host copy: for the eager
    engine on a CPU, where reading a tensor costs no device sync and match_picks' ~30
    operations (made so that a GPU's recorded verify accepts without a sync) cost more than
    a small tree's walk. The same nodes, bonus and tokens as `accept_matching`
    (tests/test_engines.py)."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    dead = tree.dead.tolist() if tree.dead is not None else None
    reach, depth, seen = [True], [0], set()
    best = 0
    for i in range(1, len(tokens)):
        parent, token = parents[i], tokens[i]
        first = (parent, token) not in seen  # an earlier sibling with this token wins
        seen.add((parent, token))
        reach.append(reach[parent] and first and token == picks[parent]
                     and not (dead and dead[i]))
        depth.append(depth[parent] + 1)
        if reach[i] and depth[i] > depth[best]:  # the deepest, the first of equals
            best = i
    path = [best]
    while path[-1]:
        path.append(parents[path[-1]])
    path.reverse()
    bonus = picks[best]
    return Acceptance(torch.tensor(path, device=tree.tokens.device),
                      torch.tensor(bonus, device=tree.tokens.device),
                      [tokens[j] for j in path[1:]] + [bonus],
                      path == list(range(len(path))))


def first_of_siblings(tokens: Tensor, parents: Tensor) -> Tensor:
    """(K,) bool: false for a node whose token an earlier sibling already carries."""
    k = tokens.shape[0]
    same = (parents[:, None] == parents[None, :]) & (tokens[:, None] == tokens[None, :])
    earlier = torch.ones(k, k, dtype=torch.bool, device=tokens.device).tril(-1)
    return ~(same & earlier).any(1)


def _accept_along_paths(tree: DraftTree, picks: Tensor) -> Acceptance:
    paths = tree.paths  # (P, D + 1)
    safe = paths.clamp(min=0)
    match = (tree.tokens[safe[:, 1:]] == picks[safe[:, :-1]]) & (paths[:, 1:] >= 0)
    lengths = match.long().cumprod(1).sum(1)  # (P,) accepted draft tokens per path
    best = int(lengths.argmax())
    n = int(lengths[best])
    accepted = safe[best, : n + 1]
    bonus = picks[accepted[-1]]
    return Acceptance(accepted, bonus, emitted_tokens(tree, accepted, bonus), False)


def emitted_tokens(tree: DraftTree, accepted: Tensor, bonus: Tensor) -> list[int]:
    """The accepted draft tokens, then the bonus, on the host (syncs)."""
    return tree.tokens[accepted[1:]].tolist() + [int(bonus)]


def sample_tokens(logits: Tensor, temperature: float, generator: torch.Generator,
                  top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> Tensor:
    """One token per row of logits (..., V): the argmax at T == 0, else a sample from
    softmax(logits / T), cut to its `top_k` likeliest tokens, then to its `top_p` nucleus,
    then to those at least `min_p` times as likely as the likeliest, where those are set
    (`cut`; 0, 1.0 and 0.0: off). `generator` lives on the logits' device (no transfer; a
    cut on the CPU reads the host, `cut`)."""
    if temperature == 0:
        return rowgemm.argmax(logits)  # torch's for other shapes and devices
    probs = torch.softmax(logits.float() / temperature, -1)
    probs = probs.reshape(-1, probs.shape[-1])
    if not is_cut(probs.shape[-1], top_k, top_p, min_p):
        return draw(probs, generator).view(logits.shape[:-1])
    values, indices = cut(probs, top_k, top_p, min_p)  # (N, n): the kept tokens among them
    return indices.gather(-1, draw(values, generator)[:, None]).view(logits.shape[:-1])


def is_cut(vocab: int, top_k: int, top_p: float, min_p: float = 0.0) -> bool:
    """Whether top_k, top_p and min_p cut anything from a vocab-sized distribution."""
    return 0 < top_k < vocab or top_p < 1.0 or min_p > 0.0


def truncated(probs: Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
              ) -> Tensor:
    """probs (N, V) with each row cut as `cut` cuts it, in place of the whole row: the
    kept tokens' probabilities, zeros elsewhere (unnormalised)."""
    if not is_cut(probs.shape[-1], top_k, top_p, min_p):
        return probs
    values, indices = cut(probs, top_k, top_p, min_p)
    return torch.zeros_like(probs).scatter_(-1, indices, values)


def cut(probs: Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
        ) -> tuple[Tensor, Tensor]:
    """Each row of probs (N, V) cut as HF's top-k, top-p and min-p warpers cut it (in that
    order): its `top_k` likeliest tokens (0: all), then of those the nucleus, the likeliest
    whose mass reaches `top_p` of what is left (1.0: all; Holtzman et al. 2020, "The curious
    case of neural text degeneration"), then of those the tokens at least `min_p` times as
    likely as the likeliest (0.0: all; Nguyen et al. 2024, "Turning up the heat: min-p
    sampling"; the ratio is the same before and after the earlier cuts renormalise, and the
    likeliest token always stays). Each cut keeps every token at least as likely as
    the last one it needs, so ties at an edge stay together and nothing depends on how a
    sort orders them. Returns the n likeliest tokens' probabilities, zero where cut, and
    their ids, (N, n) each; every kept token above 0 is among them. Unnormalised: `draw`
    divides by the kept total.

    A row's cut depends on that row alone: speculative sampling draws every tree node's
    token from the cut distribution, and the multi-candidate rule (module doc) then emits
    exactly what plain decoding with the same cut emits. A full sort of SmolLM2's 49,152
    tokens takes ~4 ms a row on a 2-core CPU (its softmax 0.07), so there the kept tokens
    are sought among the 64 likeliest first (0.1 ms), then 512, then all (one host read a
    round); on other devices a sort is cheap and a host read is a sync: all at once."""
    vocab = probs.shape[-1]
    by_k = 0 < top_k < vocab
    n = vocab if probs.device.type != "cpu" else min(vocab, max(64, top_k + 1 if by_k else 0))
    if top_p < 1.0 and not by_k:  # (N, 1): what the nucleus takes its share of (~1)
        total = probs.sum(-1, keepdim=True, dtype=torch.float64)
    while True:
        values, indices = probs.topk(n)  # (N, n), likeliest first
        # the top-k edge: the k-th likeliest's probability (0: none)
        edge = values[:, top_k - 1 : top_k] if by_k else torch.zeros_like(values[:, :1])
        floor = edge
        if top_p < 1.0:
            mass = torch.where(values >= edge, values, 0.0).cumsum(-1, dtype=torch.float64)
            goal = top_p * (mass[:, -1:] if by_k else total)  # of what the top-k cut left
            reached = mass >= goal
            # the first token whose running mass reaches the goal; where float sums never
            # quite reach it (top_p near 1), the last: the whole window stays
            last = torch.where(reached.any(-1), reached.int().argmax(-1), n - 1)
            floor = torch.maximum(floor, values.gather(-1, last[:, None]))
        if min_p > 0.0:
            floor = torch.maximum(floor, min_p * values[:, :1])
        # every kept token is in the window once a token past it falls below the floor (a
        # top-k cut's own edge, so that its mass above was whole), or once the window ends
        # in a token of probability 0: all that can be drawn is in it (a low temperature
        # leaves fewer than k tokens above 0, and a top-k edge of 0 would grow the window
        # to the whole vocabulary: 10x the time)
        tail = values[:, -1:]
        if n == vocab or bool(((tail < (edge if by_k else floor)) | (tail == 0)).all()):
            return torch.where(values >= floor, values, 0.0), indices
        n = min(n * 8, vocab)


def draw(probs: Tensor, generator: torch.Generator) -> Tensor:
    """One draw per row of probs (N, V), distributed as torch.multinomial(probs, 1): the
    first token whose cumulative probability exceeds a uniform draw times the row's total.

    One uniform number a row where multinomial draws an exponential one per token: at
    SmolLM2's 49,152 tokens multinomial took 1.3 ms a row on a 2-core CPU (10 ms for a
    Gumiho tree's 8 rows, a third of a T = 1 cycle), this 0.07 ms. The sums run in float64
    (float32 on MPS, which has none), so a token's share of [0, total) is its probability
    to ~1e-16; `right=True` never lands on a token of probability 0."""
    wide = torch.float32 if probs.device.type == "mps" else torch.float64
    cdf = probs.cumsum(-1, dtype=wide)  # (N, V)
    u = torch.rand((probs.shape[0], 1), dtype=wide, device=probs.device, generator=generator)
    picks = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)  # (N, 1)
    return picks.clamp_(max=probs.shape[-1] - 1).view(-1)  # (u * total rounding up to it)


def accept_sampling(tree: DraftTree, logits: Tensor, temperature: float,
                    generator: torch.Generator, top_k: int = 0, top_p: float = 1.0,
                    min_p: float = 0.0) -> tuple[Tensor, Tensor]:
    """Multi-candidate rejection sampling for a deterministic draft tree (EAGLE-2,
    SpecInfer), in the equivalent form of the module docstring: emits exactly softmax(
    logits / T), cut by top_k, top_p and min_p (`cut`), at every step (along the official
    FTA's spliced paths if it spliced)."""
    result = accept(tree, logits, temperature, generator, top_k=top_k, top_p=top_p,
                    min_p=min_p)
    return result.nodes, result.bonus


def sample_along_paths(tree: DraftTree, picks: Tensor) -> Acceptance:
    """The released sampler on the official FTA's spliced paths, in the equivalent form of
    the module docstring (picks (K,): one draw per node). At each depth it reads the
    logits of the first path whose tokens so far are the emitted ones, and tries the
    distinct next tokens of all such paths; the accepted nodes are the last matching
    path's. Host loop: official mode only."""
    paths, tokens, drawn = tree.spliced_paths.tolist(), tree.tokens.tolist(), picks.tolist()
    rows, best, n = list(range(len(paths))), 0, 0
    for col in range(1, len(paths[0])):
        y = drawn[paths[rows[0]][col - 1]]
        rows = [r for r in rows if paths[r][col] >= 0 and tokens[paths[r][col]] == y]
        if not rows:
            break
        best, n = rows[0], col
    else:
        y = drawn[paths[best][-1]]  # every column accepted: the bonus from the last node
    accepted = tree.spliced_paths[best, : n + 1]
    emitted = [tokens[node] for node in paths[best][1 : n + 1]] + [y]
    return Acceptance(accepted, torch.tensor(y, device=picks.device), emitted, False)


def accept(tree: DraftTree, logits: Tensor, temperature: float,
           generator: torch.Generator, step=None, top_k: int = 0, top_p: float = 1.0,
           min_p: float = 0.0) -> Acceptance:
    """The accepted path, bonus token and emitted tokens of a cycle: the target's picks
    (`sample_tokens`), then `accept_picks`."""
    picks = sample_tokens(logits, temperature, generator, top_k, top_p, min_p)
    return accept_picks(tree, picks, temperature, step)


def accept_picks(tree: DraftTree, picks: Tensor, temperature: float, step=None
                 ) -> Acceptance:
    """The accepted path, bonus token and emitted tokens for the target's pick at every
    node (K,), drawn at `temperature` (0: its argmax). step: a recorded `match_picks`
    (engine.TargetRunner), or None."""
    if tree.spliced_paths is not None:  # the official FTA splice (at T > 0: rarely)
        if temperature == 0:
            return _accept_along_paths(tree, picks)
        return sample_along_paths(tree, picks)
    return accept_matching(tree, picks, step)
