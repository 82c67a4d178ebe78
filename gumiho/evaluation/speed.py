"""Speed report from answer files: `python -m gumiho.evaluation.speed --answers F ... --out R`.

Per benchmark and method (same engine, same questions, same token counting):
tokens/s, speedup over plain decoding (`ar`) on the questions both answered, tau =
new tokens / cycles (the prefill counts as a cycle), tau_official = new tokens /
(cycles - 1) as the released scripts compute it, and per-position acceptance over verify
cycles: unconditional a_i (fraction of cycles that accept at least i drafts, vLLM's
figure) and conditional a_i / a_{i-1}; at T=0, how many answers are the same text as plain
decoding's (every turn). Paired by question: a 90% bootstrap interval of each speedup (over
the questions; it does not cover drift between separate runs, which the interleaved runner
removes), and on how many questions each method was faster than prompt lookup alone
(`--versus`). Each row covers the questions it shares with the baseline; its last column
says how many, and where they are fewer than the baseline row's, the baseline's rate on
them (what its speedup divides by). Notes (on stderr and under the table) name answers far
slower than their run's median on the benchmark (a busy machine), answers left out (no
baseline answer to pair with, a half-written last line, questions outside
--question-begin/--question-end: a run's own range, where its files hold an earlier run's
answers too), and mean rows over fewer benchmarks than the report's (each method's mean
averages the benchmarks it ran). Writes R.md, R.json and R.png.
"""

from __future__ import annotations

import json
import random
import sys
from collections import defaultdict
from pathlib import Path

from gumiho.config import TreeConfig
from gumiho.errors import ArgumentParser, GumihoError, cli_errors, nonnegative_int
from gumiho.evaluation.answers import DEFAULTS, read_answer_file, settings_mismatch
from gumiho.evaluation.benchmarks import LABELS, pick_questions
from gumiho.evaluation.speed_tables import markdown, plot
from gumiho.methods import BY_NAME

MAX_POSITIONS = 8
# An answer slower than this fraction of its run's median tokens/s on the benchmark is
# flagged: a busy machine, not the method (speculative answers of one run spread within
# about 2x; a burst of other work on a 2-core CPU slows one answer 3-4x).
SLOW_ANSWER = 0.5
RESAMPLES = 2000  # bootstrap draws for a speedup's interval (seeded: reports reproduce)
# Answers pooled into one row must come from one kind of run.
GROUP_KEYS = ("target", "draft", "draft_sha256", "max_new_tokens", "seed", "tree", "engine",
              "chat_template")


def sampling_key(settings: dict) -> float | str:
    """How a run's answers were decoded, the report's first split: the temperature, and
    past it the sampling cut where one was set ("0.7, top-p 0.9"; a cut is moot at T = 0)
    and any penalty or ignore_eos (at any T: "0, repetition penalty 1.3"). A record from
    before these existed has none (answers.DEFAULTS)."""
    t = settings["temperature"]
    k, p, m, r, pp, fp = (settings.get(key, DEFAULTS[key]) for key in (
        "sample_top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
        "frequency_penalty"))
    cut = ([f"top-k {k}"] if k else []) + ([f"top-p {p:g}"] if p < 1 else []) + \
        ([f"min-p {m:g}"] if m else [])
    penalties = ([f"repetition penalty {r:g}"] if r != 1 else []) + \
        ([f"presence penalty {pp:g}"] if pp else []) + \
        ([f"frequency penalty {fp:g}"] if fp else []) + \
        (["ignore eos"] if settings.get("ignore_eos", DEFAULTS["ignore_eos"]) else [])
    parts = (cut if t else []) + penalties
    return ", ".join([str(t), *parts]) if parts else t


def method_label(settings: dict) -> str:
    """The method, plus what sets this run apart: a random drafter, a non-default FTA, a
    tree size other than the reference's (auto's or the user's) or a wider pool, a
    prompt-lookup chain other than the method's own (beside a drafter's tree); or the run's
    own --label."""
    if settings.get("label"):
        return settings["label"]
    notes = ["random"] if settings.get("draft") == "random" else []
    tree = settings.get("tree") or {}
    fta = tree.get("fta", "off")
    spec = BY_NAME.get(settings["method"])
    if fta != "off" and spec is not None and "fta" in spec.tree_flags:
        notes.append(f"fta {fta}")
    if spec is not None and "serial_levels" in spec.tree_flags and \
            tree.get("serial_levels", 0) not in (0, spec.serial_levels):  # not its own
        notes.append(f"serial levels {tree['serial_levels']}")
    if settings.get("auto_tree"):  # budget.choose_tree's report: the tree it chose
        chosen = settings["auto_tree"]["tree"]
        notes.append(f"auto tree {chosen['total_tokens']}" +
                     (f", depth {chosen['depth']}" if chosen.get("depth") is not None else ""))
        notes += wider_than_reference(chosen, spec)
    elif spec is not None and spec.drafter and tree:  # a size of the user's own
        reference = TreeConfig.for_method(settings["method"])
        size = (tree.get("total_tokens", reference.total_tokens),
                tree.get("depth", reference.depth))
        if size != (reference.total_tokens, reference.depth):
            notes.append(f"tree {size[0]}, depth {size[1]}")
        notes += wider_than_reference(tree, spec)
    reference_lookup = spec.tree.get("lookup", 0) if spec is not None else 0
    if tree.get("lookup", reference_lookup) != reference_lookup:
        notes.append(f"lookup {tree['lookup']}")
    if tree.get("lookup_first") and spec is not None and spec.drafter:
        notes.append("lookup first")
    if tree.get("draft_gate") and spec is not None and spec.drafter and \
            settings.get("engine", "eager") == "eager":
        notes.append("gated")
    eager_floors = spec is not None and "min_confidence" in spec.tree_flags and \
        settings.get("engine", "eager") == "eager"
    if tree.get("min_confidence") and eager_floors:
        notes.append(f"confidence {tree['min_confidence']:g}")
    if tree.get("extend_confidence", 0) > tree.get("min_confidence", 0) and eager_floors:
        notes.append(f"extend {tree['extend_confidence']:g}")
    return settings["method"] + (f" ({', '.join(notes)})" if notes else "")


def wider_than_reference(tree: dict, spec) -> list[str]:
    """Notes for a tree drawn from a wider pool than its method's reference (a beam, or
    nodes an MLP level, past the reference's, as budget.py's trees past the reference)."""
    if spec is None:
        return []
    reference, notes = TreeConfig.for_method(spec.name), []
    if "top_k" in spec.tree_flags and tree.get("top_k", 0) > reference.top_k:
        notes.append(f"beam {tree['top_k']}")
    if "pruning" in spec.tree_flags and tree.get("pruning", 0) > reference.pruning:
        notes.append(f"{tree['pruning']} a level")
    return notes


def read_answers(paths: list[str], notes: list[str] | None = None) -> dict[tuple, dict]:
    """{(label, bench, sampling): {question_id: record}} (`sampling_key`); a half-written
    last line (an interrupted run's) is left out with a line in `notes`."""
    groups: dict[tuple, dict] = defaultdict(dict)
    first: dict[tuple, tuple[str, dict]] = {}  # group -> (file, record) it started with
    source: dict[tuple, tuple] = {}  # (group, question) -> (file, line) that answered it
    for path in paths:
        if not Path(path).is_file():
            raise GumihoError(f"answer file {path} not found (give the .jsonl files that "
                              "gen_answers wrote)")
        found = read_answer_file(Path(path), writing=False)
        if found.half_line and notes is not None:
            notes.append(f"{path} line {found.half_line} is half-written (a run stopped while "
                         "writing it): left out (rerunning that run answers it again)")
        for rec, line in zip(found.records, found.lines, strict=True):
            s = rec["settings"]
            key = (method_label(s), s["bench"], sampling_key(s))
            where, ref = first.setdefault(key, (path, rec))
            diff = run_mismatch(ref, rec, GROUP_KEYS, (f"in {where}", f"in {path}"))
            if diff:
                raise GumihoError(f"{where} and {path} both hold {key[0]} {key[1]} answers at "
                                  f"T={key[2]}, but made differently ({diff}): report them "
                                  "separately")
            other, other_line = source.setdefault((key, rec["question_id"]), (path, line))
            if other != path:  # which of two answers would count depended on file order
                raise GumihoError(f"{other} and {path} both answer {key[0]} {key[1]} question "
                                  f"{rec['question_id']} at T={key[2]}: give one of them")
            if other_line != line:  # gen_answers writes one; two runs at once write two
                raise GumihoError(f"{path} answers {key[0]} {key[1]} question "
                                  f"{rec['question_id']} at T={key[2]} twice (lines "
                                  f"{other_line} and {line}): did two runs write to it at "
                                  "once? delete one of the two lines, or answer it again")
            groups[key][rec["question_id"]] = rec
    if not groups:
        raise GumihoError(f"no answers in {', '.join(paths)}: run gen_answers first")
    return groups


def asked_questions(groups: dict[tuple, dict], begin: int, end: int | None,
                    notes: list[str]) -> dict[tuple, dict]:
    """Only the answers to questions begin..end-1 of each benchmark: what a run asked for
    (its files may hold more, from an earlier run); a line in `notes` counts the rest."""
    asked: dict[str, set] = {}
    kept, left = {}, 0
    for key, answers in groups.items():
        if key[1] not in asked:
            asked[key[1]] = {q["question_id"] for q in pick_questions(key[1], begin, end,
                                                                      "reporting")}
        mine = {q: rec for q, rec in answers.items() if q in asked[key[1]]}
        left += len(answers) - len(mine)
        if mine:
            kept[key] = mine
    flags = f"--question-begin {begin}" + (f" --question-end {end}" if end is not None else "")
    if not kept:
        raise GumihoError(f"no answers in the files to the questions {flags} asks for: "
                          "answer them first, or give the range the files hold")
    if left:
        notes.append(f"{left} answers in the files are to other questions than {flags} asks "
                     "for: left out of the report")
    return kept


def run_mismatch(a: dict, b: dict, keys: tuple[str, ...],
                 sides: tuple[str, str] = ("in the file", "now")) -> str | None:
    """The first setting (or device/dtype/attention) on which two answer records' runs
    differ."""
    return settings_mismatch(a["settings"], b["settings"], keys, sides) or settings_mismatch(
        a.get("env", {}), b.get("env", {}), ("device", "dtype", "attention"), sides)


def stats(records: list[dict]) -> dict:
    """Totals and acceptance over all turns of the given question records."""
    tokens = cycles = 0
    wall = 0.0
    drafts_per_cycle: list[int] = []
    for rec in records:
        for turn in rec["turns"]:
            tokens += turn["new_tokens"]
            cycles += turn["cycles"]
            wall += turn["wall_s"]
            drafts_per_cycle += [n - 1 for n in turn["accept_lengths"][1:]]
    verify = max(len(drafts_per_cycle), 1)
    verify_cycles = cycles - sum(len(r["turns"]) for r in records)
    reach = [sum(d >= i for d in drafts_per_cycle) / verify for i in range(1, MAX_POSITIONS)]
    conditional = [r / prev if prev else 0.0 for prev, r in zip([1.0] + reach, reach,
                                                                strict=False)]
    return {"questions": len(records), "new_tokens": tokens, "cycles": cycles, "wall_s": wall,
            "tokens_per_s": tokens / wall if wall else 0.0, "tau": tokens / max(cycles, 1),
            # answers that ended at their prefill have no verify cycle: with none at all,
            # the official formula's per-answer floor (GenerationResult.tau_official), 1
            "tau_official": tokens / verify_cycles if verify_cycles > 0 else
            tokens / max(cycles, 1),
            "acceptance": reach, "acceptance_conditional": conditional}


def same_text(a: dict, b: dict) -> bool | None:
    """Whether two answers to one question say the same in every turn (None: no text)."""
    texts = [[turn.get("text") for turn in rec["turns"]] for rec in (a, b)]
    if any(t is None for turns in texts for t in turns):
        return None
    return texts[0] == texts[1]


def identical_count(answers: dict, base: dict, shared: list) -> list[int] | None:
    """[answers with the baseline's text, answers compared], or None where any lacks text."""
    same = [same_text(answers[q], base[q]) for q in shared]
    return None if None in same else [sum(same), len(same)]


def totals(rec: dict) -> tuple[int, float]:
    """(new tokens, wall seconds) over all turns of one answer."""
    return (sum(t["new_tokens"] for t in rec["turns"]),
            sum(t["wall_s"] for t in rec["turns"]))


def speedup_interval(answers: dict, base: dict, shared: list) -> list[float]:
    """5th and 95th percentiles of the speedup over questions resampled with replacement."""
    pairs = [(totals(answers[q]), totals(base[q])) for q in shared]
    rng, draws = random.Random(0), []
    for _ in range(RESAMPLES):
        pick = rng.choices(pairs, k=len(pairs))
        mine = sum(a[0] for a, _ in pick) / max(sum(a[1] for a, _ in pick), 1e-12)
        theirs = sum(b[0] for _, b in pick) / max(sum(b[1] for _, b in pick), 1e-12)
        draws.append(mine / theirs if theirs else 0.0)
    draws.sort()
    return [draws[int(0.05 * RESAMPLES)], draws[int(0.95 * RESAMPLES) - 1]]


def rate(rec: dict) -> float:
    tokens, wall = totals(rec)
    return tokens / max(wall, 1e-12)


def commits(groups: dict[tuple, dict]) -> list[str]:
    """A note when the answers came from more than one commit (the report's header names
    the first file's): which runs each commit made."""
    made: dict[str, set] = defaultdict(set)
    for (label, bench, _), answers in groups.items():
        for rec in answers.values():
            made[rec.get("env", {}).get("git_commit", "unknown")].add(f"{label} {bench}")
    if len(made) < 2:
        return []
    return ["the answers come from " + str(len(made)) + " commits: " + "; ".join(
        f"{commit}: {', '.join(sorted(runs))}" for commit, runs in sorted(made.items()))]


def slow_answers(groups: dict[tuple, dict]) -> list[str]:
    """A note per answer far below its run's median rate on its benchmark."""
    notes = []
    for (label, bench, temp), answers in sorted(groups.items(), key=str):
        if len(answers) < 3:
            continue
        rates = {q: rate(rec) for q, rec in answers.items()}
        median = sorted(rates.values())[len(rates) // 2]
        for q, r in rates.items():
            if r < SLOW_ANSWER * median:
                notes.append(f"{bench} question {q} at T={temp}: {label} ran at "
                             f"{r:.1f} tokens/s against its median {median:.1f} "
                             "there; was the machine busy? (answer it again to check)")
    return notes


def wins(answers: dict, other: dict) -> list[int]:
    """[questions this run answered at more tokens/s than `other`, questions both answered]."""
    shared = set(answers) & set(other)
    return [sum(rate(answers[q]) > rate(other[q]) for q in shared), len(shared)]


def report(groups: dict[tuple, dict], baseline: str = "ar",
           notes: list[str] | None = None, versus: str = "lookup") -> dict:
    """{temperature: {bench: {label: stats + speedup}}, with a "mean" bench}. Rows without
    a baseline on the same questions get no speedup (and a line in `notes`). Rows other than
    the baseline and `versus` count their per-question wins over `versus` where it ran."""
    notes = [] if notes is None else notes
    out: dict = defaultdict(lambda: defaultdict(dict))
    unpaired: dict[tuple, list[str]] = defaultdict(list)  # (bench, temp) -> labels
    ran = any(label == baseline for label, _, _ in groups)  # else main's note says it
    for key, answers in groups.items():
        label, bench, temp = key
        if ran and label != baseline and (baseline, bench, temp) not in groups:
            unpaired[bench, temp].append(label)
        row = paired_row(key, answers, groups.get((baseline, bench, temp), {}), baseline,
                         notes)
        other = groups.get((versus, bench, temp))
        if other and label not in (baseline, versus) and set(answers) & set(other):
            row["wins_vs"] = wins(answers, other)
        out[temp][bench][label] = row
    temps_without = ({temp for _, _, temp in groups} -
                     {t for b, _, t in groups if b == baseline}) if ran else set()
    for temp in sorted(temps_without, key=str):
        notes.append(f"no {baseline} answers at T={temp}: no speedups there")
    for (bench, temp), labels in sorted(unpaired.items(), key=str):
        if temp not in temps_without:
            notes.append(f"no {baseline} answers on {bench} at T={temp}: no speedup for "
                         f"{', '.join(sorted(labels))} there, nor in the mean row (answer "
                         f"it with {baseline} too)")
    for temp, benches in out.items():
        benches["mean"] = mean_rows(benches, temp, notes)
    return json.loads(json.dumps(out))


def paired_row(key: tuple, answers: dict, base: dict, baseline: str, notes: list[str]
               ) -> dict:
    """One run's stats on the questions the baseline answered too (all of its own where
    they share none), with its speedup over the baseline's rate on those same questions
    (`baseline_tokens_per_s`); `notes` names the answers left out and unfair pairings."""
    label, bench, temp = key
    shared = sorted(set(answers) & set(base), key=str)
    if base and not shared:
        notes.append(f"{label} and {baseline} share no {bench} question at T={temp}: "
                     "no speedup for it (answer the same questions to compare)")
    left = sorted(set(answers) - set(base), key=str) if shared else []
    if left:
        notes.append(f"{bench} at T={temp}: {len(left)} {label} answer"
                     f"{'s' if len(left) > 1 else ''} ({_ids(left)}) left out of its row (no "
                     f"{baseline} answer to pair with)")
    row = stats([answers[q] for q in shared or answers])
    unfair = shared and run_mismatch(answers[shared[0]], base[shared[0]],
                                     ("target", "engine", "max_new_tokens", "chat_template"),
                                     (f"for {label}", f"for {baseline}"))
    if unfair:
        notes.append(f"{label} and {baseline} on {bench} ran differently ({unfair}): no "
                     "speedup for it")
    if not shared or unfair:
        return row
    base_rate = stats([base[q] for q in shared])["tokens_per_s"]
    if base_rate > 0:
        row["speedup"], row["baseline_tokens_per_s"] = row["tokens_per_s"] / base_rate, base_rate
        if label != baseline and len(shared) > 1:  # one question: no spread to bound
            row["speedup_interval"] = speedup_interval(answers, base, shared)
    # Greedy output must equal plain decoding's (SPEC: lossless); sampled need not.
    if answers[shared[0]]["settings"]["temperature"] == 0 and label != baseline:
        same = identical_count(answers, base, shared)
        if same is not None:
            row["identical"] = same
    return row


def _ids(questions: list) -> str:
    return ("questions " if len(questions) > 1 else "question ") + ", ".join(
        map(str, questions[:5])) + (", ..." if len(questions) > 5 else "")


def mean_rows(benches: dict, temp, notes: list[str]) -> dict:
    """Each method's mean over the benchmarks it ran (`benchmarks`); `notes` names the
    methods that ran fewer than the report holds, whose means average other benchmarks."""
    rank = {b: i for i, b in enumerate(LABELS)}
    order = sorted(benches, key=lambda b: (rank.get(b, len(rank)), b))
    mean, partial = {}, []
    for label in sorted({label for rows in benches.values() for label in rows}):
        ran = [b for b in order if label in benches[b]]
        rows = [benches[b][label] for b in ran]
        mean[label] = {k: sum(r[k] for r in rows) / len(rows)
                       for k in ("tokens_per_s", "tau", "tau_official", "speedup")
                       if all(k in r for r in rows)}
        mean[label]["acceptance"] = [sum(v) / len(rows) for v in
                                     zip(*(r["acceptance"] for r in rows), strict=True)]
        for key in ("identical", "wins_vs"):
            if all(key in r for r in rows):
                mean[label][key] = [sum(r[key][i] for r in rows) for i in (0, 1)]
        mean[label]["questions"] = sum(r["questions"] for r in rows)
        mean[label]["benchmarks"] = ran
        if len(ran) < len(order):
            partial.append(f"{label}: {', '.join(LABELS.get(b, b) for b in ran)}")
    if partial:
        notes.append(f"mean rows at T={temp} over fewer benchmarks than the report's "
                     f"{len(order)} ({', '.join(LABELS.get(b, b) for b in order)}): "
                     f"{'; '.join(partial)} (each mean averages only what its method ran)")
    return mean


REPORT_SUFFIXES = (".md", ".json", ".png")


def report_files(out: Path) -> dict[str, Path]:
    """{".md": R.md, ".json": R.json, ".png": R.png} for --out R. R's name is kept whole (a
    dot in it, as in report_T0.7, is no extension: Path.with_suffix would write
    report_T0.md, which report_T0.5 would then replace), less one of the report's own
    extensions if given (--out r.md writes r.md, r.json, r.png)."""
    base = out.with_suffix("") if out.suffix in REPORT_SUFFIXES else out
    return {suffix: base.with_name(base.name + suffix) for suffix in REPORT_SUFFIXES}


def check_outputs(out: Path) -> None:
    """R.md / R.json / R.png may replace an earlier report, never another file."""
    from gumiho.paths import check_writable_dir

    if not out.name or out.name in (".", ".."):
        raise GumihoError(f"--out {str(out)!r}: give a path without extension, e.g. "
                          "runs/x/report")
    check_writable_dir(out.parent, "--out folder")
    files = report_files(out)
    json_file = files[".json"]
    ours = False
    if json_file.exists():
        try:
            ours = json_file.is_file() and set(json.loads(
                json_file.read_text(encoding="utf-8"))) == {"env", "results"}
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, TypeError):
            ours = False
        if not ours:
            raise GumihoError(f"{json_file} exists and is not a speed report: choose another "
                              "--out (nothing was written)")
    for suffix, looks_ours in ((".md", lambda b: b.startswith(b"Device: ")),
                               (".png", lambda b: ours and b.startswith(b"\x89PNG"))):
        file = files[suffix]
        if file.exists() and not (file.is_file() and looks_ours(file.read_bytes()[:16])):
            raise GumihoError(f"{file} exists and is not a speed report: choose another "
                              "--out (nothing was written)")


@cli_errors
def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="python -m gumiho.evaluation.speed",
                       description=__doc__.split("\n")[0])
    p.add_argument("--answers", nargs="+", required=True, help="answer JSONL files")
    p.add_argument("--out", required=True, help="output path R without extension: writes "
                   "R.md, R.json and R.png")
    p.add_argument("--baseline", default="ar", help="the method (or --label) every speedup "
                   "is against (default: ar, plain decoding)")
    p.add_argument("--versus", default=None, help="count per question where each method "
                   "beats this one (default: lookup, prompt lookup alone, the drafter-free "
                   "peer)")
    p.add_argument("--question-begin", type=nonnegative_int, default=0,
                   help="report only questions from this one of each benchmark on (as "
                   "gen_answers': files may hold more, from an earlier run)")
    p.add_argument("--question-end", type=nonnegative_int, default=None,
                   help="report only questions before this one of each benchmark")
    args = p.parse_args(argv)
    named, args.versus = args.versus is not None, args.versus or "lookup"
    out = Path(args.out)
    check_outputs(out)
    notes: list[str] = []
    groups = read_answers(args.answers, notes)
    if args.question_begin or args.question_end is not None:
        groups = asked_questions(groups, args.question_begin, args.question_end, notes)
    if not any(label == args.baseline for label, _, _ in groups):
        notes.append(f"no {args.baseline!r} answers among the files: no speedups")
    if named and not any(label == args.versus for label, _, _ in groups):
        notes.append(f"no {args.versus!r} answers among the files: no per-question wins")
    rep = report(groups, args.baseline, notes, args.versus)
    notes += commits(groups) + slow_answers(groups)
    first = next(iter(next(iter(groups.values())).values()))
    out.parent.mkdir(parents=True, exist_ok=True)
    text = markdown(rep, first.get("env", {}), first["settings"].get("engine", "eager"),
                    args.versus, args.baseline)
    files = report_files(out)
    files[".md"].write_text(text + "".join(f"\nNote: {note}" for note in notes),
                            encoding="utf-8")
    files[".json"].write_text(json.dumps({"env": first.get("env", {}), "results": rep},
                                         indent=2), encoding="utf-8")
    drew = plot(rep, files[".png"])
    print(text)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    if not drew:
        print("(matplotlib not installed: no plot)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
