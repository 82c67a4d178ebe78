"""Train a drafter: `accelerate launch -m gumiho.train --target T --data DIR --method M ...`
(or `python -m gumiho.train` on one device; `bash scripts/train.sh` wraps it).

Seeded; logs loss terms and top-1 accuracy per draft position; saves official-format
checkpoints every epoch and at the end, and resumes from `OUT/state` after an interruption
(rerun the same command).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from gumiho.checkpoint import save_drafter
from gumiho.config import DrafterConfig
from gumiho.errors import GumihoError, cli_errors
from gumiho.ge_data.shards import load_samples
from gumiho.modeling import build_draft_model
from gumiho.target import load_target
from gumiho.train.dataset import add_noise, collate, online_samples
from gumiho.train.loss import medusa_loss, serial_loss

EXPORT_DTYPE = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gumiho.train", description=__doc__.split("\n")[0])
    p.add_argument("--target", default="smollm2")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--data", help="dir made by gumiho.ge_data.allocation")
    source.add_argument("--online", action="store_true",
                        help="compute the target's features on the fly (no stored data)")
    p.add_argument("--conversations", default="sharegpt", help="--online: source file")
    p.add_argument("--num-conversations", type=int, default=2000, help="--online: how many")
    p.add_argument("--max-len", type=int, default=2048, help="--online: tokens per sample")
    p.add_argument("--method", default="gumiho", choices=("gumiho", "eagle2", "medusa"))
    p.add_argument("--output-dir", required=True)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--max-steps", type=int, default=None,
                   help="optimizer steps of the schedule (default: from --epochs)")
    p.add_argument("--stop-after-steps", type=int, default=None,
                   help="stop early without changing the schedule (resume later)")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per device per step")
    p.add_argument("--grad-accum", type=int, default=8,
                   help="global batch = batch-size x grad-accum x processes (reference: 32)")
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--warmup-steps", type=int, default=200)
    p.add_argument("--grad-clip", type=float, default=0.5)
    p.add_argument("--noise", type=float, default=0.2, help="uniform feature noise scale")
    p.add_argument("--ploss-fraction", type=float, default=1.0,
                   help="score ploss (Medusa: its cross-entropy) on this random fraction "
                   "of positions (1.0 = the reference; lower it to fit a CPU budget)")
    p.add_argument("--eval-data", default=None, help="held-out data dir: per-position "
                   "accuracy at the end (and each epoch with --eval-each-epoch)")
    p.add_argument("--eval-each-epoch", action="store_true")
    p.add_argument("--export-dtype", default="float16", choices=list(EXPORT_DTYPE))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    return p


def schedule(step: int, warmup: int, total: int) -> float:
    """Linear warm-up for `warmup` steps, then linear decay to 0 at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    return max(0.0, (total - step) / max(1, total - warmup))


def new_model(target, method: str, seed: int):
    torch.manual_seed(seed)
    model = build_draft_model(DrafterConfig.for_target(target.config, method))
    if hasattr(model, "embed_tokens"):
        model.embed_tokens.weight.data.copy_(target.input_embeddings().float())  # scale included
    if method == "medusa":
        model.init_lm_heads(target.lm_head.weight)
    return model


def batch_loss(model, target, batch, method: str, epoch: int, noise: float,
               log_acc: bool = True, p_fraction: float = 1.0, seed: int = 0):
    """Forward one batch; returns (loss, logs). `seed` fixes this batch's noise and ploss
    sample, so a resumed run repeats an uninterrupted one exactly."""
    generator = torch.Generator().manual_seed(seed)
    valid = batch["valid"]
    features = batch.get("hidden_state")
    if features is None:
        features = target.features(batch["input_ids"], valid.long())
    features = features.float()
    lm_head = target.lm_head
    if method == "medusa":
        return medusa_loss(model(features), batch["input_ids"], batch["loss_mask"], model,
                           lm_head, p_fraction, generator)
    noised = add_noise(features, valid, noise, generator) if model.training else features
    outputs = model(batch["input_ids"], noised, valid)
    return serial_loss(outputs, features, batch["loss_mask"], lm_head, epoch,
                       log_acc=log_acc, p_fraction=p_fraction, generator=generator)


@torch.no_grad()
def evaluate(model, target, samples, method, epoch, batch_size, device) -> dict[str, float]:
    """Mean top-1 accuracy per draft position (token-weighted per batch) on held-out data."""
    model.eval()
    sums: dict[str, float] = {}
    batches = 0
    for i in range(0, len(samples), batch_size):
        batch = {k: v.to(device) for k, v in collate(samples[i : i + batch_size]).items()}
        _, logs = batch_loss(model, target, batch, method, epoch, 0.0)
        for k, v in logs.items():
            sums[k] = sums.get(k, 0.0) + v
        batches += 1
    model.train()
    return {k: v / max(batches, 1) for k, v in sums.items() if k.startswith("acc")}


@cli_errors
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return train(args)


def train(args: argparse.Namespace) -> int:
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    accelerator = Accelerator(gradient_accumulation_steps=args.grad_accum,
                              mixed_precision="no" if not torch.cuda.is_available() else "bf16")
    set_seed(args.seed)
    out = Path(args.output_dir)
    target = load_target(args.target, device=str(accelerator.device),
                         dtype="float32" if accelerator.device.type == "cpu" else "bfloat16")
    if args.data:
        _, samples = load_samples(args.data)
    else:
        samples = online_samples(target, args.conversations, args.num_conversations,
                                 args.max_len)
    if not samples:
        raise GumihoError("no training samples")
    eval_samples = load_samples(args.eval_data)[1] if args.eval_data else []
    model = new_model(target, args.method, args.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95))
    per_epoch = math.ceil(len(samples) / (args.batch_size * accelerator.num_processes
                                          * args.grad_accum))
    total = args.max_steps or per_epoch * args.epochs
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: schedule(s, args.warmup_steps, total))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    progress = {"step": 0, "epoch": 0, "batches_done": 0}
    state_dir = out / "state"
    if (state_dir / "progress.json").exists():
        accelerator.load_state(str(state_dir))
        progress = json.loads((state_dir / "progress.json").read_text())
        accelerator.print(f"resuming from step {progress['step']} (epoch {progress['epoch']})")
    stop_at = min(total, args.stop_after_steps or total)
    bar = tqdm(total=total, initial=progress["step"], desc=f"train {args.method}",
               disable=not accelerator.is_main_process)
    log_file = out / "train_log.jsonl"
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    while progress["step"] < stop_at:
        order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(
            args.seed * 1000 + progress["epoch"])).tolist()
        loader = accelerator.prepare_data_loader(torch.utils.data.DataLoader(
            [samples[i] for i in order], batch_size=args.batch_size, collate_fn=collate))
        epoch_batches = len(loader)
        loader = accelerator.skip_first_batches(loader, progress["batches_done"])
        for batch in loader:
            with accelerator.accumulate(model):
                log_now = (progress["step"] + 1) % args.log_every == 0
                loss, logs = batch_loss(model, target, batch, args.method, progress["epoch"],
                                        args.noise, log_acc=log_now,
                                        p_fraction=args.ploss_fraction,
                                        seed=hash((args.seed, progress["epoch"],
                                                   progress["batches_done"])) % 2**62)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(params, args.grad_clip)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            progress["batches_done"] += 1
            if not accelerator.sync_gradients:
                continue
            progress["step"] += 1
            bar.update(1)
            if accelerator.is_main_process and progress["step"] % args.log_every == 0:
                bar.set_postfix({k: f"{v:.3f}" for k, v in logs.items()})
                with log_file.open("a") as f:
                    f.write(json.dumps({"step": progress["step"], "epoch": progress["epoch"],
                                        "lr": scheduler.get_last_lr()[0], **logs}) + "\n")
            if progress["step"] >= stop_at and progress["batches_done"] < epoch_batches:
                break  # mid-epoch; an epoch that ends here completes below
        else:
            progress["epoch"] += 1
            progress["batches_done"] = 0
            save(accelerator, model, progress, out, args, f"checkpoint-epoch{progress['epoch']}")
            if eval_samples and args.eval_each_epoch:
                acc = evaluate(accelerator.unwrap_model(model), target, eval_samples,
                               args.method, progress["epoch"], args.batch_size,
                               accelerator.device)
                accelerator.print(f"epoch {progress['epoch']} held-out accuracy: "
                                  + ", ".join(f"{k[4:]} {v:.3f}" for k, v in acc.items()))
    save(accelerator, model, progress, out, args, None)
    bar.close()
    summary = {"steps": progress["step"], "epochs": progress["epoch"],
               "train_samples": len(samples), "wall_s": time.perf_counter() - start}
    if eval_samples:
        summary["held_out_accuracy"] = evaluate(accelerator.unwrap_model(model), target,
                                                eval_samples, args.method, progress["epoch"],
                                                args.batch_size, accelerator.device)
    if accelerator.is_main_process:
        (out / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        accelerator.print(json.dumps(summary))
    return 0


def save(accelerator, model, progress: dict, out: Path, args, name: str | None) -> None:
    """Training state (for resume) and an official-format export: OUT/name or OUT itself."""
    accelerator.wait_for_everyone()
    accelerator.save_state(str(out / "state"))
    if accelerator.is_main_process:
        (out / "state" / "progress.json").write_text(json.dumps(progress))
        extra = {"training": {k: v for k, v in vars(args).items() if k != "output_dir"},
                 "trained_steps": progress["step"]}
        save_drafter(accelerator.unwrap_model(model), out / name if name else out,
                     dtype=EXPORT_DTYPE[args.export_dtype], extra_config=extra)


if __name__ == "__main__":
    sys.exit(main())
