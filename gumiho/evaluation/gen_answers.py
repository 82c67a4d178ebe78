"""Answer a benchmark with one method: `python -m gumiho.evaluation.gen_answers ...`.

Writes one JSONL line per question: per turn the text, token count, cycles, wall time and
per-cycle accept lengths, plus the full settings, device, dtype, versions and git commit.
A warm-up generation runs before any timed one. Rerunning with the same --answer-file
skips answered questions (a half-written last line is dropped).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from gumiho.config import METHODS
from gumiho.errors import cli_errors
from gumiho.evaluation.benchmarks import LABELS, load_questions
from gumiho.generate import SpeculativeGenerator, add_target_args, add_tree_args, tree_options
from gumiho.version import code_version


def environment(gen: SpeculativeGenerator) -> dict:
    import transformers

    device = gen.target.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"device": str(device), "device_name": name, "dtype": str(gen.target.dtype),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "git_commit": code_version(), "threads": torch.get_num_threads()}


def answered(path: Path) -> set:
    """Question ids already in the answer file; drops a trailing half-written line."""
    if not path.exists():
        return set()
    lines = path.read_text().splitlines(keepends=True)
    good, done = [], set()
    for line in lines:
        try:
            done.add(json.loads(line)["question_id"])
            good.append(line if line.endswith("\n") else line + "\n")
        except (json.JSONDecodeError, KeyError):
            break
    path.write_text("".join(good))
    return done


def answer(gen: SpeculativeGenerator, question: dict, max_new_tokens: int,
           temperature: float, seed: int) -> list[dict]:
    """All turns of one question; later turns see the model's own earlier answers."""
    messages, turns = [], []
    for i, turn in enumerate(question["turns"]):
        messages.append({"role": "user", "content": turn})
        result = gen.generate(messages, max_new_tokens, temperature, seed + i)
        messages.append({"role": "assistant", "content": result.text})
        turns.append({"text": result.text, "new_tokens": result.new_tokens,
                      "cycles": result.cycles, "wall_s": result.wall_s,
                      "accept_lengths": result.accept_lengths,
                      "stopped_by": result.stopped_by})
    return turns


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gumiho.evaluation.gen_answers",
                                description=__doc__.split("\n")[0])
    add_target_args(p)
    p.add_argument("--method", required=True, choices=METHODS)
    p.add_argument("--draft", default=None)
    p.add_argument("--bench", required=True, choices=list(LABELS))
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--question-begin", type=int, default=0)
    p.add_argument("--question-end", type=int, default=None)
    p.add_argument("--answer-file", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=1, help="untimed warm-up generations")
    add_tree_args(p)
    return p


@cli_errors
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    gen = SpeculativeGenerator.load(args.target, args.method, args.draft,
                                    device=args.device, dtype=args.dtype,
                                    chat_template=args.chat_template, engine=args.engine,
                                    **tree_options(args))
    questions = load_questions(args.bench)[args.question_begin : args.question_end]
    path = Path(args.answer_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    done = answered(path)
    todo = [q for q in questions if q["question_id"] not in done]
    for _ in range(args.warmup if todo else 0):
        gen.generate(todo[0]["turns"][0], min(32, args.max_new_tokens))
    tree = getattr(gen.drafter, "tree", None)  # the settings the drafter was built with
    settings = {"target": args.target, "method": args.method, "draft": args.draft,
                "bench": args.bench, "temperature": args.temperature,
                "max_new_tokens": args.max_new_tokens, "seed": args.seed,
                "tree": vars(tree) if tree is not None else None,
                "engine": gen.engine,
                "auto_tree": gen.auto_report}
    env = environment(gen)
    with path.open("a") as f:
        for q in tqdm(todo, desc=f"{args.method} {args.bench}", unit="q"):
            turns = answer(gen, q, args.max_new_tokens, args.temperature, args.seed)
            f.write(json.dumps({"question_id": q["question_id"], "turns": turns,
                                "settings": settings, "env": env}) + "\n")
            f.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
