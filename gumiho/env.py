"""`gumiho env`: what this machine runs, for a bug report or a speed question.

Speed on a CPU depends on which of our paths run here (the C kernels, their AVX-512 or AMX
variants, rowlayer.c's decoder steps, the fused Llama decoder, packed layers) and on the
switches that turn them off; on a GPU, on the device and the CUDA build. This prints them,
with the versions and the demo's default on this machine, in about ten seconds on a 2-core
CPU and without loading a model (the kernels are built and checked as they would be at
first use). `--json` prints the same as one JSON object. The idea is vLLM's `collect_env`
and transformers' `env` command, for our own paths.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from importlib import metadata
from pathlib import Path

import torch

from gumiho import kernels, rowamx, rowgemm, rowlayer, softce
from gumiho.demo import exact_bf16_here
from gumiho.errors import ArgumentParser, GumihoError, cli_errors
from gumiho.paths import cache_dir
from gumiho.target import choose_device_dtype
from gumiho.version import __version__, code_version

SWITCHES = {  # what each turns off or sets (the README's Design table says more)
    "GUMIHO_ROWGEMM": "0: rowgemm.c off (torch's float32 products and attention)",
    "GUMIHO_ROWGEMM512": "0: rowgemm.c's AVX2 blocks only",
    "GUMIHO_ROWAMX": "0: rowamx.c off (oneDNN's bf16 products)",
    "GUMIHO_ROWATTN_AMX": "0: rowattention.c's bf16 attention on FMAs, not AMX tiles",
    "GUMIHO_FUSED": "0: transformers' decoder for Llama targets on the CPU",
    "GUMIHO_ROWLAYER": "0: fused.py's torch calls for steps rowlayer.c would take",
    "GUMIHO_PACK": "0: CPU layers not packed",
    "GUMIHO_DRAFT_HEAD16": "0: a float32 drafter's vocabulary head from float32, not 16 bits",
    "GUMIHO_SOFTCE": "0: softce.c off (training's soft cross-entropy by torch's operators)",
    "GUMIHO_DEVICE": "the default device",
    "GUMIHO_DTYPE": "the default dtype",
    "GUMIHO_CACHE": "the cache folder",
    "GUMIHO_DEBUG": "1: full tracebacks",
}


def cpu_name() -> str:
    """The CPU's model name (Linux), else what the platform says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def version_of(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def report() -> dict:
    """The facts `gumiho env` prints, as a dict."""
    gemm, amx = rowgemm.kernel(), rowamx.kernel()
    try:
        device, dtype = choose_device_dtype()
    except GumihoError as exc:  # a bad $GUMIHO_DEVICE or $GUMIHO_DTYPE: report it
        device, dtype = f"error: {exc}", None
    cpu_exact = exact_bf16_here(torch.device("cpu"))
    facts = {
        "gumiho": {"version": __version__, "code": code_version(short=True),
                   "path": str(Path(__file__).parent)},
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": version_of("transformers"),
        "platform": platform.platform(),
        "cpu": {"name": cpu_name(), "threads": torch.get_num_threads(),
                "torch_capability": torch.backends.cpu.get_cpu_capability(),
                "amx_tiles": rowamx.amx_cpu()},
        "kernels": {
            "compiler": kernels.compiler(),
            "rowgemm": gemm is not None,
            "rowgemm_avx512_blocks": bool(gemm is not None and gemm.wide),
            "rowamx": amx is not None,
            "rowattention_amx_tiles": bool(gemm is not None and gemm.tiled),
            "fused_decoder": os.environ.get("GUMIHO_FUSED", "1") != "0",
            "rowlayer": rowlayer.enabled(),
            "packed_layers": os.environ.get("GUMIHO_PACK", "1") != "0",
            "softce": softce.kernel() is not None,
            "folder": str(cache_dir() / "kernels"),
            "failed": dict(kernels.FAILURES),  # a build or load that failed: why
        },
        "default": {"device": str(device),
                    "dtype": None if dtype is None else str(dtype).removeprefix("torch."),
                    # (a $GUMIHO_DTYPE the user set is the demo's dtype too)
                    "demo_on_cpu": os.environ.get("GUMIHO_DTYPE") or (
                        "bfloat16, sdpa_invariant (exact)" if cpu_exact else "float32")},
        "cuda": None,
        "switches": {name: os.environ[name] for name in SWITCHES if name in os.environ},
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        facts["cuda"] = {"devices": torch.cuda.device_count(), "name": props.name,
                         "memory_gib": round(props.total_memory / 2**30, 1),
                         "capability": f"{props.major}.{props.minor}",
                         "cuda": torch.version.cuda}
    return facts


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def text(facts: dict) -> str:
    """`report()` as the lines `gumiho env` prints."""
    cpu, kernels, default = facts["cpu"], facts["kernels"], facts["default"]
    gumiho = facts["gumiho"]
    lines = [
        f"gumiho {gumiho['version']}"  # (the commit, where it runs from a checkout)
        + ("" if gumiho["code"].startswith("gumiho ") else f" ({gumiho['code']})")
        + f" at {gumiho['path']}",
        f"python {facts['python']}, torch {facts['torch']}, transformers "
        f"{facts['transformers'] or 'not installed'}; {facts['platform']}",
        f"cpu: {cpu['name']}, {cpu['threads']} threads, torch capability "
        f"{cpu['torch_capability']}, AMX tiles: {_yes(cpu['amx_tiles'])}",
    ]
    cuda = facts["cuda"]
    lines.append("cuda: not available" if cuda is None else
                 f"cuda: {cuda['devices']} x {cuda['name']} ({cuda['memory_gib']} GiB, "
                 f"capability {cuda['capability']}, CUDA {cuda['cuda']})")
    lines += [
        f"C compiler: {kernels['compiler'] or 'none (the C kernels do not build)'}",
        f"rowgemm.c (float32 products, row-invariant attention): {_yes(kernels['rowgemm'])}"
        + (f", AVX-512 blocks: {_yes(kernels['rowgemm_avx512_blocks'])}"
           if kernels["rowgemm"] else ""),
        f"rowamx.c (bf16 products on AMX tiles): {_yes(kernels['rowamx'])}"
        + (f", bf16 attention on them: {_yes(kernels['rowattention_amx_tiles'])}"
           if kernels["rowamx"] else ""),
        f"rowlayer.c (Llama decoder steps of up to 80 tokens in one C call, targets' and "
        f"drafters'): {_yes(kernels['rowlayer'])}",
        f"fused Llama decoder on the CPU: {_yes(kernels['fused_decoder'])}; packed CPU "
        f"layers: {_yes(kernels['packed_layers'])}",
        f"softce.c (training's soft cross-entropy on the CPU): {_yes(kernels['softce'])}",
        f"kernel folder: {kernels['folder']}",
        *(f"  {name} did not build: {why}" for name, why in kernels["failed"].items()),
        f"default device and dtype: {default['device']}"
        + (f", {default['dtype']}" if default["dtype"] else "")
        + f"; `gumiho demo` on the CPU: {default['demo_on_cpu']}",
    ]
    switches = facts["switches"]
    lines.append("switches set: " + (", ".join(f"{k}={v}" for k, v in switches.items())
                                     if switches else "none"))
    return "\n".join(lines)


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="gumiho env", description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="one JSON object instead of lines")
    return p


@cli_errors
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    facts = report()
    print(json.dumps(facts, indent=1) if args.json else text(facts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
