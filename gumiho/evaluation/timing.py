"""Per-phase cost of a speculative cycle on the current device, and the speedup it implies.

    python -m gumiho.evaluation.timing --target smollm2 [--methods gumiho,eagle2,medusa]
    python -m gumiho.evaluation.timing --shape llama3-8b --device cuda --engine graphs --json

`--shape` builds a random-weight stock Llama of that size (no weights needed), so a user
without the 8B checkpoint can see what an 8B cycle costs here. Reported, after warm-up and
with a device synchronisation around each timed call:

* a target step over K tree tokens on top of `--context` committed tokens (K = 1 is a plain
  decode step), through the chosen engine;
* per method, a profiled generation (random-weight drafter unless `--draft`): per cycle
  the drafter's catch-up on the accepted tokens, its serial draft levels, the MLP/Medusa
  heads, the rest of drafting (tree build), the verify step and accept/commit; the cycle
  in plain steps, and the projected speedup
  `tau * plain step / cycle` for `--tau` (default: the run's own tau when `--draft` is a
  trained drafter).

Greedy cycles sync the host once (the accept length); on CUDA the tool counts the implicit
syncs of an unprofiled run with CUDA's sync debug mode. The profiled run adds a sync
around each phase to attribute time. `--kernels N` adds, per method and for plain decoding,
the N kernels that take most device time a cycle and the device's busy time a cycle
(torch.profiler; on a CPU, torch operators by self time, which leaves out Python and
code outside torch's operators such as gumiho/rowgemm.c): what to shrink, and whether the
device or the host is what a cycle waits on.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from gumiho.budget import token_range, verify_step_seconds
from gumiho.config import MAX_TREE_SETTING, TreeConfig
from gumiho.drafters import PlainDrafter, load_drafter
from gumiho.engine import (
    GenerateConfig,
    context_length,
    run,
)
from gumiho.errors import (
    ArgumentParser,
    GumihoError,
    cli_errors,
    nonnegative_float,
    nonnegative_int,
    positive_int,
)
from gumiho.evaluation.profiling import (
    host_syncs_per_cycle,
    kernel_table,
    launches_per_cycle,
    tree_build_s,
)
from gumiho.flags import add_target_args, add_tree_args, tree_options
from gumiho.graphs import resolve_engine
from gumiho.methods import DRAFTER_METHODS, method_spec
from gumiho.target import Target, choose_device_dtype, load_target, wrap_target

# Stock Llama shapes for --shape (SmolLM2-135M's own config; Llama-3-8B's published one).
SHAPES = {
    "smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    rope_theta=100000.0, tie_word_embeddings=True),
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      rope_theta=500000.0, tie_word_embeddings=False),
}
PROMPT = "Explain in a few sentences why the sky is blue."


def shape_target(shape: str, device: str | None, dtype: str | None,
                 layers: int | None = None) -> Target:
    """A random-weight stock LlamaForCausalLM of a named shape, built on the device."""
    from transformers import LlamaForCausalLM

    config = shape_config(shape, layers)
    dev, torch_dtype = choose_device_dtype(device, dtype)
    default = torch.get_default_dtype()
    torch.manual_seed(0)
    try:
        torch.set_default_dtype(torch_dtype)
        with dev:
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    target = wrap_target(model.eval(), name=f"{shape} shape (random weights)")
    return target


def shape_config(shape: str, layers: int | None = None):
    """The LlamaConfig of a named shape (SHAPES), with `layers` decoder layers if given."""
    from transformers import LlamaConfig

    if shape not in SHAPES:
        raise GumihoError(f"unknown shape {shape!r}: use one of {', '.join(SHAPES)}")
    fields = dict(SHAPES[shape], max_position_embeddings=8192)
    if layers:
        fields["num_hidden_layers"] = layers
    return LlamaConfig(**fields, attn_implementation="sdpa")


def prompt_ids(target: Target, context: int) -> list[int]:
    if target.tokenizer is not None:
        return target.chat_ids(PROMPT)
    return torch.randint(*token_range(target), (context,),
                         generator=torch.Generator().manual_seed(0), device="cpu").tolist()


def cycle_breakdown(target: Target, method: str, draft: str, engine: str, context: int,
                    max_new_tokens: int, draft_vocab: int = 0, kernels: int = 0,
                    plain_counts: dict | None = None, **tree_opts) -> dict:
    """Per-cycle phase costs of a profiled generation of `method`, and of plain decoding
    on the same prompt through the same engine; then both again unprofiled (a profiled
    phase ends in a device sync, which on a GPU empties the queue between phases).
    plain_counts: plain decoding's kernel count and table, filled by the first method
    and reused by the rest (they do not depend on the method; its times are retaken
    beside each method, since the machine's speed drifts)."""
    plain_counts = {} if plain_counts is None else plain_counts
    tree = TreeConfig.for_method(method, **tree_opts)
    drafter = load_drafter(method, target, draft, tree=tree, engine=engine,
                           random_vocab=draft_vocab)
    ids = prompt_ids(target, context)
    config = GenerateConfig(max_new_tokens=max_new_tokens, profile=True, engine=engine)
    for d in (drafter, PlainDrafter()):  # warm-up: captures every step shape
        run(target, d, ids, GenerateConfig(max_new_tokens=16, engine=engine))
    fast = run(target, drafter, ids, config)
    plain = run(target, PlainDrafter(), ids, config)
    cycles = max(fast.cycles - 1, 1)  # the prefill is not a cycle
    phases = {k: v / cycles for k, v in fast.phase_s.items() if k != "prefill"}
    inner = [phases[p] for p in ("draft_catchup", "draft_serial", "draft_heads") if p in phases]
    if inner:  # eager steps; a recorded drafting step is one phase (serial_drafter.py)
        phases["draft_tree"] = max(phases.get("draft", 0.0) - sum(inner), 0.0)
    cycle = phases["draft"] + phases["verify"] + phases["accept_commit"]
    plain_cycles = max(plain.cycles - 1, 1)
    plain_step = (plain.phase_s["verify"] + plain.phase_s["accept_commit"]
                  + plain.phase_s.get("draft", 0.0)) / plain_cycles
    wall_cycle = unprofiled_cycle_s(target, drafter, ids, engine, max_new_tokens)
    wall_plain = unprofiled_cycle_s(target, PlainDrafter(), ids, engine, max_new_tokens)
    return {"method": method, "draft": draft, "draft_vocab": draft_vocab or None,
            "tree": vars(tree), "per_cycle_s": phases,
            "cycle_s": cycle, "plain_step_s": plain_step,
            "cycle_over_plain_step": cycle / plain_step, "tau": fast.tau,
            # what the projection wants: tokens per verify cycle, the prefill's left out as
            # its cycle's time is (`tau` counts the prefill as a cycle of one token)
            "tokens_per_verify": (fast.new_tokens - 1) / cycles,
            "unprofiled": {"cycle_s": wall_cycle, "plain_step_s": wall_plain,
                           "cycle_over_plain_step": wall_cycle / wall_plain},
            "host_syncs_per_cycle": host_syncs_per_cycle(target, drafter, ids, engine,
                                                         max_new_tokens),
            **launch_counts(target, drafter, ids, engine, max_new_tokens, plain_counts),
            "tree_build_s": tree_build_s(target, drafter, ids, engine),
            "identical_to_plain": fast.token_ids == plain.token_ids,
            **({"kernels": kernel_table(target, drafter, ids, engine, max_new_tokens, kernels),
                "plain_kernels": once(plain_counts, "plain_kernels", lambda: kernel_table(
                    target, PlainDrafter(), ids, engine, max_new_tokens, kernels))}
               if kernels else {})}


def once(memo: dict, key: str, make):
    """memo[key], made by `make` the first time."""
    if key not in memo:
        memo[key] = make()
    return memo[key]


def launch_counts(target: Target, drafter, ids: list[int], engine: str,
                  max_new_tokens: int, plain_counts: dict) -> dict:
    """Kernels per cycle launched outside recorded steps (by module) and run inside them,
    and the same for plain decoding's step: on a GPU the first cost the host, the second
    the device (a small model's recorded step costs about what its kernels number)."""
    outside, inside = launches_per_cycle(target, drafter, ids, engine, max_new_tokens)
    # eager steps record nothing: plain decoding's count is 0 too, without a counted run
    plain_inside = once(plain_counts, "plain_kernels_in_steps", lambda: launches_per_cycle(
        target, PlainDrafter(), ids, engine, max_new_tokens)[1]) if inside else 0.0
    return {"launches_per_cycle": outside, "kernels_in_steps_per_cycle": inside,
            "plain_kernels_in_steps": plain_inside}


def unprofiled_cycle_s(target: Target, drafter, ids: list[int], engine: str,
                       max_new_tokens: int, repeats: int = 3) -> float:
    """Wall seconds per cycle past the prefill, best of `repeats`: a generation's wall time
    less that of one that stops after its prefill (the drafter's first catch-up included),
    over its cycles."""
    def wall(n: int) -> tuple[float, int]:
        best = min((run(target, drafter, ids, GenerateConfig(max_new_tokens=n, engine=engine))
                    for _ in range(repeats)), key=lambda r: r.wall_s)
        return best.wall_s, best.cycles

    prefill_s, _ = wall(1)
    total_s, cycles = wall(max_new_tokens)
    return max(total_s - prefill_s, 0.0) / max(cycles - 1, 1)


def projected_speedup(tau: float, plain_step_s: float, cycle_s: float) -> float:
    """Tokens/s of speculative decoding over plain decoding: tau tokens per cycle."""
    return tau * plain_step_s / cycle_s


def widths_arg(value: str) -> list[int]:
    """argparse type: comma-separated tree widths, each 1..MAX_TREE_SETTING."""
    parts = [w.strip() for w in value.split(",") if w.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"expected widths like 1,8,16, got {value!r}")
    widths = []
    for part in parts:
        if not part.isdigit() or not 1 <= int(part) <= MAX_TREE_SETTING:
            raise argparse.ArgumentTypeError(f"each width must be an integer from 1 to "
                                             f"{MAX_TREE_SETTING}, got {part!r} in {value!r}")
        widths.append(int(part))
    return widths


def methods_arg(value: str) -> list[str]:
    """argparse type: comma-separated drafting methods (empty: none)."""
    methods = [m.strip() for m in value.split(",") if m.strip()]
    for method in methods:
        if method not in DRAFTER_METHODS:
            raise argparse.ArgumentTypeError(f"unknown method {method!r}: use "
                                             f"{','.join(DRAFTER_METHODS)}")
    return methods


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python -m gumiho.evaluation.timing",
                            description=__doc__.split("\n")[0])
    add_target_args(parser)
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None,
                        help="time a random-weight Llama of this shape instead of --target")
    parser.add_argument("--layers", type=positive_int, default=None,
                        help="with --shape: fewer layers (to fit a small machine)")
    parser.add_argument("--widths", type=widths_arg, default=[1, 8, 16, 32, 64],
                        help="tree widths to time, e.g. 1,8,16,32,64")
    parser.add_argument("--methods", type=methods_arg, default=[],
                        help="cycles to profile, e.g. gumiho,eagle2")
    parser.add_argument("--draft", default="random",
                        help="drafter dir for a single --methods entry (default: random)")
    parser.add_argument("--tau", type=nonnegative_float, default=None,
                        help="tau for the projected speedup, tokens per verify cycle "
                        "(default: the run's own, its prefill's token and cycle left out)")
    parser.add_argument("--context", type=positive_int, default=128,
                        help="committed tokens in cache")
    parser.add_argument("--repeats", type=positive_int, default=10)
    parser.add_argument("--max-new-tokens", type=positive_int, default=64,
                        help="tokens per profiled generation")
    parser.add_argument("--draft-vocab", type=nonnegative_int, default=0,
                        help="with --draft random: a draft vocabulary of N tokens (what a "
                        "reduced one saves; 0 = the target's whole vocabulary)")
    parser.add_argument("--kernels", type=nonnegative_int, default=0,
                        help="also list the N kernels (CPU: operators) that take most of a "
                        "cycle's device time, and the device's busy time per cycle, for each "
                        "method and plain decoding (torch.profiler; 0 = off)")
    parser.add_argument("--json", action="store_true")
    add_tree_args(parser)
    return parser


def check_room(target: Target, args: argparse.Namespace, methods: list[str]) -> None:
    """The timed contexts fit the target's positions."""
    limit = context_length(target)
    if limit is None:
        return
    widest = max(args.widths) if args.widths else 0
    if args.context + widest > limit:
        raise GumihoError(f"--context {args.context} + width {widest} exceeds the target's "
                          f"context of {limit} tokens: use smaller values")
    if methods and args.max_new_tokens + args.context > limit:
        raise GumihoError(f"--max-new-tokens {args.max_new_tokens} is too large for the "
                          f"target's context of {limit} tokens")


def method_options(method: str, options: dict) -> dict:
    """The tree flags that apply to `method` (the rest concern other --methods)."""
    used = {k: v for k, v in options.items() if k in method_spec(method).tree_flags}
    if used.get("total_tokens") == "auto":
        raise GumihoError("timing takes a number for --total-tokens, not auto")
    return used


@cli_errors
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    methods = args.methods
    if args.draft != "random" and len(methods) != 1:
        raise GumihoError("--draft DIR goes with exactly one --methods entry")
    if args.draft_vocab and args.draft != "random":
        raise GumihoError("--draft-vocab goes with --draft random (a trained drafter keeps "
                          "its own vocabulary)")
    options = tree_options(args)
    for name, value in options.items():
        if value is not None and not any(name in method_spec(m).tree_flags for m in methods):
            raise GumihoError(f"--{name.replace('_', '-')} applies to none of --methods "
                              f"{','.join(methods) or '(none)'}")
    per_method = {m: method_options(m, options) for m in methods}
    for method in methods:  # bad tree settings fail before the model loads
        TreeConfig.for_method(method, **per_method[method])
    if args.layers and not args.shape:
        raise GumihoError("--layers goes with --shape")
    torch.manual_seed(0)
    if args.shape:
        target = shape_target(args.shape, args.device, args.dtype, args.layers)
    else:
        target = load_target(args.target, device=args.device, dtype=args.dtype,
                             attn_implementation=args.attention)
    engine = resolve_engine(args.engine, target.device)
    check_room(target, args, methods)
    report = {"target": target.name, "device": str(target.device),
              "device_name": (torch.cuda.get_device_name(target.device)
                              if target.device.type == "cuda" else "cpu"),
              "dtype": str(target.dtype), "engine": engine, "context": args.context,
              "torch": torch.__version__, "verify_s": {}, "cycles": {}}
    for width in args.widths:
        report["verify_s"][width] = verify_step_seconds(target, width, args.context,
                                                        args.repeats, engine)
    plain_counts: dict = {}  # plain decoding's kernel counts: made once, for every method
    for method in methods:
        TreeConfig.for_method(method, **per_method[method]).check_vocab(
            target.lm_head.weight.shape[0])
        cycle = cycle_breakdown(target, method, args.draft, engine, args.context,
                                args.max_new_tokens, args.draft_vocab, args.kernels,
                                plain_counts, **per_method[method])
        tau = args.tau if args.tau is not None else cycle["tokens_per_verify"]
        wall = cycle["unprofiled"]
        cycle["projected"] = {"tau": tau, "speedup": projected_speedup(
            tau, wall["plain_step_s"], wall["cycle_s"])}
        report["cycles"][method] = cycle
    if args.json:
        print(json.dumps(report))
        return 0
    print_report(report)
    return 0


def print_report(report: dict) -> None:
    print(f"{report['target']} on {report['device_name']} ({report['dtype']}), engine "
          f"{report['engine']}, context {report['context']}")
    for width, sec in report["verify_s"].items():
        label = "plain decode step" if width == 1 else f"verify step, {width} tree tokens"
        print(f"  {label:34s} {sec * 1e3:8.2f} ms")
    for method, cycle in report["cycles"].items():
        print(f"{method} cycle ({cycle['draft']} drafter, {cycle['tree']['total_tokens']} "
              "tokens), per cycle:")
        for phase in ("draft_catchup", "draft_serial", "draft_heads", "draft_tree", "draft",
                      "verify", "accept_commit"):
            if phase in cycle["per_cycle_s"]:
                label = {"draft": "draft (total)" if "draft_tree" in cycle["per_cycle_s"]
                         else "draft (one recorded step)"}.get(phase, phase)
                print(f"  {label:34s} {cycle['per_cycle_s'][phase] * 1e3:8.2f} ms")
        if cycle.get("tree_build_s") is not None:
            print(f"  {'tree building, as a step alone':34s} {cycle['tree_build_s'] * 1e3:8.2f} ms")
        launches = cycle["launches_per_cycle"]
        detail = ", ".join(f"{m} {n:.0f}" for m, n in list(launches.items())[:5])
        print(f"  {'kernel launches per cycle':34s} {sum(launches.values()):8.0f}  ({detail})")
        if cycle.get("kernels_in_steps_per_cycle"):
            print(f"  {'kernels inside recorded steps':34s} "
                  f"{cycle['kernels_in_steps_per_cycle']:8.0f}  (a plain step: "
                  f"{cycle['plain_kernels_in_steps']:.0f})")
        if cycle["host_syncs_per_cycle"] is not None:
            print(f"  {'host syncs per cycle':34s} {cycle['host_syncs_per_cycle']:8.2f}")
        proj, wall = cycle["projected"], cycle["unprofiled"]
        print(f"  profiled: cycle {cycle['cycle_s'] * 1e3:.2f} ms = "
              f"{cycle['cycle_over_plain_step']:.2f} plain steps "
              f"({cycle['plain_step_s'] * 1e3:.2f} ms)")
        print(f"  unprofiled: cycle {wall['cycle_s'] * 1e3:.2f} ms = "
              f"{wall['cycle_over_plain_step']:.2f} plain steps "
              f"({wall['plain_step_s'] * 1e3:.2f} ms); at tau {proj['tau']:.2f} the speedup "
              f"is {proj['speedup']:.2f}x (output identical to plain: "
              f"{cycle['identical_to_plain']})")
        for label, table in (("", cycle.get("kernels")), ("plain ", cycle.get("plain_kernels"))):
            if table:
                print_kernels(label, table, wall["plain_step_s" if label else "cycle_s"])


def print_kernels(label: str, table: dict, wall_s: float) -> None:
    print(f"  {label}busy ({table['what']}) {table['busy_s'] * 1e3:.2f} ms a cycle of its "
          f"unprofiled {wall_s * 1e3:.2f} ms; the most per cycle:")
    for row in table["top"]:
        name = row["name"] if len(row["name"]) <= 70 else row["name"][:67] + "..."
        print(f"    {row['s'] * 1e3:7.3f} ms {row['calls']:6.1f} calls  {name}")


if __name__ == "__main__":
    sys.exit(main())
