"""The training loss's forms against each other, as whole training steps: the same online
batches' forward and backward, each form in turn (the order alternating), in one process (a
shared machine's noise falls on all alike). The weights do not move between steps. The
forms, each the head's product and the soft cross-entropy: `head` (the product inside the
loss, a piece of rows at a time: `gumiho.train.loss.head_soft_cross_entropy`, softce.c
within on a CPU where it builds), `kernel` (the product, then softce.c), `torch` (the
product, then the fused loss in torch's operators), `unfused` (the product, then the
released recipe's form).

    python scripts/train_loss_ab.py --precision bf16 --draft-vocab 32768 --pairs 6
    python scripts/train_loss_ab.py --forms head,kernel --pairs 6
    python scripts/train_loss_ab.py --device cuda --batch-size 32 --pairs 6   # a GPU
    python scripts/train_loss_ab.py --forms head --pairs 2 --peak-memory  # a step's memory

`--loss-only ROWS` times the product and the loss alone, forward and backward, on random
hidden states of ROWS x 576 and a random head over the draft vocabulary (ROWS: a batch's
scored tokens, ~1,500 for 4 x 512): steady where whole steps vary with their batches by tens
of percent. On a GPU it also prints each form's peak memory. (Before the `head` form, in
session 48, this mode timed the loss alone on random logits, without the product.)

    python scripts/train_loss_ab.py --loss-only 1500 --forms head,kernel,torch,unfused --pairs 9
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere

import gumiho.train.loss as loss_module
from gumiho import softce
from gumiho.config import TrainConfig
from gumiho.modeling import DraftHead
from gumiho.target import load_target
from gumiho.train.dataset import collate, epoch_batches, online_samples
from gumiho.train.loss import LossWeights, top1
from gumiho.train.start import new_model
from gumiho.train.step import batch_loss


def unfused(logits, probs, index=None, rows=None):
    """The released recipe's form: float32 (M, D) intermediates, kept for the backward."""
    chosen = probs if index is None else probs[index]
    return -(chosen * torch.log_softmax(logits, -1, dtype=torch.float32)).sum(-1).mean()


def separate(hidden, head, probs, index=None, rows=None, want_top1=False):
    """The head's product, then the module's `soft_cross_entropy` (whichever form is
    swapped in): what the trainer did before `head_soft_cross_entropy`."""
    logits = head.logits(hidden, packed=False)
    loss = loss_module.soft_cross_entropy(logits, probs, index)
    return loss, (top1(logits.detach()) if want_top1 else None)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--draft-vocab", type=int, default=32768)
    p.add_argument("--init", default="gumiho/assets/smollm2/gumiho")
    p.add_argument("--heads-only", action="store_true")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--pairs", type=int, default=6, help="rounds, each form once a round")
    p.add_argument("--forms", default=None,
                   help="comma-separated, of head, kernel, torch, unfused (the first is "
                        "compared with each other; default: head,kernel,unfused where "
                        "softce.c runs, else head,torch,unfused)")
    p.add_argument("--peak-memory", action="store_true",
                   help="whole steps: print the resident memory's peak during them above "
                        "its level before them (Linux; one form a run, so the peak is its)")
    p.add_argument("--loss-only", type=int, default=0, metavar="ROWS",
                   help="time the product and the loss alone on random ROWS x 576 hidden "
                        "states")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    original = (loss_module.head_soft_cross_entropy, loss_module.soft_cross_entropy,
                softce.kernel)
    inside, fused, built = original
    known = {"head": (inside, fused, built), "kernel": (separate, fused, built),
             "torch": (separate, fused, lambda: None), "unfused": (separate, unfused, built)}
    runs_here = device.type == "cpu" and built() is not None
    chosen = args.forms or ("head,kernel,unfused" if runs_here else "head,torch,unfused")
    forms = {name: known[name] for name in chosen.split(",")}
    if "kernel" in forms and not runs_here:
        p.error("--forms kernel: softce.c runs only on a CPU where it builds")
    try:  # each form swaps the module's functions in; the originals come back after
        if args.loss_only:
            rates = loss_only(args, device, forms)
            unit = f"ms a loss ({args.loss_only} x {args.draft_vocab}, forward and backward)"
        else:
            rates = steps(args, device, forms)
            unit = "tokens/s"
    finally:
        use(original)
    median = {f: statistics.median(rates[f]) for f in forms}
    first = next(iter(forms))
    faster = (lambda f: median[f] / median[first]) if args.loss_only else \
        (lambda f: median[first] / median[f])
    print(f"{device.type}, {args.precision}, batch {args.batch_size}, "
          f"draft vocabulary {args.draft_vocab}"
          f"{', heads only' if args.heads_only else ''}: median {unit}: "
          + ", ".join(f"{f} {median[f]:.0f}" for f in forms) + "; "
          + ", ".join(f"{first} against {f} {faster(f):.2f}x" for f in list(forms)[1:]))
    # each round's own ratio, then their median: the machine's drift falls out of it
    rounds = {f: statistics.median((b / a) if args.loss_only else (a / b) for a, b in
                                   zip(rates[first], rates[f], strict=True))
              for f in list(forms)[1:]}
    print("median of the rounds' ratios: " + ", ".join(
        f"{first} against {f} {ratio:.2f}x" for f, ratio in rounds.items()))


def use(form: tuple) -> None:
    """Swap a form's functions into the loss module and softce."""
    (loss_module.head_soft_cross_entropy, loss_module.soft_cross_entropy,
     softce.kernel) = form


def loss_only(args, device: torch.device, forms: dict) -> dict[str, list[float]]:
    """Milliseconds of one forward and backward of the product and the loss alone, per form
    and round (and on a GPU each form's peak memory)."""
    g = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    width = 576  # SmolLM2's
    lm_head = torch.nn.Linear(width, args.draft_vocab, bias=False)
    with torch.no_grad():
        lm_head.weight.copy_(torch.randn(args.draft_vocab, width, generator=g) * 0.3)
    head = DraftHead(lm_head.to(device, dtype))
    hidden = torch.randn(args.loss_only, width, generator=g).to(device)
    probs = torch.softmax(torch.randn(args.loss_only, args.draft_vocab, generator=g) * 2,
                          -1).to(device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype != torch.float32)
    times: dict[str, list[float]] = {form: [] for form in forms}
    peaks: dict[str, float] = {}
    for k in range(args.pairs + 1):  # round 0 warms up
        for form in list(forms)[:: 1 if k % 2 == 0 else -1]:
            use(forms[form])
            h = hidden.clone().requires_grad_()
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
            start = time.perf_counter()
            with autocast:
                loss, _ = loss_module.head_soft_cross_entropy(h, head, probs)
            (loss * 0.1).backward()
            if device.type == "cuda":
                torch.cuda.synchronize()
                peaks[form] = (torch.cuda.max_memory_allocated() - before) / 2 ** 20
            if k:
                times[form].append(1e3 * (time.perf_counter() - start))
            del h
        if k:
            print(f"round {k}: " + ", ".join(f"{f} {times[f][-1]:.0f} ms" for f in forms),
                  flush=True)
    if peaks:
        print("peak memory above the inputs: " + ", ".join(f"{f} {peaks[f]:.0f} MiB"
                                                          for f in forms))
    return times


def steps(args, device: torch.device, forms: dict) -> dict[str, list[float]]:
    """Training tokens/s of whole steps (forward and backward), per form and round."""
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

    def step(index: int, form: str) -> tuple[float, float]:
        """Tokens/s of one forward and backward, and its loss."""
        use(forms[form])
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

    peak = ResidentPeak() if args.peak_memory else None
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
    if peak:
        print(f"resident memory before the steps {peak.base / 2 ** 20:.0f} MiB, its peak "
              f"during them +{peak.stop() / 2 ** 20:.0f} MiB ({', '.join(forms)})")
    return rates


class ResidentPeak:
    """The process's resident memory sampled every 2 ms from now on (Linux's
    /proc/self/statm): `stop()` gives its peak above the level at the start."""

    def __init__(self):
        self.page, self.peak, self.running = os.sysconf("SC_PAGE_SIZE"), 0, True
        self.samples = 0  # how many readings so far: lets a caller wait for one
        self.base = self.resident()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def resident(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def _sample(self) -> None:
        while self.running:
            self.peak = max(self.peak, self.resident())
            self.samples += 1
            time.sleep(0.002)

    def stop(self) -> int:
        self.running = False
        self.thread.join()
        return self.peak - self.base


if __name__ == "__main__":
    main()
