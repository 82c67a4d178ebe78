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
(`--versus`). Notes (on stderr and under the table) name answers far slower than their
run's median on the benchmark: a busy machine. Writes R.md, R.json and R.png.
"""

from __future__ import annotations

import json
import random
import sys
from collections import defaultdict
from pathlib import Path

from gumiho.attention import SDPA_GQA
from gumiho.config import TreeConfig
from gumiho.errors import ArgumentParser, GumihoError, cli_errors
from gumiho.evaluation.answers import read_answer_file, settings_mismatch
from gumiho.evaluation.benchmarks import LABELS
from gumiho.methods import BY_NAME

MAX_POSITIONS = 8
# An answer slower than this fraction of its run's median tokens/s on the benchmark is
# flagged: a busy machine, not the method (speculative answers of one run spread within
# about 2x; a burst of other work on a 2-core CPU slows one answer 3-4x).
SLOW_ANSWER = 0.5
RESAMPLES = 2000  # bootstrap draws for a speedup's interval (seeded: reports reproduce)
# Answers pooled into one row must come from one kind of run.
GROUP_KEYS = ("target", "draft", "max_new_tokens", "seed", "tree", "engine")


def method_label(settings: dict) -> str:
    """The method, plus what sets this run apart: a random drafter, a non-default FTA, a
    tree size other than the reference's (auto's or the user's), a prompt-lookup chain
    other than the method's own (beside a drafter's tree); or the run's own --label."""
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
    elif spec is not None and spec.drafter and tree:  # a size of the user's own
        reference = TreeConfig.for_method(settings["method"])
        size = (tree.get("total_tokens", reference.total_tokens),
                tree.get("depth", reference.depth))
        if size != (reference.total_tokens, reference.depth):
            notes.append(f"tree {size[0]}, depth {size[1]}")
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


def read_answers(paths: list[str]) -> dict[tuple, dict]:
    """{(label, bench, temperature): {question_id: record}}."""
    groups: dict[tuple, dict] = defaultdict(dict)
    first: dict[tuple, tuple[str, dict]] = {}  # group -> (file, record) it started with
    source: dict[tuple, str] = {}  # (group, question) -> the file that answered it
    for path in paths:
        if not Path(path).is_file():
            raise GumihoError(f"answer file {path} not found (give the .jsonl files that "
                              "gen_answers wrote)")
        for rec in read_answer_file(Path(path), writing=False).records:
            s = rec["settings"]
            key = (method_label(s), s["bench"], s["temperature"])
            where, ref = first.setdefault(key, (path, rec))
            diff = run_mismatch(ref, rec, GROUP_KEYS, (f"in {where}", f"in {path}"))
            if diff:
                raise GumihoError(f"{where} and {path} both hold {key[0]} {key[1]} answers at "
                                  f"T={key[2]}, but made differently ({diff}): report them "
                                  "separately")
            other = source.setdefault((key, rec["question_id"]), path)
            if other != path:  # which of two answers would count depended on file order
                raise GumihoError(f"{other} and {path} both answer {key[0]} {key[1]} question "
                                  f"{rec['question_id']} at T={key[2]}: give one of them")
            groups[key][rec["question_id"]] = rec
    if not groups:
        raise GumihoError(f"no answers in {', '.join(paths)}: run gen_answers first")
    return groups


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
    reach = [sum(d >= i for d in drafts_per_cycle) / verify for i in range(1, MAX_POSITIONS)]
    conditional = [r / prev if prev else 0.0 for prev, r in zip([1.0] + reach, reach,
                                                                strict=False)]
    return {"questions": len(records), "new_tokens": tokens, "cycles": cycles, "wall_s": wall,
            "tokens_per_s": tokens / wall if wall else 0.0, "tau": tokens / max(cycles, 1),
            "tau_official": tokens / max(cycles - sum(len(r["turns"]) for r in records), 1),
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
    for (label, bench, temp), answers in groups.items():
        base = groups.get((baseline, bench, temp), {})
        shared = sorted(set(answers) & set(base), key=str)
        if base and not shared:
            notes.append(f"{label} and {baseline} share no {bench} question at T={temp}: "
                         "no speedup for it (answer the same questions to compare)")
        row = stats([answers[q] for q in shared or answers])
        unfair = shared and run_mismatch(answers[shared[0]], base[shared[0]],
                                         ("target", "engine", "max_new_tokens"),
                                         (f"for {label}", f"for {baseline}"))
        if unfair:
            notes.append(f"{label} and {baseline} on {bench} ran differently ({unfair}): no "
                         "speedup for it")
        if shared and not unfair:
            base_row = stats([base[q] for q in shared])
            if base_row["tokens_per_s"] > 0:
                row["speedup"] = row["tokens_per_s"] / base_row["tokens_per_s"]
                if label != baseline:
                    row["speedup_interval"] = speedup_interval(answers, base, shared)
            # Greedy output must equal plain decoding's (SPEC: lossless); sampled need not.
            if float(temp) == 0.0 and label != baseline:
                same = identical_count(answers, base, shared)
                if same is not None:
                    row["identical"] = same
        other = groups.get((versus, bench, temp))
        if other and label not in (baseline, versus) and set(answers) & set(other):
            row["wins_vs"] = wins(answers, other)
        out[temp][bench][label] = row
    for benches in out.values():
        labels = {label for rows in benches.values() for label in rows}
        mean = {}
        for label in labels:
            rows = [rows[label] for rows in benches.values() if label in rows]
            mean[label] = {k: sum(r[k] for r in rows) / len(rows)
                           for k in ("tokens_per_s", "tau", "tau_official", "speedup")
                           if all(k in r for r in rows)}
            mean[label]["acceptance"] = [sum(v) / len(rows) for v in
                                         zip(*(r["acceptance"] for r in rows), strict=True)]
            for key in ("identical", "wins_vs"):
                if all(key in r for r in rows):
                    mean[label][key] = [sum(r[key][i] for r in rows) for i in (0, 1)]
        benches["mean"] = mean
    return json.loads(json.dumps(out))


def shown_attention(recorded: str) -> str:
    """The --attention a user gave for what the answers record (the model's own name:
    sdpa runs as our grouped form, attention.py)."""
    return "sdpa" if recorded == SDPA_GQA else recorded


def markdown(rep: dict, env: dict, engine: str = "eager", versus: str = "lookup") -> str:
    lines = [f"Device: {env.get('device_name', '?')} ({env.get('device', '?')}), dtype "
             f"{env.get('dtype', '?')}"
             + (f", attention {shown_attention(env['attention'])}" if env.get("attention")
                else "")
             + f", engine {engine}, torch {env.get('torch', '?')}, "
             f"transformers {env.get('transformers', '?')}, commit "
             f"{env.get('git_commit', '?')[:10]}.", ""]
    for temp, benches in rep.items():
        lines += [f"### T = {temp}", "",
                  "| benchmark | method | tokens/s | speedup | 90% interval | tau | "
                  "tau (official formula) | same text as plain | faster than "
                  f"{versus} (questions) | acceptance a1..a7 (unconditional) |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        order = [b for b in LABELS if b in benches] + ["mean"]
        for bench in order:
            for label, row in sorted(benches[bench].items()):
                acc = " ".join(f"{a:.2f}" for a in row.get("acceptance", []))
                speedup = f"{row['speedup']:.2f}x" if "speedup" in row else "-"
                same = "{}/{}".format(*row["identical"]) if "identical" in row else "-"
                won = "{}/{}".format(*row["wins_vs"]) if "wins_vs" in row else "-"
                span = "{:.2f}-{:.2f}".format(*row["speedup_interval"]) \
                    if "speedup_interval" in row else "-"
                name = LABELS.get(bench, "**mean**")
                lines.append(f"| {name} | {label} | {row['tokens_per_s']:.1f} | {speedup} | "
                             f"{span} | {row['tau']:.2f} | {row['tau_official']:.2f} | "
                             f"{same} | {won} | {acc} |")
        lines.append("")
    return "\n".join(lines)


def plot(rep: dict, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    temps = list(rep)
    fig, axes = plt.subplots(len(temps), 2, figsize=(11, 4 * len(temps)), squeeze=False)
    for ax_row, temp in zip(axes, temps, strict=True):
        mean = rep[temp]["mean"]
        labels = sorted(mean)
        ax_row[0].bar(labels, [mean[k]["tau"] for k in labels], color="tab:blue")
        ax_row[0].set_title(f"mean tau over benchmarks (T = {temp})")
        ax_row[0].tick_params(axis="x", rotation=20)
        for label in labels:
            acc = mean[label]["acceptance"]
            ax_row[1].plot(range(1, len(acc) + 1), acc, marker="o", label=label)
        ax_row[1].set_title("per-position acceptance (unconditional)")
        ax_row[1].set_xlabel("draft position")
        ax_row[1].set_ylim(0, 1)
        ax_row[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return True


def check_outputs(out: Path) -> None:
    """R.md / R.json / R.png may replace an earlier report, never another file."""
    from gumiho.paths import check_writable_dir

    if not out.name or out.name in (".", ".."):
        raise GumihoError(f"--out {str(out)!r}: give a path without extension, e.g. "
                          "runs/x/report")
    check_writable_dir(out.parent, "--out folder")
    json_file = out.with_suffix(".json")
    ours = False
    if json_file.exists():
        try:
            ours = json_file.is_file() and set(json.loads(json_file.read_text())) == {
                "env", "results"}
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, TypeError):
            ours = False
        if not ours:
            raise GumihoError(f"{json_file} exists and is not a speed report: choose another "
                              "--out (nothing was written)")
    for suffix, looks_ours in ((".md", lambda b: b.startswith(b"Device: ")),
                               (".png", lambda b: ours and b.startswith(b"\x89PNG"))):
        file = out.with_suffix(suffix)
        if file.exists() and not (file.is_file() and looks_ours(file.read_bytes()[:16])):
            raise GumihoError(f"{file} exists and is not a speed report: choose another "
                              "--out (nothing was written)")


@cli_errors
def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="python -m gumiho.evaluation.speed",
                       description=__doc__.split("\n")[0])
    p.add_argument("--answers", nargs="+", required=True, help="answer JSONL files")
    p.add_argument("--out", required=True, help="output path without extension")
    p.add_argument("--baseline", default="ar", help="the method (or --label) every speedup "
                   "is against (default: ar, plain decoding)")
    p.add_argument("--versus", default=None, help="count per question where each method "
                   "beats this one (default: lookup, prompt lookup alone, the drafter-free "
                   "peer)")
    args = p.parse_args(argv)
    named, args.versus = args.versus is not None, args.versus or "lookup"
    out = Path(args.out)
    check_outputs(out)
    groups = read_answers(args.answers)
    notes: list[str] = []
    if not any(label == args.baseline for label, _, _ in groups):
        notes.append(f"no {args.baseline!r} answers among the files: no speedups")
    if named and not any(label == args.versus for label, _, _ in groups):
        notes.append(f"no {args.versus!r} answers among the files: no per-question wins")
    rep = report(groups, args.baseline, notes, args.versus)
    notes += commits(groups) + slow_answers(groups)
    first = next(iter(next(iter(groups.values())).values()))
    out.parent.mkdir(parents=True, exist_ok=True)
    text = markdown(rep, first.get("env", {}), first["settings"].get("engine", "eager"),
                    args.versus)
    out.with_suffix(".md").write_text(text + "".join(f"\nNote: {note}" for note in notes))
    out.with_suffix(".json").write_text(json.dumps({"env": first.get("env", {}),
                                                    "results": rep}, indent=2))
    drew = plot(rep, out.with_suffix(".png"))
    print(text)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    if not drew:
        print("(matplotlib not installed: no plot)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
