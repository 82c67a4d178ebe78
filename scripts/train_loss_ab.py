"""The fused soft cross-entropy (`gumiho.train.loss.soft_cross_entropy`) against the
released recipe's unfused form, as whole training steps: the same online batches' forward
and backward, one form then the other in alternating order, in one process (a shared
machine's noise falls on both alike). The weights do not move between steps.

    python scripts/train_loss_ab.py --precision bf16 --draft-vocab 32768 --pairs 6
    python scripts/train_loss_ab.py --device cuda --batch-size 32 --pairs 6   # a GPU
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere

import gumiho.train.loss as loss_module
from gumiho.config import TrainConfig
from gumiho.modeling import DraftHead
from gumiho.target import load_target
from gumiho.train.dataset import collate, epoch_batches, online_samples
from gumiho.train.loss import LossWeights
from gumiho.train.start import new_model
from gumiho.train.step import batch_loss


def unfused(logits, probs, index=None, rows=None):
    """The released recipe's form: float32 (M, D) intermediates, kept for the backward."""
    chosen = probs if index is None else probs[index]
    return -(chosen * torch.log_softmax(logits, -1, dtype=torch.float32)).sum(-1).mean()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--draft-vocab", type=int, default=32768)
    p.add_argument("--init", default="gumiho/assets/smollm2/gumiho")
    p.add_argument("--heads-only", action="store_true")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--pairs", type=int, default=6)
    args = p.parse_args()
    device = torch.device(args.device)

    config = TrainConfig(method="gumiho", online=True, num_conversations=8 * args.batch_size,
                         max_len=args.max_len, batch_size=args.batch_size, grad_accum=1,
                         draft_vocab=args.draft_vocab, init_from=args.init,
                         precision=args.precision, mlp_ploss_after_epochs=0,
                         heads_only=args.heads_only)
    torch.manual_seed(config.seed)
    target = load_target(config.target, device=str(device),
                         dtype="bfloat16" if args.precision == "bf16" else "float32")
    samples = online_samples(target, config.conversations, config.num_conversations,
                             config.max_len, progress=False)
    model = new_model(target, config, samples).to(device)
    head = DraftHead.for_model(target, model)
    weights = LossWeights(p=config.ploss_weight, mlp_p=config.mlp_ploss_weight,
                          mlp_p_from_epoch=0, heads_only=args.heads_only)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if args.precision == "bf16" \
        else nullcontext()
    batches = epoch_batches([s["input_ids"].shape[0] for s in samples], args.batch_size,
                            config.seed, 0)
    forms = {"fused": loss_module.soft_cross_entropy, "unfused": unfused}

    def step(index: int, form: str) -> tuple[float, float]:
        """Tokens/s of one forward and backward, and its loss."""
        loss_module.soft_cross_entropy = forms[form]
        batch = collate([samples[i] for i in batches[index]])
        start = time.perf_counter()
        with autocast:
            loss, _ = batch_loss(model, target, head, batch, "gumiho", 2, config.noise,
                                 log_acc=False, seed=index, weights=weights)
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        model.zero_grad(set_to_none=True)
        return int(batch["valid"].sum()) / seconds, float(loss.detach())

    for form in forms:
        step(0, form)  # warm-up
    rates: dict[str, list[float]] = {form: [] for form in forms}
    for k in range(args.pairs):
        index = 1 + k % (len(batches) - 1)
        losses = {}
        for form in list(forms)[:: 1 if k % 2 == 0 else -1]:
            rate, losses[form] = step(index, form)
            rates[form].append(rate)
        print(f"pair {k}: " + ", ".join(f"{f} {rates[f][-1]:.0f} tokens/s (loss "
                                        f"{losses[f]:.6f})" for f in forms), flush=True)
    fused, plain = (statistics.median(rates[f]) for f in forms)
    print(f"{device.type}, {args.precision}, batch {args.batch_size}, "
          f"draft vocabulary {args.draft_vocab}"
          f"{', heads only' if args.heads_only else ''}: median tokens/s fused {fused:.0f}, "
          f"unfused {plain:.0f}: {fused / plain:.2f}x")


if __name__ == "__main__":
    main()
