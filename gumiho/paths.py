"""Where gumiho's files live: its cache dir, installed data packages, folders to write."""

from __future__ import annotations

import hashlib
import importlib.util
import os
from collections.abc import Callable
from pathlib import Path

from gumiho.errors import GumihoError


def cache_dir() -> Path:
    """Where converted models live: $GUMIHO_CACHE, else ~/.cache/gumiho. A leading ~ is
    the home folder (a quoted `GUMIHO_CACHE="~/x"` reaches us unexpanded)."""
    root = os.environ.get("GUMIHO_CACHE") or Path.home() / ".cache" / "gumiho"
    return Path(root).expanduser()


def package_dir(package: str, install_hint: str) -> Path:
    """The folder of an installed data package, found without importing it (some of these
    packages import plugins we deliberately do not install)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise GumihoError(f"package {package} is not installed: {install_hint}")
    return Path(next(iter(spec.submodule_search_locations)))


def check_writable_dir(path: Path, what: str) -> None:
    """`path` is, or can be made, a writable directory (else one line naming it)."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        raise GumihoError(f"{what} {path}: {existing} is a file, not a directory: "
                          "point it at a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise GumihoError(f"{what} {path}: {existing} is not writable: point it at a "
                          "writable directory")


def write_atomically(path: Path, write: Callable[[Path], object], unique: bool = False
                     ) -> None:
    """Make `path` by `write(tmp)` into a sibling temp file, then one rename: a reader (or a
    run resumed after a kill) sees the old file or the whole new one, never half of one.
    The temp file is `<name>.tmp` (what a caller sweeping leftovers looks for), with the
    process id appended when `unique` (several processes may write the same path at once).
    A failed write removes the temp file and raises."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid() if unique else ''}")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def same_place(a: str, b: str) -> bool:
    """Two names of one target, drafter or folder: equal, or paths to the same existing
    file or directory (one may be relative; a name that is no path here, an alias, only
    equals itself)."""
    if a == b:
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def file_sha256(path: str | Path) -> str:
    """The sha256 of a file's bytes, hex (read in blocks: a data file or drafter's weights,
    what a resume compares where a name alone could now mean other content)."""
    digest = hashlib.sha256()  # (not hashlib.file_digest: Python 3.11+, and we take 3.10)
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()
