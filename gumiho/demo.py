"""`gumiho demo`: the embedded default, SmolLM2-135M-Instruct with the Gumiho drafter
shipped for it, on the CPU. Streams an answer, then decodes the same prompt plainly and
prints tau, tokens/s and the speedup (greedy: in float32, and in bfloat16 with the
row-invariant attention on a CPU with AMX, both outputs must be identical).

The speedup is timed side by side: `--rounds` times the speculative and the plain decode
alternately (neither streams), and the median of the rounds' ratios is the figure, so a
burst of load on a shared machine moves one round, not the result."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import torch

from gumiho.attention import SDPA_INVARIANT, invariant_here
from gumiho.budget import chosen_row
from gumiho.config import DEMO_EXTEND, DEMO_FLOOR, DEMO_LOOKUP
from gumiho.drafters import PlainDrafter
from gumiho.engine import GenerateConfig, run
from gumiho.errors import (
    ArgumentParser,
    GumihoError,
    cli_errors,
    nonnegative_int,
    positive_int,
    probability_arg,
)
from gumiho.flags import total_tokens_arg
from gumiho.generate import SpeculativeGenerator, check_context_room
from gumiho.graphs import ENGINES
from gumiho.linear import rows_independent
from gumiho.methods import DRAFTER_METHODS
from gumiho.rowamx import amx_cpu
from gumiho.target import ATTENTION_CHOICES, choose_device_dtype

log = logging.getLogger("gumiho")
SHIPPED = Path(__file__).parent / "assets" / "smollm2"
PROMPT = "Explain in a few sentences why the sky is blue."


def exact_bf16_here(device: torch.device) -> bool:
    """Whether the demo's default on `device` is bfloat16 with the row-invariant attention:
    a CPU with AMX, whose bf16 products give each of a verify's rows what it gets alone.
    There a bf16 verify of 8-16 tokens costs about one plain step, and the output is bf16
    plain decoding's bit for bit (docs/cpu_costs.md, Exact bfloat16 on a CPU); elsewhere float32."""
    return (device.type == "cpu" and amx_cpu() and rows_independent(torch.bfloat16)
            and invariant_here(torch.bfloat16))


def exact_bf16_default(args) -> bool:
    """With --dtype ($GUMIHO_DTYPE) and --attention unset on a CPU with AMX, set them to
    bfloat16 and the row-invariant attention, as the demo runs (`gumiho demo`, `serve`,
    `chat`), and say so; True if it did."""
    device, _ = choose_device_dtype(args.device, args.dtype)
    asked = args.dtype or os.environ.get("GUMIHO_DTYPE")  # the user's dtype wins, either way
    if asked or args.attention is not None or not exact_bf16_here(device):
        return False
    args.dtype, args.attention = "bfloat16", SDPA_INVARIANT
    log.info("this CPU has AMX: bfloat16 with the row-invariant attention, whose output is "
             "bf16 plain decoding's bit for bit (--dtype float32 for float32)")
    return True


def shipped_drafter(method: str = "gumiho") -> Path:
    path = SHIPPED / method
    if not (path / "model.safetensors").exists():
        raise GumihoError(f"no shipped {method} drafter at {path}: reinstall the package")
    return path


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="gumiho demo", description=__doc__.split("\n")[0])
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--max-new-tokens", type=positive_int, default=160)
    p.add_argument("--method", default="gumiho", choices=DRAFTER_METHODS)
    # unset, these take the `demo` preset's values (config.preset_options), as
    # `gumiho generate --preset demo` does
    p.add_argument("--total-tokens", type=total_tokens_arg, default=None,
                   help="verified tokens per cycle, or auto (default): the size that is "
                   "fastest on this device for this drafter, measured once and cached")
    p.add_argument("--lookup", type=nonnegative_int, default=None,
                   help=f"prompt-lookup candidates (default {DEMO_LOOKUP}: n-gram "
                   "continuations of the text so far, verified like any node; a cycle that "
                   "finds one verifies it instead of drafting on the eager engine, beside the "
                   "draft after one whose first token was wrong; 0 = the "
                   "drafter alone)")
    p.add_argument("--min-confidence", type=probability_arg, default=None,
                   help="gumiho, eagle2: verify only drafts the drafter gives at least this "
                   "path probability; a cycle whose first draft falls short is a plain step "
                   f"(default {DEMO_FLOOR} in float32, measured on a 2-core CPU, else 0; "
                   "0 = off)")
    p.add_argument("--extend-confidence", type=probability_arg, default=None,
                   help="gumiho, eagle2: run a deeper drafter level only below a node of at "
                   f"least this path probability (default {DEMO_EXTEND} in float32, else "
                   "0; 0 = the --min-confidence floor)")
    p.add_argument("--rounds", type=positive_int, default=5,
                   help="speculative and plain decodes timed alternately this many times "
                   "(default 5); the speedup is the median of their ratios")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU and on a CPU "
                   "with AMX (there with --attention sdpa_invariant, exact), else float32")
    p.add_argument("--engine", default=None, choices=ENGINES, help="default: graphs on a "
                   "GPU, eager on a CPU")
    p.add_argument("--attention", default=None, choices=ATTENTION_CHOICES,
                   help="the target's attention; sdpa_invariant: bf16 on a CPU gives plain "
                   "decoding's output bit for bit (docs/cpu_costs.md, bfloat16 on a CPU)")
    return p


def alternated_rounds(target, drafter, ids: list[int], config: GenerateConfig, rounds: int
                      ) -> list[tuple]:
    """(speculative, plain) results of `rounds` decodes of `ids` timed in turns, after a
    plain warm-up, sorted by their speedup (the median round is the demo's figure). Which
    of the two goes first alternates from round to round, so that whatever the machine
    does after one decode (a clock change, another process waking) falls on both."""
    run(target, PlainDrafter(), ids, GenerateConfig(max_new_tokens=8, engine=config.engine))
    pairs = []
    for turn in range(rounds):
        if turn % 2:
            plain = run(target, PlainDrafter(), ids, config)
            pairs.append((run(target, drafter, ids, config), plain))
        else:
            pairs.append((run(target, drafter, ids, config),
                          run(target, PlainDrafter(), ids, config)))
    return sorted(pairs, key=lambda pair: pair[0].tokens_per_s / pair[1].tokens_per_s)


def middle_round(rounds: list[tuple]) -> tuple:
    """The median of rounds sorted by speedup; of an even number the lower of the middle
    two, so that two rounds do not report the better one."""
    return rounds[(len(rounds) - 1) // 2]


def exact_here(target, tree) -> bool:
    """Whether the output must equal plain decoding's bit for bit, what "lossless"
    guarantees exactly (README): float32, or a row-invariant attention on a CPU whose
    products are row-independent for a verify's rows (bf16 on AMX: up to rowamx.MAX_ROWS
    with rowamx.c, 32 with oneDNN alone)."""
    widest = tree.total_tokens + tree.lookup  # the most rows a verify had
    invariant = (target.config._attn_implementation == SDPA_INVARIANT
                 and target.device.type == "cpu" and rows_independent(target.dtype, widest)
                 and invariant_here(target.dtype))
    return target.dtype == torch.float32 or invariant


@cli_errors
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.prompt.strip():  # before the slow load and tree-size calibration
        raise GumihoError("empty prompt: give some text to answer")
    check_context_room("smollm2", args.max_new_tokens)
    if exact_bf16_default(args):
        print("(this CPU has AMX: bfloat16 with the row-invariant attention, whose output is "
              "bf16 plain decoding's bit for bit; --dtype float32 for float32)")
    logging.basicConfig(level=logging.WARNING, format="gumiho: %(message)s")
    gen = SpeculativeGenerator.load("smollm2", args.method,
                                    str(shipped_drafter(args.method)), device=args.device,
                                    dtype=args.dtype, attention=args.attention,
                                    engine=args.engine, preset="demo",
                                    total_tokens=args.total_tokens, lookup=args.lookup,
                                    min_confidence=args.min_confidence,
                                    extend_confidence=args.extend_confidence)
    target, drafter, tree = gen.target, gen.drafter, gen.drafter.tree
    if gen.auto_report:
        _, best = chosen_row(gen.auto_report)
        kind = f"a chain of depth {best['depth']}" if best["chain"] else \
            f"{best['total_tokens']} tokens down to depth {best['depth']}"
        # its whole cycles were timed against plain steps: accepted tokens / cycle in steps
        speedup = best["accept"] / gen.auto_report["break_even"]
        print(f"(tree shape chosen for {target.device}: {kind}; expected "
              f"{best['accept']:.2f} tokens per cycle, {speedup:.2f}x plain)")
    ids = gen.prompt_ids(args.prompt)
    config = GenerateConfig(max_new_tokens=args.max_new_tokens, engine=gen.engine)
    run(target, drafter, ids, GenerateConfig(max_new_tokens=8, engine=gen.engine))  # warm-up
    print(f"> {args.prompt}\n")
    for piece in gen.stream(ids, args.max_new_tokens):
        print(piece, end="", flush=True)
    streamed = gen.last_result
    print("\n\n(decoding the same prompt plainly for comparison, alternating with the "
          f"drafter, {args.rounds} round{'s' if args.rounds > 1 else ''} ...)", flush=True)
    rounds = alternated_rounds(target, drafter, ids, config, args.rounds)
    fast, plain = middle_round(rounds)
    identical = all(f.token_ids == streamed.token_ids == p.token_ids for f, p in rounds)
    exact = exact_here(target, tree)
    if identical:
        same = "identical"
    elif exact:
        same = "DIFFERENT (a bug!)"
    else:
        same = (f"different: in {str(target.dtype).removeprefix('torch.')} a tree-shaped "
                "verify can break a near-tie of the top two logits otherwise than a one-token "
                "step (README, Lossless); --dtype float32 or --attention sdpa_invariant is "
                "exact")
    extra = f" + a prompt-lookup chain of up to {tree.lookup}" if tree.lookup else ""
    if tree.min_confidence and gen.engine == "eager":  # captured steps keep one shape
        extra += f", drafts of path probability >= {tree.min_confidence:g}"
    if tree.extend_confidence > tree.min_confidence and gen.engine == "eager":
        extra += f", deeper levels below >= {tree.extend_confidence:g}"
    print(f"\n{args.method} ({tree.total_tokens}-token tree of depth {tree.depth}{extra}, "
          f"fta {tree.fta}) on {target.device} in {str(target.dtype).removeprefix('torch.')}: "
          f"{fast.new_tokens} tokens, tau {fast.tau:.2f}, {fast.tokens_per_s:.1f} tokens/s")
    low, high = (f.tokens_per_s / p.tokens_per_s for f, p in (rounds[0], rounds[-1]))
    which = "median" if len(rounds) % 2 else "lower middle"
    spread = f" ({which} of {len(rounds)} alternated rounds, {low:.2f}x-{high:.2f}x)" \
        if len(rounds) > 1 else ""
    print(f"plain decoding: {plain.tokens_per_s:.1f} tokens/s -> speedup "
          f"{fast.tokens_per_s / plain.tokens_per_s:.2f}x{spread}; outputs {same}")
    return 0 if identical or not exact else 1


if __name__ == "__main__":
    sys.exit(main())
