"""The command line's shared flags: the target, the method and its drafter, the tree, and
the sampling settings, as `gumiho generate`, `serve`, `chat` and the evaluation take them
(each flag one field of TreeConfig, GenerateConfig or `SpeculativeGenerator.load`)."""

from __future__ import annotations

import argparse
import re

from gumiho.config import DEMO_EXTEND, DEMO_FLOOR, DEMO_LOOKUP, FTA_MODES, PRESETS
from gumiho.errors import (
    logit_bias_arg,
    nonnegative_float,
    nonnegative_int,
    nucleus_arg,
    penalty_arg,
    positive_float,
    positive_int,
    probability_arg,
    share_arg,
)
from gumiho.graphs import ENGINES
from gumiho.methods import METHODS
from gumiho.target import ATTENTION_CHOICES


def add_target_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="smollm2",
                        help="local Hugging Face model dir, 'smollm2' (the embedded default) "
                        "or 'gemma3-270m' (the second embedded target, a base model)")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: auto)")
    parser.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 "
                        "(default: float32 on CPU, bfloat16 on GPU)")
    parser.add_argument("--chat-template", default=None,
                        help="for tokenizers without one: 'vicuna' or a Jinja template")
    parser.add_argument("--attention", default=None, choices=ATTENTION_CHOICES,
                        help="the target's attention: sdpa (default), eager, or sdpa_invariant "
                        "(CPU: each row of a verify computed as in one-token decoding, so bf16 "
                        "output is bit for bit plain decoding's; slower verifies)")
    parser.add_argument("--engine", default=None, choices=ENGINES,
                        help="how steps run: eager, graphs (CUDA graphs), compile "
                        "(torch.compile) or static (a replay's data flow without capture, "
                        "for checks on a CPU); default graphs on a GPU, eager on a CPU")


def add_preset_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=PRESETS, default=None,
                        help="demo: what `gumiho demo` runs, for speed on this device "
                        f"(--total-tokens auto, --lookup {DEMO_LOOKUP} --lookup-first, in "
                        f"float32 --min-confidence {DEMO_FLOOR} --extend-confidence "
                        f"{DEMO_EXTEND}; flags given win); default: the method's reference "
                        "tree")


def add_tree_args(parser: argparse.ArgumentParser) -> None:
    """TreeConfig fields as flags; unset ones take the method's reference defaults."""
    group = parser.add_argument_group("draft tree (defaults: the method's reference settings)")
    group.add_argument("--total-tokens", type=total_tokens_arg,
                       help="verified tokens incl. the root (gumiho 64, eagle2 60, medusa 64), "
                       "or 'auto': time this device and the drafter and pick the fastest tree "
                       "shape (size, depth, or a chain) within the reference, or past it with "
                       "a wider beam where a verify there costs little, e.g. a GPU (cached)")
    group.add_argument("--top-k", type=positive_int, help="beam width at serial levels (gumiho 14, "
                       "eagle2 10)")
    group.add_argument("--mlp-topk", type=positive_int,
                       help="candidates per node at MLP levels (35)")
    group.add_argument("--pruning", type=positive_int, help="nodes kept per MLP level (35)")
    group.add_argument("--depth", type=positive_int, help="draft depth: gumiho 2 serial levels + "
                       "MLP levels (7; 1: serial level 1 alone), eagle2 serial levels (6), "
                       "medusa tree depth (4); past the drafter's heads, a note and "
                       "its deepest")
    group.add_argument("--serial-levels", type=positive_int,
                       help="gumiho: levels the serial head drafts before the MLP heads (2, "
                       "the paper's; S > 2: levels 3..S from serial steps too, MLP head j still "
                       "drawing level j + 2)")
    group.add_argument("--lookup", type=nonnegative_int, help="add a prompt-lookup chain of this "
                       "many n-gram continuation tokens under the root (method lookup: 10)")
    group.add_argument("--lookup-first", action="store_const", const=True, default=None,
                       help="with --lookup: when the n-gram index finds a continuation, verify "
                       "it alone and skip the drafter that cycle, unless the last continuation "
                       "found guessed the next token wrong: then its first 2 tokens go beside "
                       "the drafter's tree (eager engine)")
    group.add_argument("--draft-gate", type=nonnegative_float, help="take a plain step instead "
                       "of drafting while this sequence's drafter cycles emit fewer tokens than "
                       "this (the break-even: a drafter cycle's cost in plain steps; eager "
                       "engine; --total-tokens auto logs it for its shape; 0 = off, default)")
    group.add_argument("--min-confidence", type=probability_arg,
                       help="gumiho, eagle2: verify only draft nodes whose path probability "
                       "under the drafter reaches this, and draft no deeper once none does; "
                       "a cycle whose first draft token falls short is a plain step (eager "
                       "engine; 0 = off, default)")
    group.add_argument("--extend-confidence", type=probability_arg,
                       help="gumiho, eagle2: run a deeper drafter level (a serial step, the "
                       "MLP heads) only below a node whose path probability reaches this; "
                       "the first draft token still takes --min-confidence (eager engine; "
                       "0 = the --min-confidence floor, default)")
    group.add_argument("--fta", choices=FTA_MODES, help="Full Tree Attention (gumiho): off "
                       "(plain dynamic tree, default), exact (lossless path completion), or "
                       "official (the released splice: APPROXIMATE, not lossless)")


def total_tokens_arg(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'auto', got {value!r}") from None
    if number < 2:
        raise argparse.ArgumentTypeError(f"expected at least 2 (the root and one draft), "
                                         f"got {value!r}")
    return number


def stop_arg(value: str) -> str:
    """--stop's text, with \\n, \\t and \\\\ read as a newline, a tab and a backslash."""
    text = re.sub(r"\\([nt\\])", lambda m: {"n": "\n", "t": "\t", "\\": "\\"}[m.group(1)],
                  value)
    if not text:
        raise argparse.ArgumentTypeError("expected some text to stop at, got ''")
    return text


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    """--temperature, --sample-top-k, --top-p, --min-p, the three penalties, --ignore-eos
    and --seed
    (GenerateConfig's fields; `sampling_settings` reads them back)."""
    parser.add_argument("--temperature", type=nonnegative_float, default=0.0,
                        help="0 = greedy (default); above it the target samples")
    parser.add_argument("--sample-top-k", type=nonnegative_int, default=0,
                        help="sampling: from the target's k likeliest tokens only (0 = all, "
                        "default; --top-k is the tree's drafts per level)")
    parser.add_argument("--top-p", type=nucleus_arg, default=1.0,
                        help="sampling: from the target's nucleus, its likeliest tokens "
                        "holding this share of the probability (1.0 = all, default)")
    parser.add_argument("--min-p", type=share_arg, default=0.0,
                        help="sampling: only tokens at least this share as likely as the "
                        "likeliest (0 = all, default)")
    parser.add_argument("--repetition-penalty", type=positive_float, default=1.0,
                        help="divide the logits of tokens already in the text (prompt "
                        "included) by this, at any temperature, as transformers' "
                        "repetition_penalty (1.0 = none, default; e.g. 1.1-1.3)")
    parser.add_argument("--presence-penalty", type=penalty_arg, default=0.0,
                        help="subtract this from the logit of every token already in the "
                        "answer, at any temperature, as OpenAI's and vLLM's presence_penalty "
                        "(-2 to 2; 0 = none, default)")
    parser.add_argument("--frequency-penalty", type=penalty_arg, default=0.0,
                        help="subtract this times its count in the answer from each token's "
                        "logit, as OpenAI's and vLLM's frequency_penalty (-2 to 2; 0 = none, "
                        "default)")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="run past the target's own stop tokens: answers of a fixed "
                        "length (to --max-new-tokens, or a --stop or --stop-token-id where "
                        "the command takes them)")
    parser.add_argument("--seed", type=nonnegative_int, default=0)


def sampling_settings(args: argparse.Namespace) -> dict:
    """`generate`/`stream`'s keyword arguments from `add_sampling_args`' flags."""
    return {"temperature": args.temperature, "seed": args.seed, "top_k": args.sample_top_k,
            "top_p": args.top_p, "min_p": args.min_p,
            "repetition_penalty": args.repetition_penalty,
            "presence_penalty": args.presence_penalty,
            "frequency_penalty": args.frequency_penalty, "ignore_eos": args.ignore_eos}


def add_answer_args(parser: argparse.ArgumentParser) -> None:
    """--stop, --stop-token-id, --min-tokens, --logit-bias and --no-repeat-ngram-size
    (`answer_settings` reads them back)."""
    parser.add_argument("--stop", action="append", type=stop_arg, default=[],
                        metavar="TEXT", help="end the answer at this text (left out of it; "
                        "repeat for several; \\n and \\t are a newline and a tab)")
    parser.add_argument("--stop-token-id", action="append", type=nonnegative_int,
                        default=[], metavar="ID", help="end the answer at this token id too "
                        "(kept in it; repeat for several)")
    parser.add_argument("--min-tokens", type=nonnegative_int, default=0,
                        help="no token that ends the answer before it holds this many "
                        "(0 = none, default)")
    parser.add_argument("--logit-bias", action="append", type=logit_bias_arg, default=[],
                        metavar="ID=BIAS", help="add BIAS (-100 to 100) to token ID's logit "
                        "at every position (-100 bans it; repeat for several)")
    parser.add_argument("--no-repeat-ngram-size", type=nonnegative_int, default=0,
                        metavar="N", help="no N-gram of the text (prompt included) twice, as "
                        "transformers' no_repeat_ngram_size (0 = off, default)")


def answer_settings(args: argparse.Namespace) -> dict:
    """`generate`/`stream`'s keyword arguments from `add_answer_args`' flags."""
    return {"stop": args.stop, "stop_token_ids": args.stop_token_id,
            "min_tokens": args.min_tokens, "logit_bias": args.logit_bias,
            "no_repeat_ngram_size": args.no_repeat_ngram_size}


def tree_options(args: argparse.Namespace) -> dict:
    return {k: getattr(args, k) for k in ("total_tokens", "top_k", "mlp_topk", "pruning",
                                          "depth", "serial_levels", "fta", "lookup",
                                          "lookup_first", "draft_gate", "min_confidence",
                                          "extend_confidence")}


def add_generator_args(parser: argparse.ArgumentParser) -> None:
    """What `load_from_args` reads: the target, --method, --draft, --preset, the tree
    flags and --verify-width (gumiho generate's and gumiho serve's)."""
    add_target_args(parser)
    parser.add_argument("--method", default="ar", choices=METHODS)
    parser.add_argument("--draft", default=None,
                        help="drafter checkpoint dir, or 'random' (seeded random weights)")
    add_preset_arg(parser)
    add_tree_args(parser)
    parser.add_argument("--verify-width", type=positive_int, default=None,
                        help="pad every verify step to this many tokens (one static shape)")
