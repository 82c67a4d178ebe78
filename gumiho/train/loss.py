"""Training losses (SPEC §2, the released recipe) and per-position top-1 accuracy.

Per position: vloss = SmoothL1(out, f) and ploss = soft cross-entropy between
softmax(lm_head(f)) and log_softmax(lm_head(out)), both masked. Gumiho's MLP head i is
scored against f_{t+3+i} with weight 0.8^(i+1):
    total = 1.0 vloss + 0.1 ploss + (1/9) sum_i w_i vloss_i + p_mlp (1/9) sum_i w_i ploss_i
with p_mlp = 0 for the first 2 epochs, then 0.1. Medusa heads use cross-entropy on the
token x_{t+2+i}. Beyond the reference, `serial2` > 0 also scores Gumiho's serial step 2
(out2, run on step 1's own output as at inference) against f_{t+2}, with the step's own
vloss and ploss weights times `serial2`: the idea of training a drafter on its own
earlier outputs is EAGLE-3's "training-time test" (Li et al. 2025) and HASS's.

Both distributions live on the draft vocabulary (the `DraftHead`: the whole target
vocabulary, or the reduced one): the target's is its softmax restricted to the draft
tokens and renormalised. Accuracy compares the drafter's argmax (a target id) with the
target's argmax over its *whole* vocabulary, so a target token outside the draft
vocabulary counts as a miss. Every target-side quantity is computed once per batch
(`TargetDistributions`), not once per loss term.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from gumiho import softce
from gumiho.modeling.vocab import DraftHead

ARGMAX_CHUNK = 256  # rows of full-vocabulary logits at a time (bounds memory)


def top1(logits: Tensor) -> Tensor:
    """The argmax over the last dimension. `max` rather than `argmax`: on the CPU it is
    3-4x faster on vocabulary-wide rows (bf16 (256, 49152): 7 vs 24 ms on the dev
    machine), and accuracies are all it serves."""
    return logits.max(-1).indices


def top1_in_pieces(project, hidden: Tensor) -> Tensor:
    """top1(project(hidden)) (M,), ARGMAX_CHUNK rows of vocabulary-wide logits at a time."""
    if hidden.shape[0] == 0:
        return torch.zeros(0, dtype=torch.long, device=hidden.device)
    return torch.cat([top1(project(part)) for part in hidden.split(ARGMAX_CHUNK)])


@dataclass(frozen=True)
class LossWeights:
    v: float = 1.0
    p: float = 0.1
    mlp_v: float = 1 / 9
    mlp_p: float = 0.1 / 9  # applied from epoch `mlp_p_from_epoch`
    mlp_decay: float = 0.8
    mlp_p_from_epoch: int = 2
    serial2: float = 0.0  # serial step 2's losses (not in the reference: logged only)
    heads_only: bool = False  # the MLP heads' losses alone (`--heads-only`)


REFERENCE_WEIGHTS = LossWeights()


class TargetDistributions:
    """The target's draft-vocabulary distribution (and, for accuracy, its full-vocabulary
    argmax) at every scored position of a batch, computed once.

    features (B, L, H) are the target's post-norm features, scored (B, L) bool the positions
    some loss term is scored against (assistant tokens). `row[b, t]` is the position's row
    in `probs` (M, D) and `argmax` (M,), or -1.
    """

    def __init__(self, features: Tensor, scored: Tensor, head: DraftHead,
                 lm_head=None):
        b, length = scored.shape
        self.row = torch.full((b, length), -1, dtype=torch.long, device=scored.device)
        m = int(scored.sum())
        self.row[scored] = torch.arange(m, device=scored.device)
        chosen = features[scored]  # (M, H)
        with torch.no_grad():
            self.probs = torch.softmax(head(chosen), -1, dtype=torch.float32)  # (M, D)
            self.argmax = None
            if lm_head is not None:
                dtype = lm_head.weight.dtype  # a bf16 target outside autocast
                self.argmax = top1_in_pieces(lambda part: lm_head(part.to(dtype)), chosen)


def soft_rows(vocab: int, device: torch.device) -> int:
    """Rows of vocabulary-wide logits `soft_cross_entropy` takes at a time in torch's
    operators: on a CPU (where softce.c does not run) about 1 MB of float32 per piece, so
    each piece's intermediates stay in the core's cache (the unfused loss streamed five
    (M, D) float32 tensors through memory: most of a CPU training step's time); on a GPU,
    pieces of up to 512 MiB, to bound memory only."""
    budget = 2 ** 18 if device.type == "cpu" else 2 ** 27
    return max(1, budget // max(vocab, 1))


class _SoftCrossEntropy(torch.autograd.Function):
    """mean_m -sum_v p[m, v] log_softmax(z[m])[v], a piece of rows at a time (on a CPU a
    row at a time in C, softce.c). The gradient, dL/dz = (softmax(z) sum_v p - p) / M, is
    made in the same pass as the value (one exp per logit) and kept in the logits' dtype;
    the backward scales it in place and hands it on (no second (M, D) tensor: on a CPU a
    fresh one costs its pages' zeroing), so it can run once (as without retain_graph)."""

    @staticmethod
    def forward(ctx, logits: Tensor, probs: Tensor, index: Tensor | None, rows: int):
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device) \
            if ctx.needs_input_grad[0] else None
        total = _loss_and_grad(logits, probs, index, rows, grad)
        ctx.grad = grad  # an intermediate, not an input or output: kept on ctx itself
        ctx.rows_total = max(logits.shape[0], 1)
        return total / ctx.rows_total

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        grad, ctx.grad = ctx.grad, None
        if grad is None:
            raise RuntimeError("soft_cross_entropy: backward a second time (its gradient "
                               "was handed on the first time; retain_graph does not keep it)")
        # a float32 0-dim factor: a bf16 gradient is scaled in float32, then rounded once
        return grad.mul_(grad_output.float() / ctx.rows_total), None, None, None


def _loss_and_grad(logits: Tensor, probs: Tensor, index: Tensor | None, rows: int,
                   grad: Tensor | None) -> Tensor:
    """sum_m -sum_v p log_softmax(z) (0-dim float32), writing its gradient into `grad`
    when given: on a CPU one C pass a row (softce.c), else torch's operators `rows` rows at
    a time, in float32 whatever autocast says."""
    if softce.takes(logits, probs, index):
        return softce.loss_and_grad(logits, probs, index, grad).sum()
    with torch.autocast(logits.device.type, enabled=False):
        return _pieces(logits, probs, index, rows, grad)


def _pieces(logits: Tensor, probs: Tensor, index: Tensor | None, rows: int,
            grad: Tensor | None) -> Tensor:
    """sum_m -sum_v p log_softmax(z) (0-dim float32), a piece at a time, writing each
    piece's softmax(z) sum_v p - p into `grad` (M, D) when given."""
    total = torch.zeros((), dtype=torch.float32, device=logits.device)
    for start in range(0, logits.shape[0], rows):
        z = logits[start : start + rows].to(torch.float32, copy=True)
        p = _probs(probs, index, start, z.shape[0])
        weight = p.sum(-1, keepdim=True)
        top = z.amax(-1, keepdim=True)
        total -= torch.dot(p.reshape(-1), z.view(-1))  # sum p z, no (rows, D) product
        exp = z.sub_(top).exp_()  # z no longer needed: exp(z - max) in its place
        norm = exp.sum(-1, keepdim=True)
        total += ((top + norm.log()) * weight).sum()  # log-sum-exp, weighted
        if grad is not None:
            grad[start : start + rows] = exp.mul_(weight / norm).sub_(p)
    return total


def _probs(probs: Tensor, index: Tensor | None, start: int, count: int) -> Tensor:
    """Rows start..start+count of `probs[index]` (of `probs` itself for no index)."""
    if index is None:
        return probs[start : start + count]
    return probs.index_select(0, index[start : start + count])


def soft_cross_entropy(logits: Tensor, probs: Tensor, index: Tensor | None = None,
                       rows: int | None = None) -> Tensor:
    """The soft cross-entropy -sum_v p_v log_softmax(z)_v, averaged over rows: logits z
    (M, D) in any float dtype (bf16 under autocast), probs (N, D) float32 with row
    `index[m]` belonging to logits row m (row m itself for no index). Equal to
    `-(probs[index] * torch.log_softmax(logits, -1, dtype=torch.float32)).sum(-1).mean()`
    to float32 rounding, in value and gradient (this within two roundings to the logits' dtype),
    without that form's (M, D) float32 intermediates: on a CPU a row at a time in C
    (softce.c, where it builds), else in pieces of `rows` rows (default `soft_rows`)."""
    if rows is None:
        rows = soft_rows(logits.shape[-1], logits.device)
    return _SoftCrossEntropy.apply(logits, probs, index, rows)


class _HeadSoftCrossEntropy(torch.autograd.Function):
    """soft_cross_entropy(head(hidden), ...) with the head's (frozen) product inside: a
    piece of rows at a time it makes the piece's logits, their loss and gradient, and the
    gradient's product with the head's weight, so what the backward keeps is dL/dhidden
    (M, H), not a (M, D) gradient a loss term (on a GPU at a full vocabulary, gigabytes
    each). The idea of never holding a vocabulary-wide tensor for all rows at once is the
    "cut cross-entropy" of Wijmans et al. (2024) and Liger-Kernel's fused linear
    cross-entropy; here the head is frozen, so no weight gradient is made."""

    @staticmethod
    def forward(ctx, hidden: Tensor, head: DraftHead, probs: Tensor, index: Tensor | None,
                rows: int, want_top1: bool):
        m, vocab = hidden.shape[0], head.size
        needs = ctx.needs_input_grad[0]
        grad_hidden = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) \
            if needs else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        tops, grad, weight = [], None, None
        for start in range(0, m, rows):
            part = hidden[start : start + rows]
            with torch.no_grad():
                logits = head.logits(part, packed=False)  # as the unfused form's product
            if want_top1:
                tops.append(top1(logits))
            if needs and grad is None:  # one buffer for every piece (the last a view of it)
                grad = torch.empty((min(rows, m), vocab), dtype=logits.dtype,
                                   device=logits.device)
            piece = grad[: part.shape[0]] if needs else None
            p_rows, p_index = (probs[start : start + rows], None) if index is None else \
                (probs, index[start : start + rows])
            total += _loss_and_grad(logits, p_rows, p_index, soft_rows(vocab, logits.device),
                                    piece)
            if not needs:
                continue
            if not head.form.identity:  # through the scale and softcap: dz/dx
                piece.copy_(piece.float() * head.form.slope(logits.float()))
            if weight is None:
                weight = head.weight.to(piece.dtype)
            grad_hidden[start : start + rows] = piece @ weight
        ctx.grad = grad_hidden
        ctx.rows_total = max(m, 1)
        top = torch.cat(tops) if tops else torch.zeros(0, dtype=torch.long,
                                                       device=hidden.device)
        ctx.mark_non_differentiable(top)
        return total / ctx.rows_total, top

    @staticmethod
    def backward(ctx, grad_output: Tensor, _grad_top: Tensor | None):
        grad, ctx.grad = ctx.grad, None
        if grad is None:
            raise RuntimeError("head_soft_cross_entropy: backward a second time (its "
                               "gradient was handed on the first time)")
        return grad.mul_(grad_output.float() / ctx.rows_total), None, None, None, None, None


def head_rows(vocab: int) -> int:
    """Rows of logits `head_soft_cross_entropy` makes at a time: up to 2^27 values (the
    bound `soft_rows` keeps on a GPU), so a CPU batch's term is one piece: each piece reads
    the head's weight again, and a CPU's bf16 products slow down at a few hundred rows (128
    x 576 by 32,768 took 24 ms, 512 57 ms, 1,500 136 ms on a 2-core AMX Xeon; whole steps
    over 32,768 ran 0.94x as fast in pieces of 1,024 rows, the loss alone over 49,152 on
    1,500 rows 0.82x in two pieces)."""
    return max(1, 2 ** 27 // max(vocab, 1))


def head_soft_cross_entropy(hidden: Tensor, head: DraftHead, probs: Tensor,
                            index: Tensor | None = None, rows: int | None = None,
                            want_top1: bool = False) -> tuple[Tensor, Tensor | None]:
    """(soft_cross_entropy(head(hidden), probs, index), its logits' argmax or None) for
    hidden (M, H), in value and gradient as that form (to float rounding), without its (M,
    D) logits or gradient: at most `rows` rows at a time (default `head_rows`), the pieces
    as even as they can be."""
    if rows is None:
        rows = head_rows(head.size)
    pieces = -(-hidden.shape[0] // max(rows, 1))  # as many as needed, as even as can be
    rows = -(-hidden.shape[0] // max(pieces, 1)) if pieces else rows
    loss, top = _HeadSoftCrossEntropy.apply(hidden, head, probs, index, rows, want_top1)
    return loss, (top if want_top1 else None)


def feature_losses(out: Tensor, features: Tensor, shift: int, targets: TargetDistributions,
                   head: DraftHead, need_p: bool, need_acc: bool, p_fraction: float = 1.0,
                   generator: torch.Generator | None = None) -> dict[str, Tensor | None]:
    """out (B, T, H): the drafter's estimate of f_{t+shift} at row t. vloss on every scored
    position; ploss and top-1 accuracy on a `p_fraction` sample of them, only when asked
    (the vocabulary projection is most of the training cost)."""
    rows = targets.row[:, shift : shift + out.shape[1]]  # (B, T)
    kept = rows >= 0
    estimate = out[:, : rows.shape[1]][kept]  # (M', H)
    truth = features[:, shift : shift + rows.shape[1]][kept].to(estimate.dtype)
    rows = rows[kept]
    zero = estimate.sum() * 0
    result: dict[str, Tensor | None] = {"v": zero, "p": zero, "acc": None}
    if estimate.shape[0] == 0:
        return result
    result["v"] = F.smooth_l1_loss(estimate.float(), truth.float(), reduction="none"
                                   ).mean(-1).mean()
    if not (need_p or need_acc):
        return result
    if p_fraction < 1.0:
        draws = torch.rand(estimate.shape[0], generator=generator, device="cpu")
        keep = (draws < p_fraction).to(estimate.device)
        keep[0] = True
        estimate, rows = estimate[keep], rows[keep]
    want_acc = need_acc and targets.argmax is not None
    top = None
    if need_p:  # the head's product inside the loss: no (M', D) tensor is kept
        whole = rows.shape[0] == targets.probs.shape[0]  # every row, in order
        result["p"], top = head_soft_cross_entropy(estimate, head, targets.probs,
                                                   None if whole else rows,
                                                   want_top1=want_acc)
    elif want_acc:
        with torch.no_grad():
            top = top1_in_pieces(head, estimate)
    if want_acc:
        hit = head.to_target(top) == targets.argmax[rows]
        result["acc"] = hit.float().mean().detach()
    return result


def term_generators(generator: torch.Generator | None, p_fraction: float):
    """shift -> the generator of the ploss sample of the term that scores f_{t+shift}, each
    seeded from one draw of the batch's `generator`: a term's sample does not depend on
    which other terms ran (terms that are only logged run on logging steps alone), so
    `--log-every` leaves the trained weights as they are."""
    if p_fraction >= 1.0:
        return lambda shift: generator  # (no sample is drawn)
    base = int(torch.randint(2**62, (1,), generator=generator, device="cpu"))
    return lambda shift: torch.Generator().manual_seed((base + 7919 * shift) % 2**62)


def serial_loss(outputs: dict, features: Tensor, loss_mask: Tensor, head: DraftHead,
                epoch: int, lm_head=None, weights: LossWeights = REFERENCE_WEIGHTS,
                p_fraction: float = 1.0, generator: torch.Generator | None = None
                ) -> tuple[Tensor, dict[str, float]]:
    """Total loss and logs for Gumiho / EAGLE-2 outputs of DraftModel.forward.
    lm_head: the target's full head, given when accuracies are to be logged."""
    targets = TargetDistributions(features, loss_mask.bool(), head, lm_head)
    log_acc = lm_head is not None
    sample = term_generators(generator, p_fraction)
    first = feature_losses(outputs["out1"], features, 1, targets, head,
                           not weights.heads_only, log_acc, p_fraction, sample(1))
    # heads only: the serial step's losses are logged (vloss; ploss reads 0), not trained
    total = first["v"] * 0 if weights.heads_only else \
        weights.v * first["v"] + weights.p * first["p"]
    logs = {"vloss": float(first["v"].detach()), "ploss": float(first["p"].detach())}
    accs = {"acc_serial1": first["acc"]}
    if "out2" in outputs and weights.serial2 > 0:
        second = feature_losses(outputs["out2"], features, 2, targets, head, True, log_acc,
                                p_fraction, sample(2))
        total = total + weights.serial2 * (weights.v * second["v"] + weights.p * second["p"])
        logs.update(vloss2=float(second["v"].detach()), ploss2=float(second["p"].detach()))
        accs["acc_serial2"] = second["acc"]
    elif "out2" in outputs and log_acc:  # step 2 is not in the reference loss; logged only
        accs["acc_serial2"] = feature_losses(outputs["out2"].detach(), features, 2, targets,
                                             head, False, True, p_fraction, sample(2))["acc"]
    if "mlp" in outputs:
        mlp = outputs["mlp"]  # (B, T, N, H), head i at row t targets f_{t+3+i}
        p_weight = weights.mlp_p if epoch >= weights.mlp_p_from_epoch else 0.0
        for i in range(mlp.shape[2]):
            part = feature_losses(mlp[:, :, i], features, 3 + i, targets, head, p_weight > 0,
                                  log_acc, p_fraction, sample(3 + i))
            w = weights.mlp_decay ** (i + 1)
            total = total + weights.mlp_v * w * part["v"] + p_weight * w * part["p"]
            accs[f"acc_mlp{i + 1}"] = part["acc"]
    logs.update({k: float(v) for k, v in accs.items() if v is not None})
    return total, logs


def medusa_loss(hidden: Tensor, input_ids: Tensor, loss_mask: Tensor, heads,
                head: DraftHead, p_fraction: float = 1.0,
                generator: torch.Generator | None = None) -> tuple[Tensor, dict[str, float]]:
    """hidden (B, L, N, H): head i at position t predicts x_{t+2+i} (cross-entropy over the
    draft vocabulary, on a `p_fraction` sample of positions; a token outside the draft
    vocabulary is a miss and adds no loss)."""
    total, logs = hidden.sum() * 0, {}
    for i in range(hidden.shape[2]):
        t = input_ids.shape[1] - 2 - i
        if t <= 0:
            break
        mask = loss_mask[:, 2 + i : 2 + i + t].bool()
        if p_fraction < 1.0:
            draws = torch.rand(mask.shape, generator=generator, device="cpu")
            mask = mask & (draws < p_fraction).to(mask.device)
        h = hidden[:, :t, i][mask]
        if h.shape[0] == 0:
            continue
        own = heads.lm_heads
        logits = (h @ own[i].T if own is not None else head(h)).float()  # (M, D)
        labels = input_ids[:, 2 + i : 2 + i + t][mask].long()
        draft_labels, inside = head.to_draft(labels)
        if bool(inside.any()):
            total = total + F.cross_entropy(logits[inside], draft_labels[inside]) * (0.8 ** i)
        logs[f"acc_medusa{i + 1}"] = float((head.to_target(top1(logits)) == labels)
                                           .float().mean())
    logs["loss"] = float(total.detach())
    return total, logs
