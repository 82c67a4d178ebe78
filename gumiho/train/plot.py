"""Plot held-out top-1 accuracy per draft position against training steps:
`python -m gumiho.train.plot RUN [RUN ...] --out curves.png [--chain]`.

Reads the `eval` rows that `gumiho.train --eval-every N` writes to RUN/train_log.jsonl (RUN:
a training output dir, or such a log file itself); one panel per run, one line per draft
position (serial 1, serial 2, MLP 1..5, Medusa heads). With `--chain` the runs continued one
another (each `--init-from` the one before) and share one axis: a run's steps count on from
the last step the run before it logged, and a run without evaluations still adds its steps.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from gumiho.errors import ArgumentParser, GumihoError, cli_errors


def log_rows(run: Path) -> list[dict]:
    """Every row of a run's train_log.jsonl (`run` the output dir or the log itself)."""
    log = run if run.suffix == ".jsonl" else run / "train_log.jsonl"
    if not log.is_file():
        raise GumihoError(f"{log} not found: give a training output dir or its "
                          "train_log.jsonl")
    rows = []
    for number, line in enumerate(log.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                raise GumihoError(f"{log} line {number} is not JSON (a log cut off "
                                  "mid-line: delete that line)") from None
    return rows


HOW_TO_EVALUATE = "train with --eval-data and --eval-every N"


def evaluations(rows: list[dict]) -> list[dict]:
    """A log's `eval` rows in step order, the last one logged at each step (a resumed run
    may log a step twice)."""
    return sorted({r["step"]: r for r in rows if "eval" in r}.values(), key=lambda r: r["step"])


def eval_rows(run: Path) -> list[dict]:
    rows = evaluations(log_rows(run))
    if not rows:
        raise GumihoError(f"{run} has no evaluation rows: {HOW_TO_EVALUATE}")
    return rows


@dataclass
class Stretch:
    """One run of a chain: its name, where its step 0 lies on the common axis, and its
    evaluations there (steps, and accuracy by draft position)."""

    name: str
    offset: int
    steps: list[int]
    series: dict[str, list[float | None]]


def chained(runs: list[Path], names: list[str] | None = None) -> list[Stretch]:
    """The runs on one axis, each after the last step the one before it logged; `names`
    label them (default: the dir's or log file's name)."""
    if names is not None and len(names) != len(runs):
        raise GumihoError(f"--names gives {len(names)} names for {len(runs)} runs")
    out, offset = [], 0
    for i, run in enumerate(runs):
        rows = log_rows(run)
        evals = evaluations(rows)
        keys = list(evals[-1]["eval"]) if evals else []
        name = names[i] if names else run.stem if run.suffix == ".jsonl" else run.name
        out.append(Stretch(name, offset,
                           [offset + r["step"] for r in evals],
                           {k.removeprefix("acc_"): [r["eval"].get(k) for r in evals]
                            for k in keys}))
        offset += max((r["step"] for r in rows if "step" in r), default=0)
    if not any(s.steps for s in out):
        raise GumihoError(f"none of these runs has evaluation rows: {HOW_TO_EVALUATE}")
    return out


def plot_chain(ax, runs: list[Path], names: list[str] | None = None) -> None:
    stretches = chained(runs, names)
    keys = list(dict.fromkeys(k for s in stretches for k in s.series))
    colours = {k: f"C{i}" for i, k in enumerate(keys)}
    labelled: set[str] = set()  # each position named once in the legend
    for s in stretches:
        if s.offset:
            ax.axvline(s.offset, color="grey", lw=0.6, ls=":")
        ax.annotate(s.name, (s.offset, 1), xycoords=("data", "axes fraction"),
                    xytext=(2, -2), textcoords="offset points", rotation=90, va="top",
                    fontsize=7, color="grey")
        for k, values in s.series.items():
            ax.plot(s.steps, values, marker=".", color=colours[k],
                    label=None if k in labelled else k)
            labelled.add(k)
    ax.set_xlabel("optimizer step, runs in sequence")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")


@cli_errors
def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="python -m gumiho.train.plot",
                                description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", help="training output dirs (or their train_log.jsonl)")
    p.add_argument("--out", required=True, help="PNG file to write (another image "
                   "format by its suffix: .svg, .pdf, ...)")
    p.add_argument("--title", default="held-out top-1 accuracy per draft position")
    p.add_argument("--chain", action="store_true",
                   help="the runs continued one another: one panel, steps in sequence")
    p.add_argument("--names", default=None,
                   help="with --chain: the runs' labels, comma-separated, one per run")
    args = p.parse_args(argv)
    if args.names is not None and not args.chain:
        raise GumihoError("--names labels the runs of a --chain; without it each panel is "
                          "titled by its run's folder: leave --names out or add --chain")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out, image = output_file(args.out, plt)
    runs = [Path(r) for r in args.runs]
    if args.chain:
        fig, ax = plt.subplots(figsize=(10, 4.5))
        plot_chain(ax, runs, args.names.split(",") if args.names else None)
        ax.set_ylabel("top-1 = target argmax")
    else:
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
    try:
        fig.savefig(out, dpi=110, format=image)
    except OSError as exc:
        raise GumihoError(f"--out {out}: cannot write it ({exc.strerror or exc})") from None
    print(out)
    return 0


def output_file(name: str, plt) -> tuple[Path, str]:
    """(the file --out names, its image format): the format its suffix names, PNG for a
    name without one (written under that very name: matplotlib would add ".png" to it, and
    the path printed would not be the file written); one line for a format matplotlib
    cannot write or a folder that is not there, before any log is read."""
    out = Path(name)
    formats = plt.figure().canvas.get_supported_filetypes()
    plt.close("all")
    image = out.suffix[1:].lower() or "png"
    if image not in formats:
        raise GumihoError(f"--out {out}: matplotlib cannot write {out.suffix!r} images; "
                          f"name a .png file (or {', '.join('.' + f for f in sorted(formats))})")
    if not out.parent.is_dir():
        raise GumihoError(f"--out {out}: the folder {out.parent} does not exist")
    return out, image


if __name__ == "__main__":
    sys.exit(main())
