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
        self.max_nodes, self.draft_depth = 1 + 2 * depth, depth
        self.rng = torch.Generator().manual_seed(seed)

    def begin(self, target, capacity):
        self.known = 1  # tokens of `full` committed or rooted: prompt[0] precedes every feature

    def observe(self, features, next_tokens, tokens=None):
        self.known += next_tokens.shape[0]
        self.root = next_tokens[-1:]

    def propose(self) -> DraftTree:
        main = self.full[self.known : self.known + self.depth]
        tokens, parents, parent = [int(self.root)], [-1], 0
        for tok in main:
            draw = torch.randint(self.vocab_size - 1, (), generator=self.rng, device="cpu")
            wrong = (tok + 1 + int(draw)) % self.vocab_size
            tokens += [wrong, tok]  # the wrong sibling comes first
            parents += [parent, parent]
            parent = len(tokens) - 1
        return DraftTree.from_parents(torch.tensor(tokens), torch.tensor(parents))


class RandomDrafter:
    """Random trees of `size` nodes: random topological parents and random tokens."""

    name = "random-tree"

    def __init__(self, vocab_size: int, size: int = 12, seed: int = 0):
        self.vocab_size, self.max_nodes, self.draft_depth = vocab_size, size, size - 1
        self.rng = torch.Generator().manual_seed(seed)

    def begin(self, target, capacity):
        pass

    def observe(self, features, next_tokens, tokens=None):
        self.root = next_tokens[-1:]

    def propose(self) -> DraftTree:
        return random_tree(self.root, self.max_nodes, self.vocab_size, self.rng)


def random_tree(root, size, vocab_size, rng) -> DraftTree:
    """A random tree on the default device (the test device), drawn with a CPU rng."""
    parents = [-1] + [int(torch.randint(i, (), generator=rng, device="cpu"))
                      for i in range(1, size)]
    drawn = torch.randint(vocab_size, (size - 1,), generator=rng, device="cpu")
    device = torch.get_default_device()
    tokens = torch.cat([root.view(1).to(device), drawn.to(device)])
    return DraftTree.from_parents(tokens, torch.tensor(parents, device=device))


class OracleModel(torch.nn.Module):
    """Stands in for a drafter network that knows the target's greedy sequence `full`.

    Hidden states carry (index in `full` of the token they predict, on-path flag) in their
    first two channels; `OracleHead` turns that into logits that rank full[index] first
    while the branch is still on the greedy path. Works with the real SerialDrafter code
    (beam, MLP levels, rerank, FTA), so a Gumiho or EAGLE-2 tree built from it accepts often.
    """

    def __init__(self, config, full: list[int]):
        super().__init__()
        self.config, self.full = config, torch.tensor(full)

    def _on(self, tokens, index):
        n = self.full.shape[0]  # (index is any integer when read from target features)
        inside = (index >= 0) & (index < n)
        return inside & (self.full[index.clamp(0, n - 1)] == tokens)

    MARK = 12345.0  # channel 2 of the oracle's own hidden states (never a target feature)

    def _hidden(self, index, on):
        # devices by name: torch.compile does not see a default-device context
        h = torch.zeros(*index.shape, self.config.hidden_size, device=index.device)
        h[..., 0], h[..., 1], h[..., 2] = index.float(), on.float(), self.MARK
        return h

    def serial_step(self, tokens, features, position_ids, attention_mask, cache=None):
        # Both readings, chosen on the device: a recorded step cannot ask the host which
        # (a `bool()` here broke CUDA graph capture on the eighth lease).
        # Committed pairs (f_t, x_{t+1}) at positions t (target features): predict t + 2.
        committed = self._hidden(position_ids + 2, torch.ones_like(tokens, dtype=torch.bool))
        index, on = features[..., 0].long(), features[..., 1] > 0.5  # from the parent's out
        drafted = self._hidden(index + 1, on & self._on(tokens, index))
        return torch.where((features[..., 2] == self.MARK).all(), drafted, committed)

    def parallel_heads(self, d1, out1, d2, out2, heads=None, first=0):
        index, on = out2[..., 0].long(), out2[..., 1] > 0.5  # d2 sits at `index`
        on = on & self._on(d2, index)
        n = heads or self.config.num_mlp_heads - first
        steps = torch.arange(first + 1, first + n + 1, device=index.device)
        return self._hidden(index[:, None] + steps, on[:, None].expand(-1, n))


class OracleHead:
    """Logits from an oracle hidden state: full[index] scores 10 while on the path; other
    tokens get fixed pseudo-random scores in [0, 1)."""

    ids = None  # drafts over the whole vocabulary (DraftHead.ids)

    def __init__(self, full: list[int], vocab_size: int):
        self.full, self.vocab = torch.tensor(full), vocab_size
        self.noise = torch.rand(len(full) + 16, vocab_size, generator=torch.Generator()
                                .manual_seed(5), device="cpu").to(torch.get_default_device())

    def to_target(self, indices):
        return indices

    def __call__(self, hidden):
        index, on = hidden[..., 0].long(), hidden[..., 1] > 0.5
        logits = self.noise[index.clamp(max=self.noise.shape[0] - 1)].clone()
        inside = on & (index < self.full.shape[0])
        best = self.full[index.clamp(max=self.full.shape[0] - 1)]
        logits.scatter_(-1, best[..., None], torch.where(inside, 10.0, 0.0)[..., None]
                        .expand_as(best[..., None]) + logits.gather(-1, best[..., None]))
        return logits


def oracle_drafter(method, target, full, tree, engine="eager"):
    """A SerialDrafter (gumiho or eagle2) whose network and lm_head are the oracle."""
    from gumiho.config import DrafterConfig
    from gumiho.serial_drafter import SerialDrafter

    config = DrafterConfig.for_target(target.config, method)
    drafter = SerialDrafter(OracleModel(config, full), tree, engine=engine)
    begin = drafter.begin

    head = OracleHead(full, config.vocab_size)

    def begin_with_oracle_head(tgt, capacity):
        begin(tgt, capacity)
        drafter.head = head  # one head: recorded steps keep reading its tensors

    drafter.begin = begin_with_oracle_head
    return drafter
