"""Held-out top-1 accuracy per draft position of any drafter checkpoint (ours or an
official one): `python -m gumiho.train.accuracy --draft DIR --data DIR [--method M]`.

The same measure as training's evaluation (the drafter's argmax against the target's on
stored held-out samples, teacher-forced; a target token outside a reduced draft vocabulary
is a miss), so shipped and newly trained drafters compare on one data set. `--draft-vocab
N` reads the drafter over another draft vocabulary, the N most frequent assistant tokens
of the training split as `python -m gumiho.train --init-from DIR --draft-vocab N --online`
chooses it (0: the whole vocabulary; the serial layers and MLP heads do not depend on it).
`outside_vocab` is the share of held-out target tokens the vocabulary cannot draft.
"""

from __future__ import annotations

import json
import sys

import torch

from gumiho.checkpoint import load_drafter_model
from gumiho.errors import ArgumentParser, cli_errors, positive_int
from gumiho.ge_data.shards import load_samples
from gumiho.methods import DRAFTER_METHODS
from gumiho.modeling import DraftHead
from gumiho.target import load_target
from gumiho.train.start import add_vocabulary_args, over_vocabulary, vocabulary_samples
from gumiho.train.step import evaluate


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m gumiho.train.accuracy",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--draft", required=True, help="a drafter checkpoint dir")
    p.add_argument("--data", required=True, help="held-out data made by ge_data.allocation")
    p.add_argument("--method", choices=DRAFTER_METHODS, default=None,
                   help="default: the checkpoint's own")
    p.add_argument("--target", default="smollm2")
    p.add_argument("--batch-size", type=positive_int, default=4)
    add_vocabulary_args(p, "read the drafter")
    return p


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
    _, samples = load_samples(args.data)
    target = load_target(args.target)  # an accelerator when there is one
    model = load_drafter_model(args.draft, target, args.method).float()
    if args.draft_vocab is not None:  # 0 here is the whole vocabulary, not "its own"
        model = over_vocabulary(model, target, args.draft_vocab or target.lm_head.weight.shape[0],
                                vocabulary_samples(target, args), args.draft).float()
    head = DraftHead.for_model(target, model)
    acc = evaluate(model, target, head, samples, model.config.method, 2, args.batch_size)
    print(json.dumps({"draft": args.draft, "data": args.data, "samples": len(samples),
                      "draft_vocab": head.size,
                      "outside_vocab": round(outside_vocab(target, head, samples), 4),
                      **{k: round(v, 4) for k, v in acc.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
