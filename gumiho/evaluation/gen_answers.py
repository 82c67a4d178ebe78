"""Answer a benchmark with one method: `python -m gumiho.evaluation.gen_answers ...`.

Writes one JSONL line per question: per turn the text, token count, cycles, wall time and
per-cycle accept lengths, plus the full settings, device, dtype, versions and git commit.
A warm-up generation runs before any timed one. Rerunning the same command resumes: it
skips answered questions and drops only a half-written last record. A file that is not an
answer file, has a damaged line, or holds answers made with other settings, on other
hardware or by other code (`ENV_KEYS`: their speeds would not compare) is refused and left
untouched (`--overwrite` starts an answer file over).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from gumiho.checkpoint import check_drafter_dir, weights_file
from gumiho.errors import (
    ArgumentParser,
    GumihoError,
    cli_errors,
    nonnegative_int,
    positive_int,
)
from gumiho.evaluation.answers import (
    RECORD_START,
    RESUME_KEYS,
    AnswerFile,
    check_can_write,
    read_answer_file,
    settings_mismatch,
)
from gumiho.evaluation.benchmarks import LABELS, pick_questions
from gumiho.flags import (
    add_preset_arg,
    add_sampling_args,
    add_target_args,
    add_tree_args,
    sampling_settings,
    tree_options,
)
from gumiho.generate import SpeculativeGenerator, check_context_room
from gumiho.methods import METHODS
from gumiho.paths import file_sha256, write_atomically
from gumiho.version import code_version

# answers timed elsewhere, or by other code, must not share a file: their speeds would not
# compare (a resume after a commit that changes the package is refused; --overwrite)
ENV_KEYS = ("device", "device_name", "dtype", "attention", "torch", "transformers",
            "git_commit", "threads", "switches")


def switches() -> dict[str, str]:
    """The kernel switches (env.SWITCHES: GUMIHO_FUSED=0, GUMIHO_ROWGEMM=0, ...) set in the
    environment: they change which kernels run, so answers timed under others do not share
    a file. Not the device and dtype (recorded as such), the cache folder or GUMIHO_DEBUG."""
    from gumiho.env import SWITCHES

    skip = ("GUMIHO_DEVICE", "GUMIHO_DTYPE", "GUMIHO_CACHE", "GUMIHO_DEBUG")
    return {k: os.environ[k] for k in sorted(SWITCHES) if k in os.environ and k not in skip}


def environment(gen: SpeculativeGenerator) -> dict:
    import transformers

    device = gen.target.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"device": str(device), "device_name": name, "dtype": str(gen.target.dtype),
            "attention": gen.target.config._attn_implementation,
            "torch": torch.__version__, "transformers": transformers.__version__,
            "git_commit": code_version(), "threads": torch.get_num_threads(),
            "switches": switches()}


def template_label(template: str | None) -> str | None:
    """--chat-template as answers record it: a name as it is, a Jinja string by its digest
    (the prompts differ with it, so answers under two do not share a file or a row)."""
    if template is None or len(template) <= 40:
        return template
    return "sha256:" + hashlib.sha256(template.encode()).hexdigest()[:16]


def drafter_sha256(draft: str | None) -> str | None:
    """The sha256 of a drafter dir's weights file (None: no drafter, or 'random'): the path
    alone would let a resume append answers from other weights put in the same folder. It
    reads the whole file: the shipped drafters (3-39 MB) in a fraction of a second."""
    if draft is None or draft == "random":
        return None
    return file_sha256(weights_file(check_drafter_dir(draft)))


def answer(gen: SpeculativeGenerator, question: dict, max_new_tokens: int, seed: int = 0,
           **settings) -> list[dict]:
    """All turns of one question; later turns see the model's own earlier answers (turn i
    sampled with seed + i). `settings`: generate's other keywords (temperature, the cut,
    the penalty)."""
    messages, turns = [], []
    for i, turn in enumerate(question["turns"]):
        messages.append({"role": "user", "content": turn})
        result = gen.generate(messages, max_new_tokens, seed=seed + i, **settings)
        messages.append({"role": "assistant", "content": result.text})
        turns.append({"text": result.text, "new_tokens": result.new_tokens,
                      "cycles": result.cycles, "wall_s": result.wall_s,
                      "accept_lengths": result.accept_lengths,
                      "stopped_by": result.stopped_by})
    return turns


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m gumiho.evaluation.gen_answers",
                       description=__doc__.split("\n")[0])
    add_target_args(p)
    p.add_argument("--method", required=True, choices=METHODS)
    p.add_argument("--draft", default=None)
    p.add_argument("--bench", required=True, choices=list(LABELS))
    p.add_argument("--max-new-tokens", type=positive_int, default=512)
    p.add_argument("--question-begin", type=nonnegative_int, default=0)
    p.add_argument("--question-end", type=nonnegative_int, default=None)
    p.add_argument("--answer-file", required=True)
    p.add_argument("--overwrite", action="store_true",
                   help="start the answer file over (it must be an answer file; it is "
                   "replaced once the first new answer is ready)")
    p.add_argument("--label", default=None,
                   help="the report's name for this run (default: the method and what sets "
                   "it apart, e.g. two drafters of one method side by side)")
    add_sampling_args(p)
    p.add_argument("--warmup", type=nonnegative_int, default=1,
                   help="untimed warm-up generations")
    add_preset_arg(p)
    add_tree_args(p)
    return p


def existing_answers(path: Path, overwrite: bool) -> AnswerFile | None:
    """What the answer file holds; None if there is none or --overwrite starts it over.
    Anything that is not an answer file is refused and left untouched, --overwrite or not."""
    check_can_write(path)
    if not path.exists():
        return None
    try:
        found = read_answer_file(path)
    except GumihoError:
        if overwrite and path.read_bytes().startswith(RECORD_START):
            return None  # a damaged answer file: --overwrite may replace it
        raise
    return None if overwrite else found


def check_resume(path: Path, found: AnswerFile | None, settings: dict,
                 keys: tuple[str, ...] = RESUME_KEYS, env: dict | None = None) -> None:
    """Refuse to append answers made with other settings (naming the first that differs)."""
    for rec, line in zip(found.records if found else [], found.lines if found else [],
                         strict=True):
        diff = settings_mismatch(rec["settings"], settings, keys)
        if diff is None and env is not None:
            diff = settings_mismatch(rec.get("env", {}), env, ENV_KEYS)
        if diff:
            raise GumihoError(f"{path} holds answers made with other settings (line {line}: "
                              f"{diff}): use another --answer-file, the same settings to "
                              "resume, or --overwrite to start over")


class AnswerWriter:
    """Appends one line per answered question, each flushed at once. Before the first one
    it drops a half-written last record; with --overwrite, the old file is replaced only
    when the first new record is ready."""

    def __init__(self, path: Path, found: AnswerFile | None):
        self.path, self.found, self.file = path, found, None

    def write(self, record: dict) -> None:
        line = (json.dumps(record) + "\n").encode()
        if self.file is None:
            if self.found is None:  # new file, or --overwrite
                self.path.parent.mkdir(parents=True, exist_ok=True)
                write_atomically(self.path, lambda tmp: tmp.write_bytes(line))
                self.file = self.path.open("ab")
                return
            self.file = self.path.open("r+b")
            self.file.truncate(self.found.keep_bytes)  # only a half-written record
            self.file.seek(self.found.keep_bytes)
            if self.found.needs_newline:
                line = b"\n" + line
        self.file.write(line)
        self.file.flush()
        os.fsync(self.file.fileno())

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


# checked before the slow load (the tree and device after it)
RESUME_IDENTITY = ("target", "method", "draft", "draft_sha256", "bench", "temperature",
                   "sample_top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "ignore_eos", "max_new_tokens", "seed", "chat_template")


class Job:
    """One method answering one benchmark into one answer file: what is already there,
    what is left, and (once `start` has its generator) the settings every record carries."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.questions = pick_questions(args.bench, args.question_begin, args.question_end)
        self.path = Path(args.answer_file)
        self.found = existing_answers(self.path, args.overwrite)
        self.identity = {k: getattr(args, k, None) for k in RESUME_IDENTITY}
        self.identity["draft_sha256"] = drafter_sha256(args.draft)
        self.identity["chat_template"] = template_label(args.chat_template)
        check_resume(self.path, self.found, self.identity, keys=RESUME_IDENTITY)
        done = {rec["question_id"] for rec in self.found.records} if self.found else set()
        self.todo = [q for q in self.questions if q["question_id"] not in done]
        self.gen = self.writer = None

    def load(self, target=None) -> SpeculativeGenerator:
        """The generator; `target` (a loaded Target) is shared instead of loading another."""
        a = self.args
        where = {} if target is not None else {
            "device": a.device, "dtype": a.dtype, "chat_template": a.chat_template,
            "attention": a.attention}
        return SpeculativeGenerator.load(a.target if target is None else target, a.method,
                                         a.draft, engine=a.engine, preset=a.preset,
                                         temperature=a.temperature, **where,
                                         **tree_options(a))

    def start(self, gen: SpeculativeGenerator) -> None:
        """Check the full settings against the file, warm up, open the writer."""
        a = self.args
        # the settings the drafter for this temperature was built with (auto sizes it)
        tree = getattr(gen.drafter_for(a.temperature), "tree", None)
        self.settings = {**self.identity, "tree": vars(tree) if tree is not None else None,
                         "engine": gen.engine, "auto_tree": gen.auto_report_for(a.temperature)}
        if a.label:  # a name for the report only: resuming does not compare it
            self.settings["label"] = a.label
        self.env = environment(gen)
        check_resume(self.path, self.found, self.settings, env=self.env)
        for _ in range(a.warmup):
            gen.generate(self.todo[0]["turns"][0], min(32, a.max_new_tokens),
                         **{**sampling_settings(a), "seed": 0})
        self.gen, self.writer = gen, AnswerWriter(self.path, self.found)

    def answer(self, question: dict) -> None:
        a = self.args
        turns = answer(self.gen, question, a.max_new_tokens, **sampling_settings(a))
        self.writer.write({"question_id": question["question_id"], "turns": turns,
                           "settings": self.settings, "env": self.env})

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


@cli_errors(resume="every finished answer is kept in the answer file; rerun the same "
            "command to resume")
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    job = Job(args)  # before the slow load
    if not job.todo:
        print(f"all {len(job.questions)} questions are already answered in {job.path}",
              file=sys.stderr)
        return 0
    check_context_room(args.target, args.max_new_tokens)
    try:
        job.start(job.load())
        for q in tqdm(job.todo, desc=f"{args.method} {args.bench}", unit="q"):
            job.answer(q)
    finally:
        job.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
