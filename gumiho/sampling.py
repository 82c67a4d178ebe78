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
    argmax = logits.argmax(-1)  # (K,)
    paths = tree.paths  # (P, D + 1)
    safe = paths.clamp(min=0)
    match = (tree.tokens[safe[:, 1:]] == argmax[safe[:, :-1]]) & (paths[:, 1:] >= 0)
    lengths = match.long().cumprod(1).sum(1)  # (P,) accepted draft tokens per path
    best = int(lengths.argmax())
    n = int(lengths[best])  # the host sync of the cycle: the accept length
    accepted = safe[best, : n + 1]
    return accepted, argmax[accepted[-1]]


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
           generator: torch.Generator) -> tuple[Tensor, Tensor]:
    if temperature == 0:
        return accept_greedy(tree, logits)
    return accept_sampling(tree, logits, temperature, generator)
