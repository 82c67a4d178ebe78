"""Where a training step's time goes, on any device: the trainer's own step (`gumiho.train
--online`: the target's features, the input noise, the drafter's forward, its losses, the
backward, clipping and the optimizer) on real ShareGPT samples, timed by phase with a
device synchronisation around each, then profiled for the kernels (CUDA) or operators
(CPU) that take most of a step's time and the device's busy share of it.

    python scripts/profile_train_step.py --device cuda --batch-size 32 --max-len 512 \\
        --draft-vocab 32768 --init gumiho/assets/smollm2/gumiho --json runs/train_step.json

An H100 trained the Gumiho drafter at ~59k tokens/s (batch 32 x 512, bf16, 32k draft
vocabulary). Counted, a token costs ~0.9 GFLOP (the target's forward ~0.2, the drafter's
layers and heads forward and backward ~0.15, the seven vocabulary projections of the
losses forward and backward ~0.5), so that is ~55 TFLOPS, a small share of the ~990 of
the H100's bf16 peak: the step's time goes somewhere else too. The phase table says
where; a step whose device is busy for much less than its wall time waits on the host
(e.g. the input noise, drawn on the CPU so that runs repeat across devices). The
synchronisations make the phase sum slower than the unsynchronised step, timed first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere

import gumiho.train.step as batch_step
from gumiho.config import TrainConfig
from gumiho.evaluation.profiling import kernel_summary
from gumiho.modeling import DraftHead
from gumiho.profiling import PhaseTimer, synchronize
from gumiho.target import choose_device_dtype, load_target
from gumiho.train.dataset import collate, epoch_batches, online_samples
from gumiho.train.loss import LossWeights
from gumiho.train.start import new_model


def timed_calls(timer: PhaseTimer, phase: str, fn):
    """fn, each call timed as `phase`."""
    def call(*args, **kwargs):
        with timer(phase):
            return fn(*args, **kwargs)
    return call


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=None, help="default: a GPU if there is one")
    p.add_argument("--method", default="gumiho")
    p.add_argument("--init", default=None, help="a drafter to start from (else fresh weights)")
    p.add_argument("--draft-vocab", type=int, default=32768)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--conversations", type=int, default=2048,
                   help="training conversations to draw the batches from (at least "
                   "--batch-size x (--warmup + 4 x --steps))")
    p.add_argument("--precision", default=None, choices=("bf16", "fp32"),
                   help="the trainer's --precision (default: bf16 on a GPU, fp32 on a CPU)")
    p.add_argument("--noise-on", default=None, choices=("cpu", "device"),
                   help="the trainer's --noise-on (default: device on a GPU, cpu on a CPU); "
                   "on a GPU the other place's whole steps are timed too")
    p.add_argument("--epoch", type=int, default=2, help="the epoch the losses see "
                   "(Gumiho's MLP heads take their ploss from --mlp-ploss-after-epochs)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--mlp-detach", action="store_true", help="as the trainer's flag")
    p.add_argument("--heads-only", action="store_true", help="as the trainer's flag")
    p.add_argument("--top", type=int, default=20, help="kernels (operators) listed")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()

    device = torch.device(args.device) if args.device else choose_device_dtype()[0]
    mixed = args.precision or ("fp32" if device.type == "cpu" else "bf16")  # as the trainer
    config = TrainConfig(method=args.method, online=True, num_conversations=args.conversations,
                         max_len=args.max_len, batch_size=args.batch_size, grad_accum=1,
                         draft_vocab=args.draft_vocab, init_from=args.init, precision=mixed,
                         mlp_ploss_after_epochs=0, noise_on=args.noise_on,
                         mlp_detach=args.mlp_detach, heads_only=args.heads_only)
    torch.manual_seed(config.seed)
    target = load_target(config.target, device=str(device),
                         dtype="bfloat16" if mixed == "bf16" else "float32")
    samples = online_samples(target, config.conversations, config.num_conversations,
                             config.max_len, progress=True)
    model = new_model(target, config, samples).to(device)
    head = DraftHead.for_model(target, model)
    params = [q for q in model.parameters() if q.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5, betas=(0.9, 0.95))
    lengths = [s["input_ids"].shape[0] for s in samples]
    batches = epoch_batches(lengths, config.batch_size, config.seed, 0)
    need = args.warmup + 4 * args.steps
    if len(batches) < need:
        sys.exit(f"error: {len(batches)} batches of {config.batch_size}; the run needs {need}: "
                 "give more --conversations")
    weights = LossWeights(p=config.ploss_weight, mlp_p=config.mlp_ploss_weight,
                          mlp_p_from_epoch=config.mlp_ploss_after_epochs,
                          heads_only=config.heads_only)
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if mixed == "bf16"
                else nullcontext())  # accelerate's bf16 mixed precision
    timer = PhaseTimer(device, enabled=False)

    noise_on = batch_step.noise_device(config, device)

    def step(index: int, noise_on: str = noise_on) -> int:
        batch = collate([samples[i] for i in batches[index]])
        with timer("batch to device"):
            batch = {k: v.to(device) for k, v in batch.items()}
        with autocast:
            loss, _ = batch_step.batch_loss(model, target, head, batch, config.method,
                                            args.epoch, config.noise, log_acc=False,
                                            p_fraction=config.ploss_fraction, seed=index,
                                            weights=weights, noise_on=noise_on,
                                            mlp_detach=config.mlp_detach)
        with timer("backward"):
            loss.backward()
        with timer("clip + optimizer"):
            torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
            optimizer.step()
            optimizer.zero_grad()
        return int(batch["valid"].sum())

    # the batch_loss phases, timed where batch_loss calls them (only while timing)
    target.features = timed_calls(timer, "target features", target.features)
    batch_step.add_noise = timed_calls(timer, "input noise", batch_step.add_noise)
    model.forward = timed_calls(timer, "drafter forward", model.forward)
    batch_step.serial_loss = timed_calls(timer, "losses", batch_step.serial_loss)
    batch_step.medusa_loss = timed_calls(timer, "losses", batch_step.medusa_loss)

    for i in range(args.warmup):
        step(i)
    first = args.warmup

    def whole_steps(indices: range, noise_on: str) -> tuple[float, int]:
        """Median seconds of whole steps, unsynchronised inside (the figure a run sees),
        and their real tokens."""
        synchronize(device)
        tokens, walls = 0, []
        for i in indices:
            start = time.perf_counter()
            tokens += step(i, noise_on)
            synchronize(device)
            walls.append(time.perf_counter() - start)
        return statistics.median(walls), tokens

    on_gpu = device.type == "cuda"
    name = torch.cuda.get_device_name(device) if on_gpu else "cpu"
    report = {"device": name, "precision": mixed, "method": config.method,
              "batch_size": config.batch_size, "max_len": config.max_len,
              "draft_vocab": config.draft_vocab, "init": args.init, "noise_on": noise_on,
              "mlp_detach": config.mlp_detach, "heads_only": config.heads_only}

    def show(*lines: str, **fields) -> None:
        """Print as each part ends and keep the JSON current: a run cut by a time limit
        still reports what it measured."""
        print(*lines, sep="\n", flush=True)
        report.update(fields)
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1) + "\n")

    # 1. whole steps
    step_s, tokens = whole_steps(range(first, first + args.steps), noise_on)
    per_step = tokens / args.steps
    show(f"{config.method} training step on {name} ({mixed}), batch {config.batch_size} x "
         f"<= {config.max_len} tokens ({per_step:.0f} real tokens a step), draft vocabulary "
         f"{config.draft_vocab or 'whole'}",
         f"  step (median of {args.steps}), noise on {noise_on:<6}  {step_s * 1e3:9.1f} ms = "
         f"{per_step / step_s:,.0f} tokens/s",
         tokens_per_step=per_step, step_s=step_s, tokens_per_s=per_step / step_s)
    # 2. on a GPU, the same whole steps with the noise drawn at the other place
    if on_gpu:
        other = {"cpu": "device", "device": "cpu"}[noise_on]
        other_s, other_tokens = whole_steps(range(first + args.steps, first + 2 * args.steps),
                                            other)
        rate = other_tokens / args.steps / other_s
        show(f"  step (median of {args.steps}), noise on {other:<6}  {other_s * 1e3:9.1f} ms = "
             f"{rate:,.0f} tokens/s (other batches)",
             other_noise={"noise_on": other, "step_s": other_s, "tokens_per_s": rate})
    # 3. as many steps with each phase synchronised and timed
    timer.enabled = True
    for i in range(first + 2 * args.steps, first + 3 * args.steps):
        step(i)
    timer.enabled = False
    phases = {k: v / args.steps for k, v in timer.totals.items()}
    show("  by phase, synchronised around each (ms a step):",
         *(f"    {phase:<28} {seconds * 1e3:9.1f}"
           for phase, seconds in sorted(phases.items(), key=lambda kv: -kv[1])),
         f"    {'(sum)':<28} {sum(phases.values()) * 1e3:9.1f}", phases_s=phases)
    # 4. profiled steps
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as prof:
        for i in range(first + 3 * args.steps, first + 4 * args.steps):
            step(i)
        synchronize(device)
    kernels = kernel_summary(prof, on_gpu, args.steps, args.top)
    show(f"  busy ({kernels['what']}) {kernels['busy_s'] * 1e3:.1f} ms a step; the most:",
         *(f"    {row['s'] * 1e3:8.2f} ms {row['calls']:7.1f} calls  {row['name'][:90]}"
           for row in kernels["top"]), kernels=kernels)

if __name__ == "__main__":
    main()
