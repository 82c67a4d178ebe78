"""Answer a benchmark with several methods, question by question:
`python -m gumiho.evaluation.interleave [common flags] --run "FLAGS" --run "FLAGS" ...`.

Why: a shared or thermally limited machine drifts by several percent within minutes. When
each method answers all questions in turn (one `gen_answers` after another), that drift
lands on whichever method runs then, and two methods a few percent apart swap places from
one run to the next (docs/history.md, "Testbed tables of earlier drafters": the same 12
CNN/DM-like questions read 1.27x, then 1.48x). Here every method answers question 1, then
every method question 2, and so on, with the order rotating by one from question to
question, so drift falls on all of them alike and each method runs first equally often.

Common flags (once, outside --run): --target, --device, --dtype, --chat-template,
--attention, --bench, --temperature, --sample-top-k, --top-p, --min-p, the three penalties,
--ignore-eos, --max-new-tokens, --question-begin, --question-end, --seed, --warmup,
--overwrite. Each --run holds one method's own `gen_answers` flags: --method, --draft,
--answer-file, --label, --engine, --preset and the tree flags (--engine, --preset or a
tree flag given outside --run applies to every run that does not give its own). The
target is loaded once and shared. Answer files are exactly gen_answers' (the speed report
reads them as usual), and rerunning the same command resumes each of them where it
stopped.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from tqdm import tqdm

from gumiho.errors import ArgumentParser, GumihoError, cli_errors
from gumiho.evaluation.gen_answers import Job, build_parser
from gumiho.generate import check_context_room
from gumiho.target import load_target

# flags that must be the same for every run: one target, one question list
COMMON = ("--target", "--device", "--dtype", "--chat-template", "--attention", "--bench",
          "--temperature", "--sample-top-k", "--top-p", "--min-p", "--repetition-penalty",
          "--presence-penalty", "--frequency-penalty", "--ignore-eos",
          "--max-new-tokens", "--question-begin", "--question-end", "--seed", "--warmup",
          "--overwrite")


def parse_runs(argv: list[str] | None) -> list:
    """One gen_answers namespace per --run: the common flags plus the run's own."""
    p = ArgumentParser(prog="python -m gumiho.evaluation.interleave",
                       description=__doc__.split("\n")[0],
                       epilog=f"Flags shared by every run, given once: {', '.join(COMMON)} "
                       "(as in `python -m gumiho.evaluation.gen_answers --help`).")
    p.add_argument("--run", action="append", required=True, metavar="FLAGS",
                   help="one method's gen_answers flags, quoted: --method M [--draft D] "
                   "--answer-file F [--engine E] [tree flags]; give --run once per method")
    ns, common = p.parse_known_args(argv)
    parser = build_parser()
    parser.prog = p.prog
    parser.allow_abbrev = False  # an abbreviated shared flag would pass the check below
    runs = []
    for text in ns.run:
        try:
            own = shlex.split(text)
        except ValueError as exc:
            raise GumihoError(f"--run {text!r}: {exc}") from None
        for token in own:
            if token.split("=", 1)[0] in COMMON:
                raise GumihoError(f"--run {text!r}: give {token.split('=', 1)[0]} once, "
                                  "outside --run (every run shares it)")
        runs.append(parser.parse_args([*common, *own]))
    files = [r.answer_file for r in runs]
    if len({Path(f).resolve() for f in files}) < len(files):
        raise GumihoError(f"two runs write the same answer file: {files}")
    return runs


@cli_errors(resume="every finished answer is kept in its answer file; rerun the same "
            "command to resume")
def main(argv: list[str] | None = None) -> int:
    runs = parse_runs(argv)
    jobs = [Job(args) for args in runs]  # every file checked before the slow load
    first = runs[0]
    questions = jobs[0].questions
    busy = [job for job in jobs if job.todo]
    if not busy:
        print(f"all {len(questions)} questions are already answered by every run",
              file=sys.stderr)
        return 0
    check_context_room(first.target, first.max_new_tokens)
    target = load_target(first.target, device=first.device, dtype=first.dtype,
                         chat_template=first.chat_template, attn_implementation=first.attention)
    pending = [{t["question_id"] for t in job.todo} for job in jobs]
    try:
        for job in busy:
            job.start(job.load(target))
        for i, q in enumerate(tqdm(questions, desc=f"{first.bench}: {len(busy)} methods",
                                   unit="q")):
            shift = i % len(jobs)
            for k in [*range(shift, len(jobs)), *range(shift)]:  # each first equally often
                if q["question_id"] in pending[k]:
                    jobs[k].answer(q)
    finally:
        for job in jobs:
            job.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
