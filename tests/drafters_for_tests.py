"""Drafters with known behaviour, for checking the loop: one that replays the target's own
greedy continuation (everything on its main path is accepted) and one that proposes random
trees (almost nothing is)."""

import torch

from gumiho.tree import DraftTree


class ReplayDrafter:
    """Proposes the known sequence `full` (prompt + greedy continuation) as the main path,
    with a wrong sibling beside every main-path node so acceptance must pick a branch."""

    name = "replay"

    def __init__(self, full: list[int], depth: int = 5, vocab_size: int = 97, seed: int = 0):
        self.full, self.depth, self.vocab_size = full, depth, vocab_size
        self.max_nodes = 1 + 2 * depth
        self.rng = torch.Generator().manual_seed(seed)

    def begin(self, target, capacity):
        self.known = 1  # tokens of `full` committed or rooted: prompt[0] precedes every feature

    def observe(self, features, next_tokens):
        self.known += next_tokens.shape[0]
        self.root = next_tokens[-1:]

    def propose(self) -> DraftTree:
        main = self.full[self.known : self.known + self.depth]
        tokens, parents, parent = [int(self.root)], [-1], 0
        for tok in main:
            wrong = (tok + 1 + int(torch.randint(self.vocab_size - 1, (), generator=self.rng))) \
                % self.vocab_size
            tokens += [wrong, tok]  # the wrong sibling comes first
            parents += [parent, parent]
            parent = len(tokens) - 1
        return DraftTree.from_parents(torch.tensor(tokens), torch.tensor(parents))


class RandomDrafter:
    """Random trees of `size` nodes: random topological parents and random tokens."""

    name = "random-tree"

    def __init__(self, vocab_size: int, size: int = 12, seed: int = 0):
        self.vocab_size, self.max_nodes = vocab_size, size
        self.rng = torch.Generator().manual_seed(seed)

    def begin(self, target, capacity):
        pass

    def observe(self, features, next_tokens):
        self.root = next_tokens[-1:]

    def propose(self) -> DraftTree:
        return random_tree(self.root, self.max_nodes, self.vocab_size, self.rng)


def random_tree(root, size, vocab_size, rng) -> DraftTree:
    parents = [-1] + [int(torch.randint(i, (), generator=rng)) for i in range(1, size)]
    tokens = torch.cat([root.view(1), torch.randint(vocab_size, (size - 1,), generator=rng)])
    return DraftTree.from_parents(tokens, torch.tensor(parents))
