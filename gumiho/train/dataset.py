"""Training batches: stored features (from `gumiho.ge_data`) or computed online."""

from __future__ import annotations

import torch
from torch import Tensor

from gumiho.ge_data.conversations import load_conversations, split
from gumiho.ge_data.templates import tokenize_conversation


def online_samples(target, source: str, count: int, max_len: int,
                   template: str | None = None) -> list[dict]:
    """Tokenised conversations without features; the loop adds them with the target."""
    train, _ = split(load_conversations(source))
    out = []
    for conv in train[:count]:
        ids, mask = tokenize_conversation(target.tokenizer, conv["messages"], max_len,
                                          target.stop_token_ids, template)
        if int(mask.sum()):
            out.append({"input_ids": ids.to(torch.int32), "loss_mask": mask.to(torch.uint8)})
    return out


def collate(samples: list[dict]) -> dict[str, Tensor]:
    """Right-pad to the longest sample: input_ids (B, L), loss_mask (B, L), valid (B, L),
    and hidden_state (B, L, H) when stored."""
    length = max(s["input_ids"].shape[0] for s in samples)
    batch = len(samples)
    ids = torch.zeros(batch, length, dtype=torch.long)
    mask = torch.zeros(batch, length, dtype=torch.long)
    valid = torch.zeros(batch, length, dtype=torch.bool)
    hidden = None
    if "hidden_state" in samples[0]:
        h = samples[0]["hidden_state"].shape[-1]
        hidden = torch.zeros(batch, length, h, dtype=samples[0]["hidden_state"].dtype)
    for i, s in enumerate(samples):
        n = s["input_ids"].shape[0]
        ids[i, :n] = s["input_ids"].long()
        mask[i, :n] = s["loss_mask"].long()
        valid[i, :n] = True
        if hidden is not None:
            hidden[i, :n] = s["hidden_state"]
    out = {"input_ids": ids, "loss_mask": mask, "valid": valid}
    if hidden is not None:
        out["hidden_state"] = hidden
    return out


def add_noise(features: Tensor, valid: Tensor, scale: float,
              generator: torch.Generator | None = None) -> Tensor:
    """The released recipe's input noise: (U - 0.5) * scale * 512 / L on real positions.
    generator: a CPU generator (drawn on the CPU so runs repeat across devices)."""
    length = features.shape[1]
    noise = torch.rand(features.shape, generator=generator).to(features.device) - 0.5
    return features + noise.to(features.dtype) * scale * 512 / length * valid[..., None]
