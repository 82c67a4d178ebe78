"""The draft vocabulary: the drafter scores only the target tokens it is likely to need.

Drafting logits are the target's frozen lm_head applied to the drafter's hidden states; over
a 49k-262k-token vocabulary that projection is most of the drafting time (FR-Spec measured
49-62% of EAGLE-2's). A reduced draft vocabulary, the most frequent tokens of the training
data, makes it several times cheaper at a small cost in acceptance: a target token outside
it can never be drafted. Verification is untouched, so output stays exactly the target's.

Stored in the EAGLE-3 convention that vLLM and SGLang read: a drafter with a reduced
vocabulary of D tokens carries buffers `d2t` (D,) int64, with target_id = draft_id +
d2t[draft_id] (draft ids in increasing target-id order), and `t2d` (V,) bool, true where a
target token is in the draft vocabulary; its config says `draft_vocab_size`.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor, nn

from gumiho import rowgemm
from gumiho.linear import LogitForm, available_memory, pack_weight, vocab_linear


def draft_vocabulary(counts: Tensor, size: int, always: list[int] | tuple[int, ...] = ()
                     ) -> Tensor:
    """The draft vocabulary (size,) of target ids, increasing: the `always` ids (e.g. stop
    tokens) and then the most frequent by `counts` (V,); ties go to the lower id."""
    vocab = counts.shape[0]
    need = len(set(always))
    if not max(1, need) <= size <= vocab:
        raise ValueError(f"draft vocabulary size must be in {max(1, need)}..{vocab} (it "
                         f"always holds the {need} stop tokens), got {size}")
    score = counts.double().clone()
    score[list(always)] = float("inf")
    # stable sort on -score keeps lower ids first among equal counts
    order = torch.sort(-score, stable=True).indices
    return order[:size].sort().values


def vocab_buffers(draft_ids: Tensor, vocab_size: int) -> tuple[Tensor, Tensor]:
    """(d2t, t2d) of the EAGLE-3 convention for draft_ids (D,) in increasing order."""
    d2t = draft_ids.long() - torch.arange(draft_ids.shape[0], device=draft_ids.device)
    t2d = torch.zeros(vocab_size, dtype=torch.bool, device=draft_ids.device)
    t2d[draft_ids] = True
    return d2t, t2d


def add_vocab_buffers(module: nn.Module, vocab_size: int, draft_vocab_size: int) -> None:
    """Register the (zero) d2t/t2d buffers of a reduced vocabulary; none for the full one."""
    if draft_vocab_size and draft_vocab_size < vocab_size:
        module.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
        module.register_buffer("t2d", torch.zeros(vocab_size, dtype=torch.bool))
    else:
        module.d2t = module.t2d = None


def set_draft_vocabulary(module: nn.Module, draft_ids: Tensor) -> None:
    d2t, t2d = vocab_buffers(draft_ids, module.t2d.shape[0])
    module.d2t.copy_(d2t)
    module.t2d.copy_(t2d)


def draft_size(module: nn.Module, at_most: int) -> int:
    """min(the drafter's draft vocabulary size, at_most): how many candidates a node can
    take from it (the reduced vocabulary's size, else the target's whole vocabulary, which
    a toy target's may be smaller than a tree's widths)."""
    d2t = getattr(module, "d2t", None)
    if d2t is not None:
        return min(d2t.shape[0], at_most)
    vocab = getattr(getattr(module, "config", None), "vocab_size", None)
    return at_most if not vocab else min(vocab, at_most)


def draft_ids_of(module: nn.Module) -> Tensor | None:
    """The target ids of a drafter's draft vocabulary (D,), or None for the full vocabulary."""
    d2t = getattr(module, "d2t", None)
    if d2t is None:
        return None
    return torch.arange(d2t.shape[0], device=d2t.device) + d2t


class DraftHead:
    """The target's lm_head restricted to the draft vocabulary (frozen, never saved).

    `head(hidden (..., H)) -> logits (..., D)` over the draft vocabulary;
    `to_target(indices)` maps draft ids to target ids, `to_draft` the reverse. With the full
    vocabulary it is the target's lm_head itself (no copy) and ids map to themselves.
    A head made for drafting (`drafting=True`: a generation's drafter, not training nor
    the accuracy probes) over a float32 weight on a CPU keeps a 16-bit copy beside it and
    computes its logits from that (`rowgemm.drafting_copy`): a drafting pass reads its
    head once or twice a cycle, and half the bytes cut ~0.4 ms of each on a 2-core CPU.
    """

    def __init__(self, lm_head: nn.Module, draft_ids: Tensor | None = None,
                 form: LogitForm | None = None, drafting: bool = False):
        weight = lm_head.weight.detach()
        bias = getattr(lm_head, "bias", None)
        self.ids = self.lookup = None
        if draft_ids is not None:
            ids = draft_ids.to(weight.device).long()
            weight = weight[ids]
            bias = None if bias is None else bias.detach()[ids]
            self.ids = ids
            self.lookup = torch.full((lm_head.weight.shape[0],), -1, dtype=torch.long,
                                     device=ids.device)  # target id -> draft id, -1 outside
            self.lookup[ids] = torch.arange(ids.shape[0], device=ids.device)
        self.weight, self.bias = weight, None if bias is None else bias.detach()
        self.form = form or LogitForm()  # the target's logit scale and softcap, if any
        self.packed = pack_weight(weight)  # bf16 on the CPU (linear.py), else None
        # a drafter's float32 head on a CPU: its logits from a 16-bit copy (half the bytes
        # of a product that reading the weight bounds; proposals, which the target checks),
        # made while it takes at most half the memory available (a full 262k vocabulary's
        # copy is ~0.3 GB; $GUMIHO_DRAFT_HEAD16=0: never)
        self.short = None
        if drafting and self.packed is None and os.environ.get("GUMIHO_DRAFT_HEAD16", "1") != "0":
            room = available_memory()
            if room is None or weight.numel() * 2 <= room // 2:
                self.short = rowgemm.drafting_copy(weight, self.bias)

    @property
    def size(self) -> int:
        return self.weight.shape[0]

    def __call__(self, hidden: Tensor) -> Tensor:
        return self.logits(hidden)

    def logits(self, hidden: Tensor, packed: bool = True) -> Tensor:
        """The logits over the draft vocabulary; `packed=False` computes them as a product
        a gradient flows through does (not from the packed bf16 copy, nor from a drafting
        head's 16-bit one)."""
        if packed and self.short is not None and self.short.takes(hidden):
            return self.form(self.short(hidden))
        return self.form(vocab_linear(hidden.to(self.weight.dtype), self.weight, self.bias,
                                      self.packed if packed else None))

    def to_target(self, indices: Tensor) -> Tensor:
        return indices if self.ids is None else self.ids[indices]

    def to_draft(self, target_ids: Tensor) -> tuple[Tensor, Tensor]:
        """(draft ids, in-vocabulary mask) of target ids; ids outside map to 0."""
        if self.lookup is None:
            return target_ids, torch.ones_like(target_ids, dtype=torch.bool)
        mapped = self.lookup[target_ids]
        return mapped.clamp(min=0), mapped >= 0

    @classmethod
    def for_model(cls, target, module: nn.Module, drafting: bool = False) -> DraftHead:
        """The head of drafter network `module` (its d2t buffer, if any) on `target`;
        `drafting`: for a generation's proposals (a float32 CPU head computes from 16 bits)."""
        return cls(target.lm_head, draft_ids_of(module), target.logit_form, drafting)
