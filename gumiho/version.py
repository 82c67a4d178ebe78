"""Which code made a result: the git commit when run from a checkout, else the version."""

from __future__ import annotations

import subprocess
from functools import cache
from pathlib import Path

__version__ = "0.2.0"


@cache
def code_version(short: bool = False) -> str:
    """`git rev-parse HEAD` of the checkout this package lives in (with `+dirty` when it
    has uncommitted changes); `gumiho VERSION` for an installed or exported source tree."""
    here = Path(__file__).parent
    try:
        args = ["git", "rev-parse", "--short" if short else "--verify", "HEAD"]
        commit = subprocess.run(args, capture_output=True, text=True, cwd=here,
                                check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "."],
                               capture_output=True, text=True, cwd=here, timeout=10).stdout
        return commit + ("+dirty" if dirty.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return f"gumiho {__version__}"
