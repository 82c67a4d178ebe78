"""What a reduced draft vocabulary costs and saves, per size: `python -m
gumiho.evaluation.vocab_sizes`.

Two measurements, side by side in one run:

* coverage: the share of held-out assistant tokens that a draft vocabulary of each size
  (the most frequent assistant tokens of the counting conversations, as training builds
  it) contains. A token outside it can never be drafted, so 1 - coverage bounds the
  acceptance a drafter can lose at any draft position.
* drafting time: seconds per Gumiho drafting pass in the real loop (random weights: the
  tree, and so the work, is the same size whatever the weights), per draft vocabulary.

The default `--draft-vocab` of scripts/train.sh was chosen from this table (README,
"Draft vocabulary").
"""

from __future__ import annotations

import json
import statistics
import sys

import torch
from tqdm import tqdm

from gumiho.config import TrainConfig, TreeConfig
from gumiho.engine import GenerateConfig, run
from gumiho.errors import (
    ArgumentParser,
    GumihoError,
    cli_errors,
    nonnegative_int,
    positive_int,
)
from gumiho.ge_data.conversations import load_conversations, split
from gumiho.modeling import draft_vocabulary
from gumiho.serial_drafter import SerialDrafter
from gumiho.target import load_target
from gumiho.templates import tokenize_conversation
from gumiho.train.dataset import token_counts
from gumiho.train.start import check_draft_vocab_size, kept_stop_ids, new_model

PROMPT = "Explain in a few sentences why the sky is blue."


def samples_of(target, conversations: list[dict], max_len: int,
               template: str | None = None) -> list[dict]:
    """input_ids and loss_mask of each conversation (no target features needed)."""
    out = []
    for conv in tqdm(conversations, desc="tokenize", leave=False):
        ids, mask = tokenize_conversation(target.tokenizer, conv["messages"], max_len,
                                          target.stop_token_ids, template)
        if mask.any():
            out.append({"input_ids": ids, "loss_mask": mask})
    return out


def coverage(counts: torch.Tensor, test: torch.Tensor, size: int, always: list[int]) -> float:
    """Share of the test tokens (counts per id) inside the draft vocabulary of `size`."""
    if size == 0 or size >= counts.shape[0]:
        return 1.0
    ids = draft_vocabulary(counts, size, always)
    return float(test[ids].sum() / test.sum())


def drafter_for(target, samples: list[dict], size: int) -> SerialDrafter:
    """A random-weight Gumiho drafter at the reference tree, over a draft vocabulary."""
    model = new_model(target, TrainConfig(online=True, draft_vocab=size), samples).eval()
    return SerialDrafter(model, TreeConfig.for_method("gumiho"))


def drafting_seconds(target, drafters: dict[int, SerialDrafter], new_tokens: int,
                     repeats: int) -> dict[int, dict]:
    """Median seconds per drafting pass and per cycle in the loop, for each drafter. The
    drafters take turns within every repeat, so machine load hits them alike."""
    prompt = target.chat_ids(PROMPT)
    # every run the same length whatever its tokens (a stop token right after the prefill
    # would leave no cycle to divide by)
    config = GenerateConfig(max_new_tokens=new_tokens, profile=True, ignore_eos=True)
    times: dict[int, dict[str, list[float]]] = {s: {"draft_s": [], "cycle_s": []}
                                                for s in drafters}
    for drafter in drafters.values():  # warm-up
        run(target, drafter, prompt, GenerateConfig(max_new_tokens=4))
    for _ in tqdm(range(repeats), desc="timing", leave=False):
        for size, drafter in drafters.items():
            result = run(target, drafter, prompt, config)
            cycles = len(result.accept_lengths) - 1  # the first "cycle" is the prefill
            times[size]["draft_s"].append(result.phase_s.get("draft", 0.0) / cycles)
            times[size]["cycle_s"].append(sum(result.cycle_s[1:]) / cycles)
    return {s: {k: statistics.median(v) for k, v in t.items()} for s, t in times.items()}


def size_list(text: str) -> list[int]:
    """--sizes: comma-separated whole numbers of at least 0 (argparse's type)."""
    return [nonnegative_int(part) for part in text.split(",")]


def build_parser():
    p = ArgumentParser(prog="python -m gumiho.evaluation.vocab_sizes", description=__doc__
                       .split("\n\n")[0])
    p.add_argument("--target", default="smollm2")
    p.add_argument("--count", type=positive_int, default=3000,
                   help="training-split conversations whose assistant tokens are counted")
    p.add_argument("--test", type=positive_int, default=500,
                   help="held-out conversations to measure coverage on")
    p.add_argument("--sizes", type=size_list, default="4096,8192,16384,32768,0",
                   help="draft vocabulary sizes, comma-separated (0: the whole vocabulary)")
    p.add_argument("--max-len", type=positive_int, default=2048)
    p.add_argument("--template", default=None, help="chat template for tokenizers without "
                   "one (base models): 'vicuna' or a Jinja string")
    p.add_argument("--new-tokens", type=nonnegative_int, default=32,
                   help="tokens generated per timing run (0: coverage only)")
    p.add_argument("--repeats", type=positive_int, default=3)
    return p


@cli_errors
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    sizes = args.sizes
    if args.new_tokens == 1:
        raise GumihoError("--new-tokens 1 leaves no drafting cycle to time (the first token "
                          "comes from the prefill): give 0 (coverage only) or at least 2")
    torch.manual_seed(0)
    target = load_target(args.target)
    vocab = check_draft_vocab_size(max(sizes), target.lm_head.weight.shape[0], "--sizes")
    always = kept_stop_ids(target, vocab, sizes, "--sizes")  # as training keeps them
    train, held = split(load_conversations("sharegpt"))
    counted = samples_of(target, train[: args.count], args.max_len, args.template)
    tested = samples_of(target, held[: args.test], args.max_len, args.template)
    counts, test = token_counts(counted, vocab), token_counts(tested, vocab)
    timed = {}
    if args.new_tokens:
        drafters = {size: drafter_for(target, counted, size) for size in sizes}
        timed = drafting_seconds(target, drafters, args.new_tokens, args.repeats)
    rows = [{"draft_vocab": size or vocab, "coverage": round(coverage(counts, test, size,
                                                                       always), 4),
             **{k: round(v, 4) for k, v in timed.get(size, {}).items()}} for size in sizes]
    for row in rows:
        print(json.dumps(row))
    print(json.dumps({"target": args.target, "counted_conversations": len(counted),
                      "test_conversations": len(tested), "test_tokens": int(test.sum()),
                      "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
