"""Held-out top-1 accuracy per draft position of any drafter checkpoint (ours or an
official one): `python -m gumiho.train.accuracy --draft DIR --data DIR [--method M]`.

The same measure as training's evaluation (the drafter's argmax against the target's on
stored held-out samples, teacher-forced), so shipped and newly trained drafters compare
on one data set.
"""

from __future__ import annotations

import json
import sys

from gumiho.checkpoint import load_drafter_model
from gumiho.errors import ArgumentParser, cli_errors, positive_int
from gumiho.ge_data.shards import load_samples
from gumiho.methods import DRAFTER_METHODS
from gumiho.modeling import DraftHead
from gumiho.target import load_target
from gumiho.train.__main__ import evaluate


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m gumiho.train.accuracy",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--draft", required=True, help="a drafter checkpoint dir")
    p.add_argument("--data", required=True, help="held-out data made by ge_data.allocation")
    p.add_argument("--method", choices=DRAFTER_METHODS, default=None,
                   help="default: the checkpoint's own")
    p.add_argument("--target", default="smollm2")
    p.add_argument("--batch-size", type=positive_int, default=4)
    return p


@cli_errors
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _, samples = load_samples(args.data)
    target = load_target(args.target)  # an accelerator when there is one
    model = load_drafter_model(args.draft, target, args.method).float()
    head = DraftHead.for_model(target, model)
    acc = evaluate(model, target, head, samples, model.config.method, 2, args.batch_size)
    print(json.dumps({"draft": args.draft, "data": args.data, "samples": len(samples),
                      **{k: round(v, 4) for k, v in acc.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
