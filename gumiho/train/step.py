"""One batch through a drafter in training: the target's features (stored or computed),
the input noise, the forward pass and the losses (loss.py); and the held-out evaluation
built on it (top-1 per draft position). Shared by the trainer, `gumiho.train.accuracy`
and the profiling scripts.
"""

from __future__ import annotations

import torch

from gumiho.config import TrainConfig
from gumiho.methods import method_spec
from gumiho.modeling import DraftHead
from gumiho.train.dataset import add_noise, collate
from gumiho.train.loss import REFERENCE_WEIGHTS, LossWeights, medusa_loss, serial_loss


def noise_device(config: TrainConfig, device: torch.device) -> str:
    """Where the input noise is drawn: `--noise-on`, by default the training device's own
    generator on a GPU (the host's draw and copy are host work each step, which the GPU
    waits for once its queued work is done) and the CPU's on a CPU (where the two are the
    same draw). Runs saved before the flag drew on the CPU; on a CPU they resume unchanged."""
    return config.noise_on or ("cpu" if device.type == "cpu" else "device")


def batch_loss(model, target, head: DraftHead, batch: dict, method: str, epoch: int,
               noise: float, log_acc: bool = True, p_fraction: float = 1.0, seed: int = 0,
               weights: LossWeights = REFERENCE_WEIGHTS, noise_on: str = "cpu",
               mlp_detach: bool = False):
    """Forward one batch; returns (loss, logs). `seed` fixes this batch's noise and ploss
    sample, so a resumed (or differently parallelised) run repeats the same computation.
    mlp_detach: Gumiho's MLP heads read the serial outputs without sending them gradient.
    A batch from `collate` (host tensors) moves to the drafter's device here. noise_on:
    "cpu" draws the input noise on the host (the same on every device), "device" on the
    drafter's device from its own generator of the same seed (`noise_device`)."""
    generator = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    valid = batch["valid"]
    features = batch.get("hidden_state")
    if features is None:
        features = target.features(batch["input_ids"], valid.long())
    features = features.float()
    if not method_spec(method).serial:  # Medusa heads read the clean target features
        return medusa_loss(model(features), batch["input_ids"], batch["loss_mask"], model,
                           head, p_fraction, generator)
    if model.training:
        draw = generator if noise_on == "cpu" else \
            torch.Generator(device=device).manual_seed(seed)
        noised = add_noise(features, valid, noise, draw)
    else:
        noised = features
    outputs = model(batch["input_ids"], noised, valid, detach_heads=mlp_detach)
    return serial_loss(outputs, features, batch["loss_mask"], head, epoch,
                       lm_head=target.lm_head if log_acc else None, weights=weights,
                       p_fraction=p_fraction, generator=generator)


@torch.no_grad()
def batch_accuracies(model, target, head, samples, method, epoch, batch_size
                     ) -> list[dict[str, float]]:
    """Top-1 accuracy per draft position of each batch of `batch_size` held-out samples, in
    order (token-weighted within a batch)."""
    was_training = model.training
    model.eval()
    found = []
    for i in range(0, len(samples), batch_size):
        batch = collate(samples[i : i + batch_size])
        _, logs = batch_loss(model, target, head, batch, method, epoch, 0.0)
        found.append({k: v for k, v in logs.items() if k.startswith("acc")})
    model.train(was_training)
    return found


def evaluate(model, target, head, samples, method, epoch, batch_size) -> dict[str, float]:
    """Mean top-1 accuracy per draft position (token-weighted per batch) on held-out data,
    each position's over the batches that score it (a batch of short samples may hold no
    position for a later head: it logs no accuracy there, which is not an accuracy of 0)."""
    found = batch_accuracies(model, target, head, samples, method, epoch, batch_size)
    return {k: sum(b[k] for b in found if k in b) / sum(k in b for b in found)
            for k in dict.fromkeys(k for b in found for k in b)}
