"""Compile and load the C kernels (rowgemm.c with rowattention.c, rowamx.c, rowlayer.c).

Each library is compiled once per machine with the system's C compiler ($CC, else cc or
gcc) into the cache folder (`paths.cache_dir() / "kernels"`, about a second), and loaded
with ctypes. Its file name carries a hash of the sources, rowkernels.h, the flags and the
compiler, so a changed source builds anew and an unchanged one is reused. Its threads are
torch's OpenMP runtime where the wheel ships one (one pool, sized by
torch.set_num_threads). Where a library cannot be built or loaded (no compiler, another
architecture, a compiler that refuses a flag), `built` returns None and its module says
what runs instead: torch's or oneDNN's kernels, the same results to float rounding.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from gumiho.paths import cache_dir

log = logging.getLogger("gumiho")

HEADER = Path(__file__).with_name("rowkernels.h")  # what every kernel includes
# no contraction of plain C arithmetic into FMAs: the kernels' explicit FMAs are the only
# ones, so two code paths that sum alike round alike (rowattention.c's dot and dots)
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-shared", "-fPIC"]
LIBS = ["-lm"]


def openmp_flags() -> list[str]:
    """Link torch's own OpenMP runtime where the wheel ships one (so both share one pool);
    without it a kernel runs on one thread rather than start a second pool."""
    lib = Path(torch.__file__).parent / "lib"
    if not (lib / "libgomp.so.1").exists():
        return []
    return ["-fopenmp", f"-L{lib}", f"-Wl,-rpath,{lib}"]


def avx2_cpu() -> bool:
    """An x86 CPU whose code torch runs at AVX2 or AVX-512 (what the kernels' flags need;
    `ATEN_CPU_CAPABILITY=default` says no too)."""
    return (platform.machine().lower() in ("x86_64", "amd64")
            and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"))


def compiler() -> str | None:
    """The C compiler command the kernels are built with: $CC (default cc; a command with
    arguments too, e.g. "ccache gcc", its program found on the PATH), else gcc; None if
    neither is found."""
    command = shlex.split(os.environ.get("CC") or "cc")
    found = shutil.which(command[0]) if command else None
    if found is not None:
        return shlex.join([found, *command[1:]])
    return shutil.which("gcc")


def library(name: str, sources: list[Path], flags: tuple[str, ...] = (),
            header: Path = HEADER) -> tuple[str, list[str], Path] | None:
    """(compiler, flags, path) for library `name` of `sources` (`header`, rowkernels.h,
    beside them), compiled with FLAGS, `flags` and torch's OpenMP: the path carries a hash
    of all of them, so a changed source or flag builds anew (`built`) and the same ones,
    wherever they lie (another revision's, scripts/rowattention_ab.py), reuse the build.
    None without a C compiler."""
    cc = compiler()
    if cc is None:
        return None
    flags = [*flags, *openmp_flags()]
    key = hashlib.sha1(repr([[f.read_bytes() for f in (*sources, header)], FLAGS, flags,
                             cc]).encode())
    return cc, flags, cache_dir() / "kernels" / f"{name}-{key.hexdigest()[:16]}.so"


def build(compiler: str, flags: list[str], out: Path, sources: list[Path]) -> None:
    """Compile `sources` (rowkernels.h beside them) to the shared library `out`, atomically
    (concurrent processes may race to it)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        made = Path(tmp) / out.name
        subprocess.run([*shlex.split(compiler), *FLAGS, *flags, *map(str, sources), "-o",
                        str(made), *LIBS],
                       check=True, capture_output=True, timeout=120)
        os.replace(made, out)


# library name -> why it did not build or load here (`gumiho env` shows it)
FAILURES: dict[str, str] = {}


def built(found: tuple[str, list[str], Path] | None, sources: list[Path], instead: str
          ) -> ctypes.CDLL | None:
    """The shared library of `sources`, built at `found`'s path with its compiler and flags
    (`library()`'s triple) where it is not there yet, and loaded; None where `found` is None
    or the build or load fails. A failure with a compiler at hand is unexpected (a kernel
    folder that is not writable, a build past its time limit) and halves the speed, so it
    is logged as a warning once and kept in FAILURES; `instead` says what runs instead."""
    if found is None:
        return None
    cc, flags, path = found
    try:
        if not path.exists():
            build(cc, flags, path, sources)
        return ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as exc:
        text = str(exc).strip()
        why = text.splitlines()[0][:200] if text else type(exc).__name__
        name = path.stem.split("-")[0]
        FAILURES[name] = f"{why} (in {path.parent})"
        log.warning("%s not built (%s): %s", name, FAILURES[name], instead)
        return None
