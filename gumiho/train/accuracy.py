"""Held-out top-1 accuracy per draft position of any drafter checkpoint (ours or an
official one): `python -m gumiho.train.accuracy --draft DIR --data DIR [--method M]`.

The same measure as training's evaluation (the drafter's argmax against the target's on
stored held-out samples, teacher-forced; a target token outside a reduced draft vocabulary
is a miss), so shipped and newly trained drafters compare on one data set. `--draft-vocab
N` reads the drafter over another draft vocabulary, the N most frequent assistant tokens
of the training split as `python -m gumiho.train --init-from DIR --draft-vocab N --online`
chooses it (0: the whole vocabulary; the serial layers and MLP heads do not depend on it).
`outside_vocab` is the share of held-out target tokens the vocabulary cannot draft.
Each output names its `measure`: training's evaluation averages batches (`--batch-size`
samples, token-weighted within each), while `--against DIR`, which compares two drafters
on the same samples, averages samples (each conversation weighs the same), so the two
read slightly differently on the same drafter. Per position it gives the mean over
samples of the first's top-1 less the second's, with a 95% interval from the spread of
those per-sample differences (a paired test, so two drafters that differ by 0.01 on the
same text can be told apart from noise).
"""

from __future__ import annotations

import json
import math
import sys

import torch

from gumiho.checkpoint import load_drafter_model, trained_target
from gumiho.errors import ArgumentParser, GumihoError, cli_errors, positive_int
from gumiho.ge_data.shards import load_samples
from gumiho.methods import DRAFTER_METHODS
from gumiho.modeling import DraftHead
from gumiho.target import load_target
from gumiho.train.dataset import check_width
from gumiho.train.start import add_vocabulary_args, over_vocabulary, vocabulary_samples
from gumiho.train.step import batch_accuracies, evaluate


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m gumiho.train.accuracy",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--draft", required=True, help="a drafter checkpoint dir")
    p.add_argument("--data", required=True, help="held-out data made by ge_data.allocation")
    p.add_argument("--method", choices=DRAFTER_METHODS, default=None,
                   help="default: the checkpoint's own")
    p.add_argument("--target", default=None, help="the drafter's target, a dir or an alias "
                   "(default: the one its config.json names, else smollm2)")
    p.add_argument("--batch-size", type=positive_int, default=4)
    p.add_argument("--against", default=None, metavar="DRAFT_DIR",
                   help="a second drafter (the same method) to compare with, sample by "
                   "sample: per position the mean difference and its 95%% interval")
    add_vocabulary_args(p, "read the drafter")
    return p


def paired_difference(first: list[dict[str, float]], second: list[dict[str, float]]
                      ) -> dict[str, list[float]]:
    """Per position (key), [mean, low, high] of first - second over the samples both score
    there: the mean difference and a normal 95% interval from the per-sample differences'
    standard deviation (n - 1), the samples being independent conversations."""
    found = {}
    for key in dict.fromkeys(k for row in first for k in row):
        diffs = [a[key] - b[key] for a, b in zip(first, second, strict=True)
                 if key in a and key in b]
        n = len(diffs)
        if n < 2:
            continue
        mean = sum(diffs) / n
        sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1))
        half = 1.96 * sd / math.sqrt(n)
        found[key] = [round(mean, 4), round(mean - half, 4), round(mean + half, 4)]
    return found


def scored_mean(rows: list[dict[str, float]]) -> dict[str, float]:
    """Per position, the mean over the samples that score it."""
    keys = dict.fromkeys(k for row in rows for k in row)
    return {k: round(sum(r[k] for r in rows if k in r) / sum(k in r for r in rows), 4)
            for k in keys}


def outside_vocab(target, head: DraftHead, samples: list[dict]) -> float:
    """The share of the samples' scored target tokens (the target's argmax at each
    assistant position) that lie outside the head's draft vocabulary."""
    total = outside = 0
    with torch.no_grad():
        for s in samples:
            scored = s["loss_mask"].bool()
            features = s["hidden_state"][scored].to(target.lm_head.weight)
            argmax = target.lm_head(features).argmax(-1)  # stored features are post-norm
            total += int(scored.sum())
            outside += int((~head.to_draft(argmax)[1]).sum())
    return outside / max(total, 1)


@cli_errors
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    manifest, samples = load_samples(args.data)
    target = load_target(trained_target(args.draft, args.target))  # an accelerator if any
    check_width(manifest, args.data, target.hidden_size)
    counted = vocabulary_samples(target, args) if args.draft_vocab is not None else None
    model, head = read_drafter(args.draft, target, args.method, args.draft_vocab, counted)
    if args.against is not None:
        other, other_head = read_drafter(args.against, target, args.method, args.draft_vocab,
                                         counted)
        method = model.config.method
        if other.config.method != method:
            raise GumihoError(f"--against {args.against} is a {other.config.method} drafter; "
                              f"{args.draft} is {method}")
        rows = [batch_accuracies(m, target, h, samples, method, 2, 1)
                for m, h in ((model, head), (other, other_head))]
        print(json.dumps({"draft": args.draft, "against": args.against, "data": args.data,
                          "samples": len(samples), "measure": "mean over samples",
                          "draft_acc": scored_mean(rows[0]),
                          "against_acc": scored_mean(rows[1]),
                          "difference": paired_difference(*rows)}))
        return 0
    acc = evaluate(model, target, head, samples, model.config.method, 2, args.batch_size)
    print(json.dumps({"draft": args.draft, "data": args.data, "samples": len(samples),
                      "measure": f"mean over batches of {args.batch_size} samples, "
                                 "token-weighted within each",
                      "draft_vocab": head.size,
                      "outside_vocab": round(outside_vocab(target, head, samples), 4),
                      **{k: round(v, 4) for k, v in acc.items()}}))
    return 0


def read_drafter(path: str, target, method: str | None, draft_vocab: int | None,
                 counted: list[dict] | None):
    """The drafter network of `path` in float32, over `draft_vocab` tokens when given (the
    most frequent in `counted`), and its draft head."""
    model = load_drafter_model(path, target, method, dtype=torch.float32)
    if draft_vocab is not None:  # 0 here is the whole vocabulary, not "its own"
        model = over_vocabulary(model, target, draft_vocab or target.lm_head.weight.shape[0],
                                counted, path)
    return model, DraftHead.for_model(target, model)


if __name__ == "__main__":
    sys.exit(main())
