"""The repetition penalty over a draft tree (Keskar et al. 2019, "CTRL"; transformers'
`generate(repetition_penalty=...)`, vLLM's `repetition_penalty`).

Plain decoding divides the logit of every token already in the sequence (the prompt and
what was generated) by the penalty where the logit is positive and multiplies it where it
is negative, before the temperature and any cut (transformers'
RepetitionPenaltyLogitsProcessor, in float32). In a tree each node has a sequence of its
own: the committed tokens, then the nodes its row of the verify mask sees (its ancestors
and itself; what the target conditions that row on). So each row is penalised over its own
sequence, and a node's pick is what plain decoding would pick after that sequence: the
loop stays lossless, greedy output equal to plain decoding's with the same penalty, and
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
