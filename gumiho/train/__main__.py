"""Train a drafter: `accelerate launch -m gumiho.train --data DIR --method M ...`
(or `python -m gumiho.train` on one device; `bash scripts/train.sh` wraps it).

Seeded; logs loss terms, top-1 accuracy per draft position and tokens/s; saves official-
format checkpoints every epoch and at the end. `OUT/state` is written atomically at each
save (optimizer, scheduler, RNG, progress, the run's settings): rerunning the same command
after an interruption resumes exactly where the last save left off, and a rerun with other
settings is refused. Any number of processes gives the same run: the epoch's batches are
fixed by the seed and each optimizer step covers the same global batches.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from dataclasses import asdict, fields
from pathlib import Path

import torch
from torch import Tensor
from tqdm import tqdm

from gumiho.checkpoint import check_drafter_files, save_drafter
from gumiho.config import TrainConfig
from gumiho.errors import ArgumentParser, GumihoError, cli_errors, nonnegative_int
from gumiho.methods import DRAFTER_METHODS
from gumiho.modeling import DraftHead
from gumiho.paths import file_sha256, write_atomically
from gumiho.target import choose_device_dtype, load_target
from gumiho.train.accel import (
    check_process_group,
    configure_deepspeed,
    fresh_accelerator_state,
    global_mean,
    precision,
)
from gumiho.train.dataset import collate, epoch_batches, online_samples, stored_samples
from gumiho.train.loss import LossWeights
from gumiho.train.start import new_model
from gumiho.train.state import (
    LOG,
    RunState,
    check_run_settings,
    load_run_state,
    save_run_state,
    wait_for_everyone,
)
from gumiho.train.step import batch_loss, evaluate, noise_device

# A setting a saved run does not record (it predates the flag) counts as its default.
SETTING_DEFAULTS = {f.name: f.default for f in fields(TrainConfig)}
EXPORT_DTYPE = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


MAX_SEED = 2**32 - 1  # numpy's seeds, which accelerate's set_seed sets with torch's


def seed_arg(value: str) -> int:
    """argparse type: a seed every generator the run seeds takes (a negative or larger one
    failed in accelerate's set_seed, after the target had loaded, as an internal error)."""
    seed = nonnegative_int(value)
    if seed > MAX_SEED:
        raise argparse.ArgumentTypeError(f"expected an integer from 0 to {MAX_SEED}, got "
                                         f"{value!r}")
    return seed


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m gumiho.train", description=__doc__.split("\n")[0])
    p.add_argument("--target", default="smollm2")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--data", nargs="+", help="dirs made by gumiho.ge_data.allocation")
    source.add_argument("--online", action="store_true",
                        help="compute the target's features on the fly (no stored data)")
    p.add_argument("--conversations", default="sharegpt", help="--online: source file")
    p.add_argument("--num-conversations", type=int, default=2000, help="--online: how many")
    p.add_argument("--skip-conversations", type=int, default=0,
                   help="--online: start this many conversations into the training split "
                   "(to continue an --init-from drafter on conversations it has not seen)")
    p.add_argument("--max-len", type=int, default=2048, help="--online: tokens per sample")
    p.add_argument("--template", default=None, help="--online: chat template for tokenizers "
                   "without one (base models): 'vicuna' or a Jinja string")
    p.add_argument("--method", default="gumiho", choices=DRAFTER_METHODS)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--max-steps", type=int, default=None,
                   help="optimizer steps of the schedule (default: from --epochs)")
    p.add_argument("--stop-after-steps", type=int, default=None,
                   help="stop early without changing the schedule (resume later)")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per process per "
                   "micro-batch")
    p.add_argument("--grad-accum", type=int, default=8,
                   help="global batch = batch-size x grad-accum x processes (reference: 32)")
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--warmup-steps", type=int, default=200)
    p.add_argument("--grad-clip", type=float, default=0.5)
    p.add_argument("--noise", type=float, default=0.2, help="uniform feature noise scale")
    p.add_argument("--noise-on", default=None, choices=("cpu", "device"),
                   help="where the noise is drawn: cpu (the same noise on every device) or "
                   "device (no host work a step); default: device on a GPU, cpu on a CPU")
    p.add_argument("--ploss-fraction", type=float, default=1.0,
                   help="score ploss (Medusa: its cross-entropy) on this random fraction "
                   "of positions (1.0 = the reference; lower it to fit a CPU budget)")
    p.add_argument("--draft-vocab", type=nonnegative_int, default=0,
                   help="reduced draft vocabulary: the N most frequent assistant tokens of "
                   "the training data (0 = the target's whole vocabulary)")
    p.add_argument("--mlp-ploss-after-epochs", type=int, default=2,
                   help="Gumiho: the MLP heads train on vloss alone for this many epochs, "
                   "then ploss joins (reference: 2, meant for ~20 epochs; lower it for a "
                   "short run)")
    p.add_argument("--ploss-weight", type=float, default=TrainConfig.ploss_weight,
                   help="Gumiho, EAGLE-2: the serial step's ploss weight, against 1.0 for "
                   "its vloss (reference: 0.1)")
    p.add_argument("--mlp-ploss-weight", type=float, default=TrainConfig.mlp_ploss_weight,
                   help="Gumiho: the MLP heads' ploss weight, head i's times 0.8^(i+1) "
                   "(reference: 0.1/9, against the serial step's 0.1)")
    p.add_argument("--mlp-detach", action="store_true",
                   help="Gumiho: the MLP heads' losses train the heads alone, not the serial "
                   "layers and fusion layer they read (so a heavier --mlp-ploss-weight "
                   "cannot pull those; the reference trains them on every loss)")
    p.add_argument("--heads-only", action="store_true",
                   help="Gumiho: train the MLP heads alone (the serial layers and fc frozen, "
                   "their losses left out; 1.25x the tokens/s of an --mlp-detach step on a "
                   "CPU): for a drafter whose heads are the short part")
    p.add_argument("--serial2-weight", type=float, default=TrainConfig.serial2_weight,
                   help="Gumiho: also score serial step 2 (run on step 1's own output, as "
                   "at inference) against the target's features two ahead, with step 1's "
                   "vloss and ploss weights times this (reference: 0, step 2 only logged)")
    p.add_argument("--init-from", default=None, metavar="DRAFT_DIR",
                   help="start from this drafter checkpoint (its weights and draft "
                   "vocabulary; the same --method) instead of fresh weights; the optimizer "
                   "and learning-rate schedule start fresh")
    p.add_argument("--eval-data", nargs="+", default=None, help="held-out data dirs: "
                   "per-position accuracy at the end (and each epoch with --eval-each-epoch)")
    p.add_argument("--eval-each-epoch", action="store_true")
    p.add_argument("--eval-every", type=int, default=0,
                   help="also evaluate every N optimizer steps (logged to train_log.jsonl; "
                   "plot with python -m gumiho.train.plot)")
    p.add_argument("--export-dtype", default="float16", choices=list(EXPORT_DTYPE))
    p.add_argument("--precision", default=None, choices=("bf16", "fp32"),
                   help="bf16: bfloat16 autocast over fp32 weights and the target in "
                   "bfloat16 (about 2x the tokens/s of fp32 on a CPU with AMX; refused on "
                   "a CPU whose bf16 products are slower than fp32's, such as an AVX2-only "
                   "one, see README); default: bf16 on a GPU, fp32 on a CPU")
    p.add_argument("--seed", type=seed_arg, default=0,
                   help=f"0 to {MAX_SEED} (numpy's range, which accelerate seeds too)")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--save-every", type=int, default=0,
                   help="also save the run every N optimizer steps (a kill then costs at most "
                   "N steps; default: at each epoch's end only)")
    p.add_argument("--dry-run", action="store_true",
                   help="check the settings, data dirs and output dir, then exit")
    return p


def train_config(args: argparse.Namespace) -> TrainConfig:
    values = {f.name: getattr(args, f.name) for f in fields(TrainConfig)}
    values["data"] = tuple(str(Path(d).resolve()) for d in args.data or ())
    return TrainConfig(**values)


def schedule(step: int, warmup: int, total: int) -> float:
    """Linear warm-up for `warmup` steps, then linear decay to 0 at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    return max(0.0, (total - step) / max(1, total - warmup))


@cli_errors(resume="the run keeps its last save (each epoch's end, or every --save-every "
            "steps); rerun the same command to resume from it")
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.stop_after_steps is not None and args.stop_after_steps < 1:
        raise GumihoError("--stop-after-steps must be at least 1")
    if args.log_every < 1:
        raise GumihoError("--log-every must be at least 1")
    if args.eval_every < 0 or args.save_every < 0:
        raise GumihoError("--eval-every and --save-every must be at least 0")
    if (args.eval_every or args.eval_each_epoch) and not args.eval_data:
        raise GumihoError("--eval-every and --eval-each-epoch evaluate on --eval-data: give "
                          "held-out data dirs (python -m gumiho.ge_data.allocation "
                          "--split held_out)")
    config, out = train_config(args), Path(args.output_dir)
    check_inputs(config, out, args.eval_data or [])
    if args.dry_run:
        print(f"ok: {config.method} drafter for {config.target} into {out}")
        return 0
    try:
        result = train(config, out, args.stop_after_steps, args.eval_data or [],
                       args.eval_each_epoch, args.log_every, args.eval_every, args.save_every)
    except GumihoError:  # bad input, found alike by every process: nothing left in flight
        leave_process_group()
        raise
    leave_process_group()
    return result


def leave_process_group() -> None:
    """End a launched process's group before it exits: left up, NCCL prints a warning per
    process at exit ("destroy_process_group() was not called", seen under the 2-process test
    on an H200, 2026-11-30). Not after an unexpected failure, where another process may still
    wait in a collective and the teardown could wait with it."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def check_inputs(config: TrainConfig, out: Path, eval_data: list[str]) -> None:
    """What can be checked before loading any weights: the target's config (the data's
    width and --draft-vocab against it), data and output dirs."""
    from gumiho.ge_data.shards import MANIFEST, read_manifest
    from gumiho.target import target_config
    from gumiho.train.dataset import check_data_target, check_width
    from gumiho.train.start import check_draft_vocab_size

    target = target_config(config.target)  # an embedded target is converted once here
    for data_dir in [*config.data, *eval_data]:
        manifest = read_manifest(Path(data_dir))
        if manifest is None:
            raise GumihoError(f"{data_dir}: no {MANIFEST}; make data with "
                              "python -m gumiho.ge_data.allocation --outdir DIR")
        check_width(manifest, data_dir, target.hidden_size)
        note = check_data_target(manifest, data_dir, config.target, target)
        if note:
            print(f"note: {note}", file=sys.stderr)
    check_draft_vocab_size(config.draft_vocab, target.vocab_size)
    if config.init_from:
        check_drafter_files(config.init_from, config.method)
    if out.exists() and not out.is_dir():
        raise GumihoError(f"--output-dir {out} is a file: give a directory")
    check_run_dir(out)
    check_run_settings(out, run_settings(config), SETTING_DEFAULTS)
    parent = next(p for p in [out, *out.parents] if p.exists())
    if not os.access(parent, os.W_OK):
        raise GumihoError(f"--output-dir {out}: {parent} is not writable")


def run_settings(config: TrainConfig, procs: int | None = None) -> dict:
    """What a run records and its resume compares: the config, a digest of each --data
    dir's manifest.json (the same path made again with other data is another run) and the
    process count, which only the launch knows (None: the dry run, not compared)."""
    from gumiho.ge_data.shards import MANIFEST

    digests = [file_sha256(Path(d) / MANIFEST)[:16] for d in config.data]
    return {**asdict(config), "data_digests": digests,
            **({} if procs is None else {"processes": procs})}


def check_run_dir(out: Path) -> None:
    """A run writes only into a new or empty folder, or its own: one with a saved state
    (state, or state.old / state.tmp mid-save), or a log and what a run cut off at its
    first save had written by then (its export comes before its state). A model dir or an
    exported drafter there would be overwritten."""
    if not out.is_dir():
        return
    entries = {p.name for p in out.iterdir()}
    if entries & {"state", "state.old", "state.tmp"} or entries <= {LOG}:
        return
    exported = {LOG, f"{LOG}.tmp", "model.safetensors", "model.safetensors.tmp",
                "config.json", "config.json.tmp", "train_summary.json",
                "train_summary.json.tmp"}  # (a kill -9 mid-write leaves a .tmp)
    if LOG in entries and all(e in exported or re.fullmatch(r"checkpoint-epoch\d+", e)
                              for e in entries):
        return
    shown = ", ".join(sorted(entries)[:3]) + (", ..." if len(entries) > 3 else "")
    raise GumihoError(f"--output-dir {out} holds files but no training run ({shown}): give "
                      "a new or empty folder")


def make_accelerator(config: TrainConfig):
    """The run's Accelerator, its group and DeepSpeed settings checked and the seed set;
    returns it with the target's dtype (accel.precision)."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    mixed, target_dtype = precision(config)
    # cpu=True without a GPU (or with GUMIHO_DEVICE=cpu): several launched processes then
    # form one gloo group (without it accelerate leaves each CPU process on its own,
    # silently training separate models)
    on_cpu = choose_device_dtype()[0].type == "cpu"
    fresh_accelerator_state(mixed, on_cpu)
    accelerator = Accelerator(gradient_accumulation_steps=config.grad_accum,
                              mixed_precision=mixed, cpu=on_cpu)
    check_process_group(accelerator)
    configure_deepspeed(accelerator, config)
    set_seed(config.seed)
    return accelerator, target_dtype


def training_samples(config: TrainConfig, target, progress: bool) -> list[dict]:
    """The training samples: tokenized from conversations (`--online`, the target's
    features computed in the loop) or read from stored data dirs."""
    if config.online:
        return online_samples(target, config.conversations, config.num_conversations,
                              config.max_len, config.template, config.skip_conversations,
                              progress=progress)
    return stored_samples(config.data, target.hidden_size)


def steps_per_epoch(lengths: list[int], config: TrainConfig, procs: int) -> int:
    """Whole optimizer steps in an epoch of samples of these lengths (the last, partial
    global batch is dropped); refuses data that does not fill one."""
    steps = len(epoch_batches(lengths, config.batch_size, config.seed, 0)) \
        // (procs * config.grad_accum)
    if steps == 0:
        raise GumihoError(f"{len(lengths)} training samples do not fill one global batch of "
                          f"{config.batch_size * config.grad_accum * procs}: lower "
                          "--batch-size or --grad-accum, or add data")
    return steps


def append_log(out: Path, row: dict) -> None:
    """One row of OUT/train_log.jsonl (a step's logs or an `eval`)."""
    with (out / LOG).open("a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")


def train(config: TrainConfig, out: Path, stop_after: int | None = None,
          eval_data: list[str] | tuple[str, ...] = (), eval_each_epoch: bool = False,
          log_every: int = 10, eval_every: int = 0, save_every: int = 0) -> int:
    accelerator, target_dtype = make_accelerator(config)
    target = load_target(config.target, device=str(accelerator.device), dtype=target_dtype)
    samples = training_samples(config, target, accelerator.is_main_process)
    eval_samples = stored_samples(eval_data, target.hidden_size) if eval_data else []
    procs = accelerator.num_processes
    lengths = [s["input_ids"].shape[0] for s in samples]
    per_epoch = steps_per_epoch(lengths, config, procs)
    total = config.max_steps or per_epoch * config.epochs
    model = new_model(target, config, samples)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, betas=(0.9, 0.95))
    # stepped by hand once per optimizer step (accelerate would step it once per process)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: schedule(s, config.warmup_steps, total))
    model, optimizer = accelerator.prepare(model, optimizer)
    settings = run_settings(config, procs)
    state = load_run_state(accelerator, out, settings, scheduler,
                           defaults=SETTING_DEFAULTS)
    head = DraftHead.for_model(target, accelerator.unwrap_model(model))
    stop_at = min(total, stop_after or total)
    if state.step >= stop_at:
        finished = summary_steps(out) == state.step
        wait_for_everyone(accelerator)  # each process has read it before the end rewrites it
        if finished:  # a finished run again: its weights and summary stay as they are
            accelerator.print(f"{out}: already trained to step {state.step} of {total}; "
                              f"nothing to do (its summary: {out / 'train_summary.json'})")
            return 0
        # the state was saved at the last epoch's end, and a kill came before the run's
        # end had written its weights to OUT and its summary: write them now, untrained on
        accelerator.print(f"{out}: trained to step {state.step}, but its final export and "
                          "summary were not written: writing them")
    bar = tqdm(total=total, initial=state.step, desc=f"train {config.method}",
               disable=not accelerator.is_main_process)
    out.mkdir(parents=True, exist_ok=True)
    start, tokens, step_logs = time.perf_counter(), 0, []
    while state.step < stop_at:
        batches = epoch_batches(lengths, config.batch_size, config.seed, state.epoch)
        usable = per_epoch * procs * config.grad_accum  # whole global steps only
        for index in range(state.batches_done + accelerator.process_index, usable, procs):
            # host tensors: batch_loss moves them to the drafter (so counting tokens
            # below reads no device)
            batch = collate([samples[i] for i in batches[index]])
            logs, grad_norm = step_micro_batch(accelerator, model, target, head, optimizer,
                                               params, batch, config, state, index, log_every)
            tokens += int(batch["valid"].sum())
            state.batches_done = index + procs - accelerator.process_index
            step_logs.append(logs)
            if not accelerator.sync_gradients:
                continue
            logs, step_logs = global_mean(accelerator, step_logs), []
            lr = scheduler.get_last_lr()[0]  # the rate this step used
            scheduler.step()
            state.step += 1
            bar.update(1)
            if accelerator.is_main_process and state.step % log_every == 0:
                logs["tokens_per_s"] = tokens * procs / (time.perf_counter() - start)
                if grad_norm is not None:  # before clipping (DeepSpeed's engine may report none)
                    logs["grad_norm"] = float(grad_norm)
                bar.set_postfix({k: f"{v:.3f}" for k, v in logs.items() if k != "lr"})
                append_log(out, {"step": state.step, "epoch": state.epoch,
                                 "lr": lr, **logs})
            if eval_samples and eval_every and state.step % eval_every == 0:
                log_evaluation(accelerator, model, target, head, eval_samples, config, state,
                               out)
            if state.step >= stop_at:
                break
            if save_every and state.step % save_every == 0 and state.batches_done < usable:
                save(accelerator, model, scheduler, state, out, settings, config, None)
        if state.batches_done >= usable:  # the epoch is complete
            state.epoch, state.batches_done = state.epoch + 1, 0
            save(accelerator, model, scheduler, state, out, settings, config,
                 f"checkpoint-epoch{state.epoch}")
            if eval_samples and eval_each_epoch:
                acc = evaluate(accelerator.unwrap_model(model), target, head, eval_samples,
                               config.method, state.epoch, config.batch_size)
                accelerator.print(f"epoch {state.epoch} held-out accuracy: "
                                  + ", ".join(f"{k[4:]} {v:.3f}" for k, v in acc.items()))
    wall = time.perf_counter() - start
    bar.close()
    summary = {"steps": state.step, "epochs": state.epoch, "train_samples": len(samples),
               "wall_s": wall,
               # None where this process trained nothing (it only wrote a cut-off run's end)
               "train_tokens_per_s": tokens * procs / max(wall, 1e-9) if tokens else None}
    if eval_samples:
        summary["held_out_accuracy"] = evaluate(accelerator.unwrap_model(model), target, head,
                                                eval_samples, config.method, state.epoch,
                                                config.batch_size)
    # the weights and the summary before the state that says the run got this far
    save(accelerator, model, scheduler, state, out, settings, config, None, summary)
    accelerator.print(json.dumps(summary))
    return 0


def summary_steps(out: Path) -> int | None:
    """The steps OUT/train_summary.json says the run had trained when it ended (None: no
    summary, or not a readable one). A run's end writes it after its export to OUT and
    before its state, so a summary at the state's step means that export is there too."""
    try:
        steps = json.loads((out / "train_summary.json").read_text(encoding="utf-8"))["steps"]
    except (OSError, ValueError, TypeError, KeyError):
        return None
    return steps if isinstance(steps, int) else None


def log_evaluation(accelerator, model, target, head, samples, config: TrainConfig,
                   state: RunState, out: Path) -> None:
    """Held-out accuracy per draft position now, as an `eval` row of train_log.jsonl."""
    acc = evaluate(accelerator.unwrap_model(model), target, head, samples, config.method,
                   state.epoch, config.batch_size)
    if accelerator.is_main_process:
        append_log(out, {"step": state.step, "epoch": state.epoch, "eval": acc})


def step_micro_batch(accelerator, model, target, head, optimizer, params, batch,
                     config: TrainConfig, state: RunState, index: int, log_every: int
                     ) -> tuple[dict[str, float], Tensor | None]:
    """Forward and backward one micro-batch (global index `index` in the epoch); the
    optimizer steps when accelerate's accumulation says the global batch is complete.
    Returns the micro-batch's logs and, on the step's last micro-batch, the gradient's
    global norm before clipping (a device tensor, read only when logged; else None)."""
    with accelerator.accumulate(model), accelerator.autocast():
        # autocast covers the losses' vocabulary projections too (most of the cost); the
        # losses take their softmax in fp32
        log_now = (state.step + 1) % log_every == 0
        loss, logs = batch_loss(model, target, head, batch, config.method, state.epoch,
                                config.noise, log_acc=log_now,
                                p_fraction=config.ploss_fraction,
                                seed=hash((config.seed, state.epoch, index)) % 2**62,
                                weights=LossWeights(
                                    p=config.ploss_weight, mlp_p=config.mlp_ploss_weight,
                                    mlp_p_from_epoch=config.mlp_ploss_after_epochs,
                                    serial2=config.serial2_weight,
                                    heads_only=config.heads_only),
                                noise_on=noise_device(config, accelerator.device),
                                mlp_detach=config.mlp_detach)
        accelerator.backward(loss)
        grad_norm = None
        if accelerator.sync_gradients:
            grad_norm = accelerator.clip_grad_norm_(params, config.grad_clip)
        optimizer.step()
        optimizer.zero_grad()
    return logs, grad_norm


def save(accelerator, model, scheduler, state: RunState, out: Path, settings: dict,
         config: TrainConfig, name: str | None, summary: dict | None = None) -> None:
    """An official-format export (OUT/name or OUT itself; with `summary`, then
    OUT/train_summary.json), then the training state, atomically, for resume. In that
    order: a kill between them leaves the export ahead of the state, and the resumed run
    comes to this save again and writes the same files; a state saved is never ahead of
    its own export. The last epoch's save comes before the run's end, whose export to OUT
    and summary a kill can cut off: a rerun calls the run finished (and leaves it alone)
    only where the summary is at the state's step (`summary_steps`), else writes them."""
    if accelerator.is_main_process:
        extra = {"training": settings, "trained_steps": state.step}
        save_drafter(accelerator.unwrap_model(model), out / name if name else out,
                     dtype=EXPORT_DTYPE[config.export_dtype], extra_config=extra)
        if summary is not None:
            write_atomically(out / "train_summary.json",
                             lambda tmp: tmp.write_text(json.dumps(summary, indent=2) + "\n",
                                                        encoding="utf-8"))
    wait_for_everyone(accelerator)
    save_run_state(accelerator, out, state, settings, scheduler)


if __name__ == "__main__":
    sys.exit(main())
