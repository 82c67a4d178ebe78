"""Decoding on the CPU with one of our CPU paths on and off, in one process, alternating:
verify steps by width, then whole greedy answers, plain and with a drafter, with the
row-invariant attention both sides.

    python scripts/cpu_ab.py [--switch rowamx|fused|wide|rowlayer|lean|tiles|head16]
                             [--dtype bfloat16|float32]
                             [--widths 1,8,16,64] [--rounds 3] [--new-tokens 96]
                             [--method gumiho] [--total-tokens 8] [--depth 2]
                             [--lookup 10] [--min-confidence 0] [--prompts 4]
                             [--bench mt_bench] [--steps-only]

--switch rowamx (bf16 on an AMX CPU): rowamx.c's products against oneDNN's (rowamx.py);
--switch fused: the target's decoder computed by fused.py against transformers' own
(`GUMIHO_FUSED=0`), the same bits; --switch wide (float32 on an AVX-512 CPU): rowgemm.c's
AVX-512 blocks against its AVX2 ones (`GUMIHO_ROWGEMM512=0`), the same bits; --switch
rowlayer: the target's and the drafter's steps in one rowlayer.c call against fused.py's
torch calls (`GUMIHO_ROWLAYER=0`; two roundings of their own, so the answers may part at
near-ties, each copy's plain and speculative ones still equal); --switch lean: the eager
CPU cycle's small-tree paths (a depth-1 tree's fixed shape, tree.Star; greedy acceptance
in Python, sampling.match_on_host) against the general selection and match_picks
(`engine.HOST_MATCH`, `SerialDrafter.star_trees`; both sides pick with rowgemm.c's argmax
since aa2d97a), the same trees and tokens; --switch tiles (bf16 on an AMX CPU):
rowattention.c's bf16 attention on AMX tiles (rowamx.c) against its FMAs (`GUMIHO_ROWATTN_AMX=0`;
they round otherwise, so the answers may part at near-ties, each side's plain and
speculative ones still equal); --switch head16 (float32): the drafter's vocabulary head
from its 16-bit copy (`rowgemm.drafting_copy`) against its float32 weight, the target's
side untouched (each side's answers equal plain decoding's; their drafts may part at a
near-tie of the head's logits). Loads SmolLM2 and the shipped drafter twice, once as
`load_target` leaves them and once with the path switched off (wide, lean and tiles: once,
switched before each use). The prompts: the demo's and the first questions of --bench
(mt_bench; cnndm_like for long ones). Per round: each width's verify step on the copies
alternated call by call (--repeats each), then each prompt answered plainly and by the
method on each copy in turn (--steps-only: no answers). Prints the median step per width,
each copy's tokens/s and speedup over its own plain decoding, whether every answer of each
copy equals its plain decoding's, and the median plain step and cycle after the prefill
(robust to a burst of load).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere

from gumiho import engine as loop  # noqa: E402
from gumiho import rowamx, rowgemm  # noqa: E402
from gumiho.budget import verify_step  # noqa: E402
from gumiho.config import TreeConfig  # noqa: E402
from gumiho.demo import PROMPT, shipped_drafter  # noqa: E402
from gumiho.drafters import PlainDrafter, load_drafter  # noqa: E402
from gumiho.engine import GenerateConfig, run  # noqa: E402
from gumiho.evaluation.benchmarks import load_questions  # noqa: E402
from gumiho.profiling import seconds  # noqa: E402
from gumiho.target import load_target  # noqa: E402


@contextmanager
def rowlayer_off():
    """rowlayer.c's steps off while a target and drafter load (their decoders then make
    fused.py's torch calls)."""
    saved = os.environ.get("GUMIHO_ROWLAYER")
    os.environ["GUMIHO_ROWLAYER"] = "0"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["GUMIHO_ROWLAYER"]
        else:
            os.environ["GUMIHO_ROWLAYER"] = saved


@contextmanager
def rowamx_off():
    """rowamx.c unavailable while a target and drafter load (their layers and heads then
    keep oneDNN's products only)."""
    kernel = rowamx.kernel
    rowamx.kernel = lambda: None
    try:
        yield
    finally:
        rowamx.kernel = kernel


def loaded(method: str, tree: TreeConfig, dtype: str, fused: bool = True):
    """(target, drafter) in `dtype` with the row-invariant attention; the lm_head prepared;
    fused: the target's decoder by fused.py (where it applies) or transformers'."""
    target = load_target("smollm2", device="cpu", dtype=dtype,
                         attn_implementation="sdpa_invariant")
    target._packed_head  # noqa: B018 - prepared now, under the caller's switch
    target._fused  # noqa: B018 - the same
    if not fused:
        target.__dict__["_fused"] = None  # the cached property, settled to "none"
    return target, load_drafter(method, target, str(shipped_drafter(method)), tree=tree)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--switch", choices=("rowamx", "fused", "wide", "rowlayer", "lean",
                                             "tiles", "head16"),
                        default="rowamx")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--widths", default="1,8,16,64")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--method", default="gumiho")
    parser.add_argument("--total-tokens", type=int, default=8)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--lookup", type=int, default=10)
    parser.add_argument("--min-confidence", type=float, default=0.0,
                        help="the drafts' confidence floor (the float32 demo's: 0.1)")
    parser.add_argument("--prompts", type=int, default=4,
                        help="the demo's prompt and the first --bench questions, this many")
    parser.add_argument("--bench", default="mt_bench")
    parser.add_argument("--steps-only", action="store_true",
                        help="the verify steps alone, no answers")
    args = parser.parse_args(argv)
    if args.prompts < 1:  # [:prompts - 1] of the questions: 0 took all but the last
        parser.error("--prompts: at least 1 (the demo's prompt)")
    if args.switch == "rowamx" and (rowamx.kernel() is None or args.dtype != "bfloat16"):
        raise SystemExit("error: rowamx.c runs bf16 products on AMX tiles: --dtype bfloat16 "
                         "on a CPU with them (and a compiler that knows them)")
    if args.switch == "tiles" and (not rowgemm.set_tiled_attention(True)
                                   or args.dtype != "bfloat16"):
        raise SystemExit("error: rowattention.c runs a bf16 cache's attention on AMX tiles: "
                         "--dtype bfloat16 on a CPU with them (and not GUMIHO_ROWATTN_AMX=0)")
    if args.switch == "wide" and (not rowgemm.set_wide(True) or args.dtype != "float32"):
        raise SystemExit("error: rowgemm.c's AVX-512 blocks run float32 products: --dtype "
                         "float32 on a CPU with AVX-512 (and not GUMIHO_ROWGEMM512=0)")
    tree = TreeConfig.for_method(args.method, total_tokens=args.total_tokens,
                                 depth=args.depth, lookup=args.lookup,
                                 lookup_first=bool(args.lookup),
                                 min_confidence=args.min_confidence)
    if args.switch == "rowamx":
        copies = {"rowamx": loaded(args.method, tree, args.dtype)}
        with rowamx_off():
            copies["oneDNN"] = loaded(args.method, tree, args.dtype)
    elif args.switch == "rowlayer":
        copies = {"rowlayer": loaded(args.method, tree, args.dtype)}
        with rowlayer_off():
            copies["fused.py"] = loaded(args.method, tree, args.dtype)
        if copies["rowlayer"][0]._fused.rows is None:
            raise SystemExit("error: rowlayer.c does not run here (GUMIHO_ROWLAYER=0?)")
    elif args.switch == "wide":
        copies = dict.fromkeys(("AVX-512", "AVX2"), loaded(args.method, tree, args.dtype))
    elif args.switch == "tiles":
        copies = dict.fromkeys(("AMX tiles", "FMAs"), loaded(args.method, tree, args.dtype))
    elif args.switch in ("lean", "head16"):  # one copy, switched before each use (as wide)
        names = ("lean", "general") if args.switch == "lean" else ("16-bit head", "float32")
        copies = dict.fromkeys(names, loaded(args.method, tree, args.dtype))
        serial = copies[names[0]][1]
        while hasattr(serial, "inner"):  # a lookup chain or a gate around it
            serial = serial.inner
        if args.switch == "head16":
            t = copies[names[0]][0]
            run(t, serial, t.chat_ids(PROMPT), GenerateConfig(max_new_tokens=2))  # its head
            short = serial.head.short
            if short is None:
                raise SystemExit("error: the drafter's head keeps no 16-bit copy here (a "
                                 "float32 target on a CPU with rowgemm.c has one)")
    else:
        copies = {"fused": loaded(args.method, tree, args.dtype),
                  "transformers": loaded(args.method, tree, args.dtype, fused=False)}
        if copies["fused"][0]._fused is None:
            raise SystemExit("error: fused.py does not run here (GUMIHO_FUSED=0?)")
    target = next(iter(copies.values()))[0]
    questions = [PROMPT] + [q["turns"][0] for q in load_questions(args.bench)][:args.prompts - 1]
    prompts = [target.chat_ids(q) for q in questions]
    widths = [int(w) for w in args.widths.split(",")]
    config = GenerateConfig(max_new_tokens=args.new_tokens)
    steps: dict[tuple[int, str], list[float]] = {}
    answers: dict[tuple[str, str], list] = {}
    def use(name: str):
        """the copy `name`, its switch set (wide: the one loaded copy's blocks)"""
        if args.switch == "wide":
            rowgemm.set_wide(name == "AVX-512")
        elif args.switch == "tiles":
            rowgemm.set_tiled_attention(name == "AMX tiles")
        elif args.switch == "lean":  # a generation's `begin` makes the star or drops it
            loop.HOST_MATCH = serial.star_trees = name == "lean"
        elif args.switch == "head16":
            serial.head.short = short if name == "16-bit head" else None
        return copies[name]

    for name in copies:  # warm-up
        t, d = use(name)
        run(t, d, prompts[0], GenerateConfig(max_new_tokens=8))
    calls = {}
    for width in widths:  # each copy's step over the same kind of tree (warmed up)
        for name in copies:
            t, _ = use(name)
            calls[width, name] = verify_step(t, width, args.context)
            calls[width, name]()
    for _ in range(args.rounds):
        for width in widths:  # the copies' steps alternated call by call
            for _ in range(args.repeats):
                for name in copies:
                    t, _ = use(name)
                    ms = seconds(calls[width, name], t.device) * 1e3
                    steps.setdefault((width, name), []).append(ms)
        if args.steps_only:
            continue
        for i, ids in enumerate(prompts):
            order = list(copies)[i % 2:] + list(copies)[:i % 2]  # each copy first in turn
            for name in order:
                t, d = use(name)
                for kind, drafter in (("plain", PlainDrafter()), (args.method, d)):
                    answers.setdefault((name, kind), []).append(run(t, drafter, ids, config))
    first, second = copies
    print(f"SmolLM2 {args.dtype}, sdpa_invariant, {args.rounds} rounds, context {args.context}")
    print(f"| tree tokens | {first} ms | {second} ms | {first} / {second} |\n|---|---|---|---|")
    for width in widths:
        a, b = (statistics.median(steps[(width, n)]) for n in copies)
        print(f"| {width} | {a:.1f} | {b:.1f} | {a / b:.2f} |")
    if args.steps_only:
        return 0
    print(f"\n{len(prompts)} prompts x {args.rounds} rounds, {args.new_tokens} new tokens, "
          f"{args.method} at {args.total_tokens} tokens, depth {args.depth}, lookup "
          f"{args.lookup}")
    print(f"| {args.switch} | plain tokens/s | method tokens/s | speedup | tau | identical | "
          "plain step ms | cycle ms |\n|---|---|---|---|---|---|---|---|")
    for name in copies:
        plain, fast = answers[(name, "plain")], answers[(name, args.method)]
        rate = [sum(r.new_tokens for r in rs) / sum(r.wall_s for r in rs) for rs in (plain, fast)]
        tau = sum(r.new_tokens for r in fast) / sum(r.cycles for r in fast)
        same = sum(p.token_ids == f.token_ids for p, f in zip(plain, fast, strict=True))
        # the median cycle after the prefill: robust to a burst of load on a shared machine
        step, cycle = (statistics.median(c for r in rs for c in r.cycle_s[1:]) * 1e3
                       for rs in (plain, fast))
        print(f"| {name} | {rate[0]:.1f} | {rate[1]:.1f} | {rate[1] / rate[0]:.2f}x | "
              f"{tau:.2f} | {same}/{len(fast)} | {step:.2f} | {cycle:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
