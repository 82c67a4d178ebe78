"""`gumiho SUBCOMMAND ...`: each subcommand is `python -m gumiho.<module> ...`."""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS = {
    "generate": "gumiho.generate",
    "demo": "gumiho.demo",
    "serve": "gumiho.serve",
    "chat": "gumiho.chat",
    "timing": "gumiho.evaluation.timing",
    "gen-answers": "gumiho.evaluation.gen_answers",
    "interleave": "gumiho.evaluation.interleave",
    "speed": "gumiho.evaluation.speed",
    "allocation": "gumiho.ge_data.allocation",
    "train": "gumiho.train.__main__",
    "export": "gumiho.export",
    "env": "gumiho.env",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    usage = (f"gumiho {{{','.join(SUBCOMMANDS)}}} ... (each takes --help; `gumiho help "
             "COMMAND` says the same, `gumiho --version` which code this is)")
    if argv[:1] == ["help"]:  # `gumiho help demo` = `gumiho demo --help`
        argv = argv[1:2] + ["--help"] if argv[1:] else ["--help"]
    if argv and argv[0] in ("-h", "--help"):
        print(f"usage: {usage}")
        return 0
    if argv and argv[0] in ("-V", "--version"):
        from gumiho.version import __version__, code_version

        code = code_version(short=True)
        print(f"gumiho {__version__}" + ("" if code.startswith("gumiho ") else f" ({code})"))
        return 0
    if not argv:
        print(f"error: no command given: use {usage}", file=sys.stderr)
        return 2
    if argv[0] not in SUBCOMMANDS:
        print(f"error: unknown command {argv[0]!r}: use {usage}", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(SUBCOMMANDS[argv[0]])  # torch: seconds
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
