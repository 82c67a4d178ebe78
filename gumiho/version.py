"""Which code made a result: the git commit when run from a checkout, else the version."""

from __future__ import annotations

import subprocess
from functools import cache
from pathlib import Path

__version__ = "0.2.0"


@cache
def code_version(short: bool = False) -> str:
    """`git rev-parse HEAD` of the checkout this package lives in (with `+dirty` when its
    files under gumiho/ have uncommitted changes); `gumiho VERSION` for an installed or
    exported source tree, also one inside another repository that does not track it (a
    virtual environment in the user's own project: that project's commit is not ours)."""
    here = Path(__file__).parent
    try:
        def git(*args: str, check: bool = True) -> str:
            return subprocess.run(["git", *args], capture_output=True, text=True, cwd=here,
                                  check=check, timeout=10).stdout

        git("ls-files", "--error-unmatch", Path(__file__).name)  # tracked here, or raises
        commit = git("rev-parse", "--short" if short else "--verify", "HEAD").strip()
        dirty = git("status", "--porcelain", "--untracked-files=no", ".", check=False)
        return commit + ("+dirty" if dirty.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return f"gumiho {__version__}"
