"""Penalties over a draft tree: the repetition penalty (Keskar et al. 2019, "CTRL";
transformers' `generate(repetition_penalty=...)`, vLLM's `repetition_penalty`), and the
presence and frequency penalties (OpenAI's API, vLLM's `presence_penalty` and
`frequency_penalty`), which subtract from the logit of every token the answer holds
`presence + frequency * count` (its count in the answer, the prompt left out), applied
after the repetition penalty, as vLLM applies them; `min_tokens` (`MinTokens`), which
keeps the tokens that would end the answer out of reach until it is that long;
transformers' `no_repeat_ngram_size` (`NoRepeatNGram`); and `logit_bias` (`LogitBias`),
added to chosen tokens' logits before all of them.

For the repetition penalty plain decoding divides the logit of every token already in the
sequence (the prompt and what was generated) by the penalty where the logit is positive
and multiplies it where it is negative, before the temperature and any cut (transformers'
RepetitionPenaltyLogitsProcessor, in float32). In a tree each node has a sequence of its
own: the committed tokens, then the nodes its row of the verify mask sees (its ancestors
and itself; what the target conditions that row on). So each row is penalised over its own
sequence (for the presence and frequency penalties, the answer so far and the node's path
below the root, whose token the answer already holds), and a node's pick is what plain
decoding would pick after that sequence: the loop stays lossless, greedy output equal to
plain decoding's with the same penalties, and
sampling draws from the same penalised distribution.

The drafters penalise their own logits over the sequence so far too (`drafted`; not over
the tree's own drafts, and on the eager engine only: a recorded step holds no branch per
generation), so that they propose what the penalised target is likely to pick: with
SmolLM2's shipped Gumiho drafter, 8-token trees, six prompts x 96 tokens and a penalty of
1.3, tau 1.41 unpenalised, 1.70 penalised (2.32 without a penalty; 1.88 and 1.92 at 1.1).
Whatever a drafter proposes, the target's penalised picks decide: a draft the penalty
turns away is rejected like any other, so it costs acceptance, never correctness.
"""

from __future__ import annotations

import torch
from torch import Tensor


def penalize(logits: Tensor, seen: Tensor, penalty: float) -> Tensor:
    """logits (N, V) as float32, with the entries where `seen` (N, V) or (V,) is True
    divided by `penalty` where positive and multiplied by it where not, as transformers'
    RepetitionPenaltyLogitsProcessor computes them."""
    logits = logits.float()
    return torch.where(seen, scaled(logits, penalty), logits)


def scaled(logits: Tensor, penalty: float) -> Tensor:
    """Every entry penalised (`penalize`'s arithmetic)."""
    return torch.where(logits < 0, logits * penalty, logits / penalty)


class RepetitionPenalty:
    """One generation's penalty: the tokens of its sequence so far (`seen`, a (V,) mask on
    the device, grown from device tensors: no host sync) and what each tree row adds.

    On a GPU every row is penalised through the whole (K, V) mask (no sync, cheap there);
    on a CPU, where that costs ~0.25 ms a row at a 49,152-token vocabulary, only the
    columns that change are touched: the sequence's tokens (their ids kept on the host
    side, refreshed after each cycle) and each row's own drafted tokens. Both give the
    same values (tests/test_penalty.py)."""

    def __init__(self, penalty: float, vocab: int, context: Tensor):
        """`context`: the prompt's token ids (1-D, on the logits' device)."""
        self.penalty = penalty
        self.seen = torch.zeros(vocab, dtype=torch.bool, device=context.device)
        self.by_columns = context.device.type == "cpu"
        self._ids: Tensor | None = None  # the seen ids, while `seen` has not changed
        self._drafted: dict[int, tuple[Tensor | None, Tensor]] = {}  # per draft vocabulary
        self.add(context)

    def add(self, tokens: Tensor) -> None:
        """Tokens (1-D, on the device) that joined the sequence."""
        self.seen.index_fill_(0, tokens.reshape(-1), True)
        self._ids, self._drafted = None, {}

    @property
    def ids(self) -> Tensor:
        """The ids in the sequence so far, each once (a host sync: CPU only)."""
        if self._ids is None:
            self._ids = self.seen.nonzero().view(-1)
        return self._ids

    def last(self, logits: Tensor) -> Tensor:
        """The penalised logits (..., V) of the sequence's next token."""
        if not self.by_columns:
            return penalize(logits, self.seen, self.penalty)
        logits = logits.float().clone()
        logits[..., self.ids] = scaled(logits[..., self.ids], self.penalty)
        return logits

    def drafted(self, logits: Tensor, ids: Tensor | None) -> Tensor:
        """A drafter's fresh logits (..., Vd) over its draft vocabulary, whose target ids
        are `ids` (Vd,) (None: the target's whole vocabulary), penalised over the sequence
        so far, in place."""
        key = 0 if ids is None else id(ids)
        if key not in self._drafted:
            seen = self.seen if ids is None else self.seen[ids]
            self._drafted[key] = (ids, seen.nonzero().view(-1) if self.by_columns else seen)
        columns = self._drafted[key][1]
        if not self.by_columns:
            return logits.copy_(torch.where(columns, scaled(logits, self.penalty), logits))
        logits[..., columns] = scaled(logits[..., columns], self.penalty)
        return logits

    def rows(self, logits: Tensor, tokens: Tensor, sees: Tensor) -> Tensor:
        """The penalised logits (K, V) of a verify's K rows: row i over the sequence so far
        and the tree's `tokens` (K,) where `sees[i]` (K, K) is True (the verify mask)."""
        k, vocab = logits.shape
        if not self.by_columns:
            own = torch.zeros(k, vocab, dtype=torch.uint8, device=logits.device)
            own.scatter_reduce_(1, tokens.view(1, k).expand(k, k), sees.to(torch.uint8),
                                "amax")
            return penalize(logits, own.bool() | self.seen, self.penalty)
        logits = self.last(logits)  # the sequence's tokens, in every row
        # row i's own tokens not in the sequence yet, each once: where a token stands at
        # two nodes a row sees, both columns get the same flag (a scatter of equal values)
        same = tokens[:, None] == tokens[None, :]  # (K, K)
        new = sees & ~self.seen[tokens][None, :]
        flag = (new.to(torch.int32) @ same.to(torch.int32)) > 0  # (K, K) over tokens[j]
        columns = tokens.view(1, k).expand(k, k)
        values = logits.gather(1, columns)
        return logits.scatter_(1, columns, torch.where(flag, scaled(values, self.penalty),
                                                       values))


def subtracted(logits: Tensor, counts: Tensor, presence: float, frequency: float) -> Tensor:
    """logits minus `presence` where a count is above 0 and `frequency` times the count
    (the presence and frequency penalties; entries with a count of 0 keep their bits)."""
    return logits - (frequency * counts + presence * (counts > 0).to(counts.dtype))


class AnswerPenalty:
    """One generation's presence and frequency penalties: how often each token stands in
    the answer so far (`counts`, a (V,) float32 tensor on the device, grown from device
    tensors), and what each tree row adds; by columns on a CPU, through whole (K, V) counts
    elsewhere, as `RepetitionPenalty` (the same values: tests/test_penalty.py)."""

    def __init__(self, presence: float, frequency: float, vocab: int, device: torch.device):
        self.presence, self.frequency = presence, frequency
        self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)
        self.by_columns = torch.device(device).type == "cpu"
        self._ids: Tensor | None = None
        self._drafted: dict[int, tuple] = {}  # per draft vocabulary (ids kept: id() stays)

    def add(self, tokens: Tensor) -> None:
        """Tokens (1-D, on the device) that joined the answer."""
        tokens = tokens.reshape(-1)
        self.counts.index_add_(0, tokens, torch.ones(tokens.shape, device=tokens.device))
        self._ids, self._drafted = None, {}

    @property
    def ids(self) -> Tensor:
        """The ids in the answer so far, each once (a host sync: CPU only)."""
        if self._ids is None:
            self._ids = self.counts.nonzero().view(-1)
        return self._ids

    def _subtract(self, logits: Tensor, counts: Tensor) -> Tensor:
        return subtracted(logits, counts, self.presence, self.frequency)

    def last(self, logits: Tensor) -> Tensor:
        """The penalised logits (..., V) of the answer's next token."""
        if not self.by_columns:
            return self._subtract(logits.float(), self.counts)
        logits = logits.float().clone()
        logits[..., self.ids] = self._subtract(logits[..., self.ids], self.counts[self.ids])
        return logits

    def drafted(self, logits: Tensor, ids: Tensor | None) -> Tensor:
        """A drafter's fresh logits (..., Vd) over its draft vocabulary (target ids `ids`,
        None: the whole vocabulary), penalised over the answer so far, in place."""
        key = 0 if ids is None else id(ids)
        if key not in self._drafted:
            counts = self.counts if ids is None else self.counts[ids]
            columns = counts.nonzero().view(-1) if self.by_columns else None
            self._drafted[key] = (ids, counts, columns)
        _, counts, columns = self._drafted[key]
        if columns is None:
            return logits.copy_(self._subtract(logits, counts))
        logits[..., columns] = self._subtract(logits[..., columns], counts[columns])
        return logits

    def rows(self, logits: Tensor, tokens: Tensor, sees: Tensor) -> Tensor:
        """The penalised logits (K, V) of a verify's K rows: row i over the answer so far
        and the tree's `tokens` (K,) below the root where `sees[i]` (K, K) is True."""
        k, vocab = logits.shape
        path = sees.clone()
        path[:, 0] = False  # the root's token is the answer's last, counted already
        if not self.by_columns:
            own = torch.zeros(k, vocab, device=logits.device).scatter_add_(
                1, tokens.view(1, k).expand(k, k), path.float())
            return self._subtract(logits.float(), self.counts + own)
        logits = logits.float()
        columns = tokens.view(1, k).expand(k, k)
        raw = logits.gather(1, columns)
        logits = self.last(logits)  # the answer's tokens, in every row
        same = (tokens[:, None] == tokens[None, :]).float()  # (K, K)
        extra = path.float() @ same  # row i's count of tokens[j] on its own path
        now = self.counts[tokens][None, :] + extra
        values = torch.where(extra > 0, self._subtract(raw, now), logits.gather(1, columns))
        return logits.scatter_(1, columns, values)


class LogitBias:
    """`logit_bias` (OpenAI's and vLLM's; transformers' `sequence_bias` for one-token
    sequences): a number added to chosen tokens' logits at every position, before the
    penalties (transformers' order). The same for every row, so a tree needs nothing of
    its own."""

    def __init__(self, bias: dict[int, float], device: torch.device):
        self.ids = torch.tensor(list(bias), dtype=torch.long, device=device)
        self.values = torch.tensor(list(bias.values()), dtype=torch.float32, device=device)
        self._drafted: dict[int, tuple] = {}  # per draft vocabulary (ids kept: id() stays)

    def add(self, tokens: Tensor) -> None:
        pass

    def last(self, logits: Tensor) -> Tensor:
        logits = logits.float().clone()
        logits[..., self.ids] += self.values
        return logits

    def drafted(self, logits: Tensor, ids: Tensor | None) -> Tensor:
        """A drafter's fresh logits (..., Vd) (target ids `ids`, None: the whole
        vocabulary), the biased tokens it holds biased, in place."""
        key = 0 if ids is None else id(ids)
        if key not in self._drafted:
            if ids is None:
                columns, values = self.ids, self.values
            else:  # the draft positions holding a biased target id, and that id's bias
                columns, which = (ids[:, None] == self.ids.to(ids.device)).nonzero(
                    as_tuple=True)
                values = self.values.to(ids.device)[which]
            self._drafted[key] = (ids, columns, values)
        _, columns, values = self._drafted[key]
        logits[..., columns] += values.to(logits.dtype)
        return logits

    def rows(self, logits: Tensor, tokens: Tensor, sees: Tensor) -> Tensor:
        return self.last(logits)


class NoRepeatNGram:
    """transformers' `no_repeat_ngram_size` (NoRepeatNGramLogitsProcessor): no n-gram of
    the sequence (the prompt and the answer) twice, i.e. after its last n - 1 tokens, none
    of the tokens that followed those n - 1 before has a chance (-inf). In a tree each row
    bans over its own sequence, the committed tokens then its path below the root, so a
    node's pick is plain decoding's. Kept on the host (a dict from each (n - 1)-gram to the
    tokens that followed it): a cycle reads the tree and the emitted tokens back, a host
    sync a GPU would pay; drafters are not told."""

    def __init__(self, size: int, prompt: Tensor):
        self.size = size
        self.sequence: list[int] = []
        self.followers: dict[tuple[int, ...], set[int]] = {}
        self._add(prompt.tolist())

    def _add(self, tokens: list[int]) -> None:
        n = self.size
        for token in tokens:
            self.sequence.append(token)
            if len(self.sequence) >= n:
                self.followers.setdefault(tuple(self.sequence[-n:-1]), set()).add(token)

    def add(self, tokens: Tensor) -> None:
        self._add(tokens.reshape(-1).tolist())

    def banned(self, path: list[int]) -> set[int]:
        """The tokens that may not follow the committed sequence and then `path`."""
        n = self.size
        if len(self.sequence) + len(path) + 1 < n:
            return set()
        # (a sequence shorter than n - 1 is whole: a negative start would cut its front)
        tail = self.sequence[max(len(self.sequence) - n + 1, 0):] if n > 1 else []
        whole = tail + path  # the committed n - 1 tokens are all a new n-gram can reach
        prefix = tuple(whole[len(whole) - n + 1:])
        out = set(self.followers.get(prefix, ()))
        for end in range(max(len(tail), n - 1), len(whole)):  # n-grams ending in the path
            if tuple(whole[end - n + 1:end]) == prefix:
                out.add(whole[end])
        return out

    def last(self, logits: Tensor) -> Tensor:
        ban = sorted(self.banned([]))
        if not ban:
            return logits
        logits = logits.float().clone()
        logits[..., ban] = float("-inf")
        return logits

    def drafted(self, logits: Tensor, ids: Tensor | None) -> Tensor:
        return logits  # not told: a banned draft is rejected like any other

    def rows(self, logits: Tensor, tokens: Tensor, sees: Tensor) -> Tensor:
        """Row i banned over the committed sequence and the tree tokens its row of the
        verify mask sees below the root, in depth order."""
        ids, mask = tokens.tolist(), sees.tolist()
        depth = [sum(row) for row in mask]
        rows, columns = [], []
        for i, row in enumerate(mask):
            path = sorted((j for j in range(1, len(ids)) if row[j]), key=depth.__getitem__)
            for token in self.banned([ids[j] for j in path]):
                rows.append(i)
                columns.append(token)
        if not rows:
            return logits
        logits = logits.float().clone()
        logits[rows, columns] = float("-inf")
        return logits


class MinTokens:
    """`min_tokens` (vLLM's; transformers' `min_new_tokens`): the stop tokens' logits at
    -inf until the answer holds `minimum` tokens, so that it cannot end sooner. In a tree
    row i (its node at depth d below the root) predicts the answer's token `count + d`
    (`count` the tokens it holds), so each row is masked by its own depth: a node's pick
    is still plain decoding's. Nothing is touched once the answer is long enough."""

    def __init__(self, minimum: int, stop_ids: list[int], vocab: int, device: torch.device):
        self.minimum, self.count = minimum, 0
        self.stops = torch.tensor(sorted({i for i in stop_ids if 0 <= i < vocab}),
                                  dtype=torch.long, device=device)
        self._drafted: dict[int, tuple[Tensor | None, Tensor]] = {}  # per draft vocabulary

    def add(self, tokens: Tensor) -> None:
        """Tokens that joined the answer (counted by shape: no host sync)."""
        self.count += tokens.numel()

    def last(self, logits: Tensor) -> Tensor:
        """The answer's next token's logits (..., V), the stop tokens masked while short."""
        if self.count >= self.minimum:
            return logits
        logits = logits.float().clone()
        logits[..., self.stops] = float("-inf")
        return logits

    def drafted(self, logits: Tensor, ids: Tensor | None) -> Tensor:
        """A drafter's fresh logits (..., Vd) (target ids `ids`, None: the whole
        vocabulary), the stop tokens masked in place while the answer is short."""
        if self.count >= self.minimum:
            return logits
        key = 0 if ids is None else id(ids)
        if key not in self._drafted:
            columns = self.stops if ids is None else \
                torch.isin(ids, self.stops.to(ids.device)).nonzero().view(-1)
            self._drafted[key] = (ids, columns)
        logits[..., self._drafted[key][1]] = float("-inf")
        return logits

    def rows(self, logits: Tensor, tokens: Tensor, sees: Tensor) -> Tensor:
        """A verify's K rows (K, V), row i's stop tokens masked where the token it
        predicts, `count` + its depth (`sees[i]` holds its ancestors and itself), falls
        short of the minimum."""
        if self.count >= self.minimum:
            return logits
        depth = sees.sum(1, keepdim=True) - 1  # (K, 1); the root's row: 0
        short = (depth + self.count) < self.minimum
        logits = logits.float().clone()
        logits[:, self.stops] = torch.where(short, float("-inf"), logits[:, self.stops])
        return logits


class Penalties:
    """A generation's penalties applied one after another (repetition first, as vLLM),
    with `RepetitionPenalty`'s interface, which the loop and the drafters call."""

    def __init__(self, *parts):
        self.parts = parts

    def add(self, tokens: Tensor) -> None:
        for part in self.parts:
            part.add(tokens)

    def last(self, logits: Tensor) -> Tensor:
        for part in self.parts:
            logits = part.last(logits)
        return logits

    def drafted(self, logits: Tensor, ids: Tensor | None) -> Tensor:
        for part in self.parts:
            logits = part.drafted(logits, ids)
        return logits

    def rows(self, logits: Tensor, tokens: Tensor, sees: Tensor) -> Tensor:
        for part in self.parts:
            logits = part.rows(logits, tokens, sees)
        return logits


def penalties(repetition: float, presence: float, frequency: float, vocab: int,
              prompt: Tensor, min_tokens: int = 0, stop_ids: frozenset[int] = frozenset(),
              bias: dict[int, float] | None = None,
              no_repeat_ngram: int = 0) -> Penalties | None:
    """The penalties a generation set (None: none), `prompt` its token ids on the device;
    `min_tokens` masks `stop_ids` (the ids that end it) until the answer is that long;
    `bias` adds to chosen tokens' logits, first; `no_repeat_ngram` (n) bans repeats of
    n-grams, after the repetition penalty as transformers orders them."""
    parts = []
    if bias:
        parts.append(LogitBias(bias, prompt.device))
    if min_tokens > 0 and stop_ids:
        parts.append(MinTokens(min_tokens, sorted(stop_ids), vocab, prompt.device))
    if repetition != 1.0:
        parts.append(RepetitionPenalty(repetition, vocab, prompt))
    if no_repeat_ngram:
        parts.append(NoRepeatNGram(no_repeat_ngram, prompt))
    if presence != 0.0 or frequency != 0.0:
        parts.append(AnswerPenalty(presence, frequency, vocab, prompt.device))
    return Penalties(*parts) if parts else None
