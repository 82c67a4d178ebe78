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
from gumiho.generate import add_target_args, add_tree_args, tree_options
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


def profile_generation(target: Target, method: str, draft: str, prompt: str,
                       max_new_tokens: int, **tree_options) -> dict:
    """Per-cycle phase costs of a real generation, and plain decoding on the same prompt."""
    from gumiho.config import TreeConfig
    from gumiho.drafters import PlainDrafter
    from gumiho.engine import GenerateConfig, run

    tree = TreeConfig.for_method(method, **tree_options)
    drafter = load_drafter(method, target, draft, tree=tree)
    ids = target.chat_ids(prompt)
    config = GenerateConfig(max_new_tokens=max_new_tokens, profile=True)
    run(target, drafter, ids, GenerateConfig(max_new_tokens=8))  # warm-up
    fast = run(target, drafter, ids, config)
    plain = run(target, PlainDrafter(), ids, config)
    verify_cycles = max(fast.cycles - 1, 1)
    per_cycle = {k: v / verify_cycles for k, v in fast.phase_s.items() if k != "prefill"}
    plain_step = plain.phase_s["verify"] / max(plain.cycles - 1, 1)
    cycle = sum(per_cycle.values())
    return {"method": method, "tree": vars(tree), "tau": fast.tau, "per_cycle_s": per_cycle,
            "plain_step_s": plain_step, "cycle_over_plain_step": cycle / plain_step,
            "tokens_per_s": fast.tokens_per_s, "plain_tokens_per_s": plain.tokens_per_s,
            "speedup": fast.tokens_per_s / plain.tokens_per_s,
            "identical_to_plain": fast.token_ids == plain.token_ids}


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
    parser.add_argument("--profile-draft", default=None, help="profile real generation with "
                        "this drafter dir (or 'random') of --profile-method")
    parser.add_argument("--profile-method", default="gumiho")
    parser.add_argument("--prompt", default="Explain in a few sentences why the sky is blue.")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    add_tree_args(parser)
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
    if args.profile_draft:
        report["profile"] = profile_generation(target, args.profile_method, args.profile_draft,
                                               args.prompt, args.max_new_tokens,
                                               **tree_options(args))
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"{args.target} on {report['device']} ({report['dtype']}), context {args.context}")
    for width, sec in report["verify_s"].items():
        label = "plain decode step" if width == 1 else f"verify step, {width} tree tokens"
        print(f"  {label:32s} {sec * 1e3:8.1f} ms")
    for method, sec in report["draft_s"].items():
        print(f"  {'draft cycle, ' + method:32s} {sec * 1e3:8.1f} ms")
    if "profile" in report:
        prof = report["profile"]
        print(f"generation with {prof['method']} ({prof['tree']}):")
        for phase, sec in prof["per_cycle_s"].items():
            print(f"  {phase + ' per cycle':32s} {sec * 1e3:8.1f} ms")
        print(f"  plain decode step {prof['plain_step_s'] * 1e3:.1f} ms; a cycle costs "
              f"{prof['cycle_over_plain_step']:.2f} plain steps (break-even tau); tau "
              f"{prof['tau']:.2f} -> speedup {prof['speedup']:.2f}x "
              f"(identical output: {prof['identical_to_plain']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
