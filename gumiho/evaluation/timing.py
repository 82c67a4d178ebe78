"""Per-phase cost of a speculative cycle on the current device.

    python -m gumiho.evaluation.timing --target smollm2 [--widths 1,8,16,64] [--json]

Times, after warm-up and with device synchronisation around each timed call: one target
step over K tree tokens on top of a cache of `--context` tokens (K = 1 is a plain decode
step), and one drafting cycle of each drafter method given with --methods.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch

from gumiho.drafters import load_drafter
from gumiho.engine import prefill, verify_tree
from gumiho.errors import cli_errors
from gumiho.generate import add_target_args
from gumiho.kv_cache import KVCache
from gumiho.target import Target, load_target
from gumiho.tree import DraftTree


def timed(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int = 2) -> float:
    """Median seconds of fn() over `repeats` calls, after `warmup` untimed calls."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def verify_step_seconds(target: Target, width: int, context: int, repeats: int) -> float:
    """One target forward over a `width`-node tree (a balanced binary tree) at `context`."""
    device = target.device
    cache = KVCache.for_model(target.model, context + width + 1)
    prompt = torch.randint(100, 1000, (1, context), device=device)
    prefill(target, cache, prompt)
    parents = torch.cat([torch.tensor([-1]), torch.arange(width - 1) // 2]).to(device)
    tree = DraftTree.from_parents(torch.randint(100, 1000, (width,), device=device), parents)
    return timed(lambda: verify_tree(target, cache, tree), device, repeats)


def draft_cycle_seconds(target: Target, method: str, context: int, repeats: int,
                        accepted: int = 4) -> float:
    """One drafting cycle of a random-weight drafter of `method` after a `context`-token
    prompt: observe `accepted` new tokens (as after a verify), then `propose()`."""
    device = target.device
    drafter = load_drafter(method, target, "random")
    capacity = context + accepted * (repeats + 2) + drafter.max_nodes + 8
    cache = KVCache.for_model(target.model, capacity)
    prompt = torch.randint(100, 1000, (1, context), device=device)
    features, _ = prefill(target, cache, prompt)
    next_tokens = torch.cat([prompt[0, 1:], prompt[0, -1:]])
    drafter.begin(target, capacity)
    drafter.observe(features, next_tokens)
    drafter.propose()

    def cycle():
        drafter.observe(features[-accepted:], next_tokens[-accepted:])
        return drafter.propose()

    return timed(cycle, device, repeats)


@cli_errors
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gumiho.evaluation.timing",
                                     description=__doc__.split("\n")[0])
    add_target_args(parser)
    parser.add_argument("--widths", default="1,8,16,64", help="tree widths to time")
    parser.add_argument("--methods", default="", help="drafters to time, e.g. gumiho,eagle2")
    parser.add_argument("--context", type=int, default=128, help="committed tokens in cache")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    target = load_target(args.target, device=args.device, dtype=args.dtype)
    widths = [int(w) for w in args.widths.split(",") if w]
    report = {"target": args.target, "device": str(target.device),
              "dtype": str(target.dtype), "context": args.context,
              "torch": torch.__version__, "verify_s": {}, "draft_s": {}}
    for width in widths:
        report["verify_s"][width] = verify_step_seconds(target, width, args.context,
                                                        args.repeats)
    for method in filter(None, args.methods.split(",")):
        report["draft_s"][method] = draft_cycle_seconds(target, method, args.context,
                                                        args.repeats)
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"{args.target} on {report['device']} ({report['dtype']}), context {args.context}")
    for width, sec in report["verify_s"].items():
        label = "plain decode step" if width == 1 else f"verify step, {width} tree tokens"
        print(f"  {label:32s} {sec * 1e3:8.1f} ms")
    for method, sec in report["draft_s"].items():
        print(f"  {'draft cycle, ' + method:32s} {sec * 1e3:8.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
