"""`gumiho SUBCOMMAND ...`: each subcommand is `python -m gumiho.<module> ...`."""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS = {
    "generate": "gumiho.generate",
    "demo": "gumiho.demo",
    "timing": "gumiho.evaluation.timing",
    "gen-answers": "gumiho.evaluation.gen_answers",
    "speed": "gumiho.evaluation.speed",
    "allocation": "gumiho.ge_data.allocation",
    "train": "gumiho.train",
    "export": "gumiho.export",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in SUBCOMMANDS:
        print(f"usage: gumiho {{{','.join(SUBCOMMANDS)}}} ...", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return importlib.import_module(SUBCOMMANDS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
