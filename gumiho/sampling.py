"""Deciding which draft tokens the target accepts: greedy and lossless sampling.

Both return (accepted, bonus): `accepted` (n,) holds the tree indices of the accepted path
with the root first, `bonus` is the token the target itself emits after the last accepted
node. So every cycle emits n - 1 draft tokens plus the bonus token.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gumiho.tree import DraftTree


def accept_greedy(tree: DraftTree, logits: Tensor) -> tuple[Tensor, Tensor]:
    """Longest root-to-leaf path whose every token equals the target's argmax at its parent.

    logits: (K, V) target logits at the tree nodes.
    """
    accepted, bonus, _ = accept_greedy_tokens(tree, logits)
    return accepted, bonus


def accept_greedy_tokens(tree: DraftTree, logits: Tensor) -> tuple[Tensor, Tensor, list[int]]:
    """`accept_greedy`, plus the emitted tokens (accepted drafts, then the bonus) on the host.

    One host sync: a single transfer brings back the accept length and the tokens.
    A node is reachable when it and all its ancestors match the target's argmax at their
    parents; the deepest reachable node (the first in node order on a tie: equal token
    chains, so equal output) ends the accepted path.
    """
    argmax = logits.argmax(-1)  # (K,)
    if tree.spliced_paths is not None:  # the official FTA: follow its spliced paths
        return _accept_along_paths(tree, argmax)
    k = tree.size
    matched = tree.tokens == argmax[tree.parents.clamp(min=0)]
    matched[0] = True  # the root is already the target's
    reachable = ~(tree.mask & ~matched[None, :]).any(1)
    reach = torch.where(reachable, tree.depths, -1)
    best = reach.argmax()
    # best's ancestors ordered by depth (slot k collects the non-ancestors, then is dropped)
    order = torch.zeros(k + 1, dtype=torch.long, device=argmax.device)
    order.scatter_(0, torch.where(tree.mask[best], tree.depths, k),
                   torch.arange(k, device=argmax.device))
    bonus = argmax[best]
    packed = torch.cat([reach[best].view(1), tree.tokens[order[1:k]], bonus.view(1)])
    host = packed.tolist()  # the host sync of the cycle: accept length and tokens
    n = host[0]
    return order[: n + 1], bonus, host[1 : n + 1] + host[-1:]


def _accept_along_paths(tree: DraftTree, argmax: Tensor) -> tuple[Tensor, Tensor, list[int]]:
    paths = tree.paths  # (P, D + 1)
    safe = paths.clamp(min=0)
    match = (tree.tokens[safe[:, 1:]] == argmax[safe[:, :-1]]) & (paths[:, 1:] >= 0)
    lengths = match.long().cumprod(1).sum(1)  # (P,) accepted draft tokens per path
    best = int(lengths.argmax())
    n = int(lengths[best])
    accepted = safe[best, : n + 1]
    bonus = argmax[accepted[-1]]
    return accepted, bonus, emitted_tokens(tree, accepted, bonus)


def emitted_tokens(tree: DraftTree, accepted: Tensor, bonus: Tensor) -> list[int]:
    """The accepted draft tokens, then the bonus, on the host (syncs)."""
    return tree.tokens[accepted[1:]].tolist() + [int(bonus)]


def sample_token(logits: Tensor, temperature: float, generator: torch.Generator) -> Tensor:
    """A token from softmax(logits / T), or the argmax when T == 0. logits: (V,)."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float().cpu() / temperature, -1)
    return torch.multinomial(probs, 1, generator=generator)[0].to(logits.device)


def accept_sampling(tree: DraftTree, logits: Tensor, temperature: float,
                    generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Multi-candidate rejection sampling for a deterministic draft tree (EAGLE-2, SpecInfer).

    At each node, with p = softmax(logits / T) at that node, the children are tried in
    order: child token x is accepted with probability p(x); on rejection p(x) is zeroed and
    p renormalised. If every child is rejected (or there is none) the bonus token is drawn
    from what is left of p. Since each candidate is a fixed token (its draft probability
    q(x) is 1), this emits exactly p's distribution: P(x_1) = p(x_1),
    P(x_2) = (1 - p(x_1)) * p(x_2) / (1 - p(x_1)) = p(x_2), and so on.
    """
    tokens = tree.tokens.tolist()
    children = path_children(tree)
    accepted = [0]
    node = 0
    while True:
        p = torch.softmax(logits[node].float().cpu() / temperature, -1)
        for child in children[node]:
            x = tokens[child]
            if torch.rand((), generator=generator) < p[x]:
                accepted.append(child)
                node = child
                break
            p[x] = 0.0
            p /= p.sum()
        else:
            bonus = torch.multinomial(p, 1, generator=generator)[0]
            break
    device = tree.tokens.device
    return torch.tensor(accepted, device=device), bonus.to(device)


def path_children(tree: DraftTree) -> list[list[int]]:
    """Each node's successors along the tree's paths, in node order. For a plain tree these
    are its children; for the official FTA splice they include the spliced nodes."""
    successors: list[set[int]] = [set() for _ in range(tree.size)]
    for path in tree.paths.tolist():
        nodes = [n for n in path if n >= 0]
        for a, b in zip(nodes, nodes[1:], strict=False):
            successors[a].add(b)
    return [sorted(s) for s in successors]


def accept(tree: DraftTree, logits: Tensor, temperature: float,
           generator: torch.Generator) -> tuple[Tensor, Tensor, list[int]]:
    """(accepted node indices, bonus token, the emitted tokens on the host)."""
    if temperature == 0:
        return accept_greedy_tokens(tree, logits)
    accepted, bonus = accept_sampling(tree, logits, temperature, generator)
    return accepted, bonus, emitted_tokens(tree, accepted, bonus)
