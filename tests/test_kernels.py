"""kernels.py: a library's path names everything it is built from, so a changed source or
flag builds anew and an unchanged one is reused; a source that does not compile leaves no
library behind and loads as None."""

import ctypes
import platform

import pytest

from gumiho import kernels

builds_here = pytest.mark.skipif(
    kernels.compiler() is None or platform.machine().lower() not in ("x86_64", "amd64"),
    reason="no C compiler, or not an x86 CPU (the kernels' flags are x86's)")

SOURCE = "int twice(int x) { return 2 * x; }\n"


@builds_here
def test_the_path_follows_sources_and_flags(tmp_path, monkeypatch):
    monkeypatch.setenv("GUMIHO_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "twice.c"
    source.write_text(SOURCE)
    first = kernels.library("twice", [source])
    assert first is not None and first[2].parent == tmp_path / "cache" / "kernels"
    assert kernels.library("twice", [source]) == first  # the same inputs, the same path
    assert kernels.library("twice", [source], ("-DX=1",))[2] != first[2]  # another flag
    source.write_text(SOURCE + "int thrice(int x) { return 3 * x; }\n")
    assert kernels.library("twice", [source])[2] != first[2]  # another source


@builds_here
def test_a_library_is_built_once_and_loaded(tmp_path, monkeypatch):
    monkeypatch.setenv("GUMIHO_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "twice.c"
    source.write_text(SOURCE)
    found = kernels.library("twice", [source])
    lib = kernels.built(found, [source], "nothing")
    assert lib is not None and lib.twice(ctypes.c_int(21)) == 42
    assert found[2].exists() and not list(found[2].parent.glob("tmp*"))
    monkeypatch.setattr(kernels, "build", lambda *a: pytest.fail("built twice"))
    assert kernels.built(found, [source], "nothing").twice(4) == 8


@builds_here
def test_a_source_that_does_not_compile_loads_as_none(tmp_path, monkeypatch):
    monkeypatch.setenv("GUMIHO_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "broken.c"
    source.write_text("int broken( {\n")
    found = kernels.library("broken", [source])
    assert kernels.built(found, [source], "nothing") is None
    assert not list((tmp_path / "cache").rglob("*.so"))
    assert kernels.built(None, [source], "nothing") is None  # no compiler: nothing to build


@builds_here
@pytest.mark.host
def test_cpu_probes_answer_alike_under_another_default_device():
    """A notebook's `with torch.device("cuda"): load_target(...)`, or the GPU suite's
    fixture, may be the first to reach the CPU kernels' and paths' probes: they make their
    tensors on the CPU whatever the default device, and answer as they do there. In a fresh
    process ("meta" standing in for CUDA), where a probe that handed the C code another
    device's tensors would crash it or raise."""
    import subprocess
    import sys

    code = """
import torch
from gumiho import attention, linear, rowamx, rowgemm, rowlayer, softce

def probes():
    gemm = rowgemm.kernel()
    return [gemm is not None, gemm is not None and gemm.can_tile, rowamx.kernel() is not None,
            rowlayer.enabled(), softce.kernel() is not None,
            *(linear.rows_independent(d) for d in (torch.float32,
            torch.bfloat16)), *(attention.invariant_here(d) for d in (torch.float32,
            torch.bfloat16))]

with torch.device("meta"):
    print(probes())
for cached in (rowgemm.kernel, rowamx.kernel, rowlayer.kernel, softce.kernel,
               linear.rows_independent, attention.invariant_here):
    cached.cache_clear()
print(probes())
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    elsewhere, here = proc.stdout.strip().splitlines()[-2:]
    assert elsewhere == here


@pytest.mark.host
def test_every_kernel_source_ships_in_the_package():
    """An installed (not editable) package carries every C source and header its kernels
    compile from: a missing one would leave its kernel unbuilt and its path silently
    torch's."""
    import fnmatch
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # Python 3.11 and later

    root = Path(kernels.__file__).resolve().parents[1]
    patterns = tomllib.loads((root / "pyproject.toml").read_text()
                             )["tool"]["setuptools"]["package-data"]["gumiho"]
    sources = sorted(p.name for p in (root / "gumiho").iterdir() if p.suffix in (".c", ".h"))
    assert {"rowgemm.c", "rowlayer.c", "softce.c", "rowkernels.h"} <= set(sources)
    assert [s for s in sources if not any(fnmatch.fnmatch(s, pat) for pat in patterns)] == []


@builds_here
def test_a_failed_build_is_a_warning_and_env_says_why(tmp_path, monkeypatch, caplog):
    """A kernel folder that cannot be written (here a file stands where it would be) used
    to be logged at info only: the kernels silently did not run, at half the speed, and
    `gumiho env` said "no" without a reason."""
    from gumiho import env

    monkeypatch.setattr(kernels, "FAILURES", {})
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "kernels").write_text("not a folder")
    monkeypatch.setenv("GUMIHO_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "twice.c"
    source.write_text(SOURCE)
    with caplog.at_level("WARNING", logger="gumiho"):
        assert kernels.built(kernels.library("twice", [source]), [source], "torch's run") \
            is None
    assert "twice not built" in caplog.text and "torch's run" in caplog.text
    assert str(tmp_path / "cache" / "kernels") in kernels.FAILURES["twice"]
    facts = env.report()
    assert facts["kernels"]["failed"] == kernels.FAILURES
    assert f"  twice did not build: {kernels.FAILURES['twice']}" in env.text(facts)


@builds_here
def test_a_compiler_command_with_arguments_is_used_as_given(tmp_path, monkeypatch):
    """$CC="ccache gcc" (a program and its arguments) was looked up whole on the PATH, not
    found, and gcc ran instead, silently."""
    import shutil

    gcc = shutil.which("gcc") or shutil.which("cc")
    monkeypatch.setenv("CC", f"env {gcc}")
    assert kernels.compiler() == f"{shutil.which('env')} {gcc}"
    monkeypatch.setenv("GUMIHO_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "twice.c"
    source.write_text(SOURCE)
    lib = kernels.built(kernels.library("twice", [source]), [source], "nothing")
    assert lib is not None and lib.twice(ctypes.c_int(4)) == 8
