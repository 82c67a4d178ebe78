"""Plot held-out top-1 accuracy per draft position against training steps:
`python -m gumiho.train.plot RUN_DIR [RUN_DIR ...] --out curves.png`.

Reads the `eval` rows that `gumiho.train --eval-every N` writes to RUN_DIR/train_log.jsonl;
one panel per run, one line per draft position (serial 1, serial 2, MLP 1..5, Medusa heads).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gumiho.errors import GumihoError, cli_errors


def eval_rows(run_dir: Path) -> list[dict]:
    log = run_dir / "train_log.jsonl"
    if not log.is_file():
        raise GumihoError(f"{log} not found: give a training output dir")
    rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "eval" in r]
    if not rows:
        raise GumihoError(f"{log} has no evaluation rows: train with --eval-data and "
                          "--eval-every N")
    return sorted({r["step"]: r for r in rows}.values(), key=lambda r: r["step"])


@cli_errors
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gumiho.train.plot",
                                description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", help="training output dirs")
    p.add_argument("--out", required=True, help="PNG file to write")
    p.add_argument("--title", default="held-out top-1 accuracy per draft position")
    args = p.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [Path(r) for r in args.runs]
    fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 4), squeeze=False,
                             sharey=True)
    for ax, run in zip(axes[0], runs, strict=True):
        rows = eval_rows(run)
        steps = [r["step"] for r in rows]
        for key in rows[-1]["eval"]:
            ax.plot(steps, [r["eval"].get(key) for r in rows], marker=".",
                    label=key.removeprefix("acc_"))
        ax.set_title(run.name)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("top-1 = target argmax")
    fig.suptitle(args.title)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
