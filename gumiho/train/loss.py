"""Training losses (SPEC §2, the released recipe) and per-position top-1 accuracy.

Per position: vloss = SmoothL1(out, f) and ploss = soft cross-entropy between
softmax(lm_head(f)) and log_softmax(lm_head(out)), both masked. Gumiho's MLP head i is
scored against f_{t+3+i} with weight 0.8^(i+1):
    total = 1.0 vloss + 0.1 ploss + (1/9) sum_i w_i vloss_i + p_mlp (1/9) sum_i w_i ploss_i
with p_mlp = 0 for the first 2 epochs, then 0.1. Medusa heads use cross-entropy on the
token x_{t+2+i}. Logits are computed only at positions the mask keeps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class LossWeights:
    v: float = 1.0
    p: float = 0.1
    mlp_v: float = 1 / 9
    mlp_p: float = 0.1 / 9  # applied from epoch `mlp_p_from_epoch`
    mlp_decay: float = 0.8
    mlp_p_from_epoch: int = 2


def feature_losses(out: Tensor, target: Tensor, mask: Tensor, lm_head, need_p: bool,
                   need_acc: bool, p_fraction: float = 1.0,
                   generator: torch.Generator | None = None) -> dict[str, Tensor]:
    """out, target (B, T, H) and mask (B, T) bool -> vloss on every kept position; ploss
    and top-1 accuracy (drafter argmax vs target argmax) on a `p_fraction` sample of them,
    only when asked: the vocabulary projection is most of the training cost."""
    out, target = out[mask], target[mask].to(out.dtype)  # (M, H)
    zero = out.sum() * 0
    result = {"v": zero, "p": zero, "acc": None}
    if out.shape[0] == 0:
        return result
    result["v"] = F.smooth_l1_loss(out.float(), target.float(), reduction="none").mean(-1).mean()
    if not (need_p or need_acc):
        return result
    if p_fraction < 1.0:
        keep = (torch.rand(out.shape[0], generator=generator) < p_fraction).to(out.device)
        keep[0] = True
        out, target = out[keep], target[keep]
    with torch.no_grad():
        want = torch.softmax(lm_head(target).float(), -1)
    logp = torch.log_softmax(lm_head(out if need_p else out.detach()).float(), -1)
    if need_p:
        result["p"] = -(want * logp).sum(-1).mean()
    result["acc"] = (logp.argmax(-1) == want.argmax(-1)).float().mean().detach()
    return result


def shifted_mask(loss_mask: Tensor, shift: int, length: int) -> Tensor:
    """Mask (B, length) of positions t whose target sits at t + shift."""
    return loss_mask[:, shift : shift + length].bool()


def serial_loss(outputs: dict, features: Tensor, loss_mask: Tensor, lm_head, epoch: int,
                weights: LossWeights = LossWeights(), log_acc: bool = True,
                p_fraction: float = 1.0, generator: torch.Generator | None = None
                ) -> tuple[Tensor, dict[str, float]]:
    """Total loss and logs for Gumiho / EAGLE-2 outputs of DraftModel.forward."""
    out1 = outputs["out1"]
    n = out1.shape[1]
    first = feature_losses(out1, features[:, 1 : 1 + n], shifted_mask(loss_mask, 1, n),
                           lm_head, True, log_acc, p_fraction, generator)
    total = weights.v * first["v"] + weights.p * first["p"]
    logs = {"vloss": float(first["v"].detach()), "ploss": float(first["p"].detach())}
    accs = {"acc_serial1": first["acc"]}
    if "out2" in outputs and log_acc:
        out2 = outputs["out2"].detach()  # step 2 is not in the reference loss; logged only
        second = feature_losses(out2, features[:, 2 : 2 + out2.shape[1]],
                                shifted_mask(loss_mask, 2, out2.shape[1]), lm_head, False,
                                True, p_fraction, generator)
        accs["acc_serial2"] = second["acc"]
    if "mlp" in outputs:
        mlp = outputs["mlp"]  # (B, T, N, H), head i at row t targets f_{t+3+i}
        p_weight = weights.mlp_p if epoch >= weights.mlp_p_from_epoch else 0.0
        for i in range(mlp.shape[2]):
            t = min(mlp.shape[1], features.shape[1] - 3 - i)
            head = feature_losses(mlp[:, :t, i], features[:, 3 + i : 3 + i + t],
                                  shifted_mask(loss_mask, 3 + i, t), lm_head, p_weight > 0,
                                  log_acc, p_fraction, generator)
            w = weights.mlp_decay ** (i + 1)
            total = total + weights.mlp_v * w * head["v"] + p_weight * w * head["p"]
            accs[f"acc_mlp{i + 1}"] = head["acc"]
    logs.update({k: float(v) for k, v in accs.items() if v is not None})
    return total, logs


def medusa_loss(hidden: Tensor, input_ids: Tensor, loss_mask: Tensor, heads, lm_head,
                p_fraction: float = 1.0, generator: torch.Generator | None = None
                ) -> tuple[Tensor, dict[str, float]]:
    """hidden (B, L, N, H): head i at position t predicts x_{t+2+i} (cross-entropy, on a
    `p_fraction` sample of positions)."""
    total, logs = hidden.new_zeros(()), {}
    for i in range(hidden.shape[2]):
        t = input_ids.shape[1] - 2 - i
        if t <= 0:
            break
        mask = shifted_mask(loss_mask, 2 + i, t)
        if p_fraction < 1.0:
            mask = mask & (torch.rand(mask.shape, generator=generator) < p_fraction).to(
                mask.device)
        h = hidden[:, :t, i][mask]
        if h.shape[0] == 0:
            continue
        logits = h @ heads.lm_heads[i].T if heads.lm_heads is not None else lm_head(h)
        labels = input_ids[:, 2 + i : 2 + i + t][mask].long()
        total = total + F.cross_entropy(logits.float(), labels) * (0.8 ** i)
        logs[f"acc_medusa{i + 1}"] = float((logits.argmax(-1) == labels).float().mean())
    logs["loss"] = float(total)
    return total, logs
