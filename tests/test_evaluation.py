"""Benchmarks are well-formed; the report's arithmetic is right on hand-made answers; a
small end-to-end evaluation on SmolLM2 produces a complete report."""

import json

import pytest

from gumiho.errors import GumihoError
from gumiho.evaluation import gen_answers, speed
from gumiho.evaluation.answers import read_answer_file
from gumiho.evaluation.benchmarks import BENCHMARKS, load_questions


@pytest.mark.parametrize("bench", BENCHMARKS)
def test_each_benchmark_has_80_well_formed_questions(bench):
    questions = load_questions(bench)
    assert len(questions) == 80
    assert len({q["question_id"] for q in questions}) == 80
    for q in questions:
        assert q["turns"] and all(isinstance(t, str) and t.strip() for t in q["turns"])
    assert all(len(q["turns"]) == (2 if bench == "mt_bench" else 1) for q in questions)


def record(qid, method, tokens, cycles, wall, accept, bench="mt_bench", text=None,
           temperature=0.0):
    turn = {"new_tokens": tokens, "cycles": cycles, "wall_s": wall, "accept_lengths": accept}
    if text is not None:
        turn["text"] = text
    return {"question_id": qid, "settings": {"method": method, "bench": bench,
                                             "temperature": temperature, "tree": None},
            "turns": [turn], "env": {"device": "cpu"}}


def write_files(tmp_path, runs):
    files = []
    for name, recs in runs.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in recs))
        files.append(str(path))
    return files


def test_report_arithmetic(tmp_path):
    ar = [record(1, "ar", 10, 10, 2.0, [1] * 10), record(2, "ar", 6, 6, 1.0, [1] * 6)]
    # gumiho: q1 = prefill + cycles accepting 4, 2, 3 tokens (3, 1, 2 drafts)
    gm = [record(1, "gumiho", 10, 4, 1.0, [1, 4, 2, 3]),
          record(2, "gumiho", 6, 3, 0.5, [1, 1, 4])]
    files = write_files(tmp_path, {"ar": ar, "gm": gm})
    rep = speed.report(speed.read_answers(files))
    row = rep["0.0"]["mt_bench"]["gumiho"]
    assert row["tau"] == pytest.approx(16 / 7)
    assert row["tau_official"] == pytest.approx(16 / 5)
    assert row["tokens_per_s"] == pytest.approx(16 / 1.5)
    assert row["speedup"] == pytest.approx((16 / 1.5) / (16 / 3.0))
    # verify cycles accept 3, 1, 2, 0, 3 drafts
    assert row["acceptance"][:4] == pytest.approx([4 / 5, 3 / 5, 2 / 5, 0])
    assert row["acceptance_conditional"][:3] == pytest.approx([4 / 5, 3 / 4, 2 / 3])
    assert rep["0.0"]["mt_bench"]["ar"]["tau"] == 1.0
    assert rep["0.0"]["mean"]["gumiho"]["speedup"] == pytest.approx(2.0)
    assert speed.main(["--answers", *files, "--out", str(tmp_path / "r")]) == 0
    assert "| MT-Bench | gumiho |" in (tmp_path / "r.md").read_text()
    assert (tmp_path / "r.png").stat().st_size > 1000


def test_report_pairs_questions_with_prompt_lookup_and_bounds_the_speedup(tmp_path):
    """Per question: wins over prompt lookup (a tie is no win), summed in the mean row; the
    speedup's bootstrap interval holds the speedup, and is one point when every question
    has the same ratio."""
    ar = [record(q, "ar", 10, 10, 1.0, [1] * 10) for q in range(4)]
    lk = [record(q, "lookup", 10, 5, w, [1, 2]) for q, w in enumerate([0.5, 0.5, 0.5, 0.5])]
    gm = [record(q, "gumiho", 10, 4, w, [1, 3]) for q, w in enumerate([0.4, 0.6, 0.25, 0.5])]
    even = [record(q, "medusa", 10, 5, 0.8, [1, 2]) for q in range(4)]
    extra = [record(9, "gumiho", 10, 4, 0.1, [1, 3], bench="humaneval"),
             record(9, "lookup", 10, 4, 0.2, [1, 3], bench="humaneval"),
             record(9, "ar", 10, 10, 1.0, [1] * 10, bench="humaneval")]
    files = write_files(tmp_path, {"ar": ar, "lk": lk, "gm": gm, "md": even, "x": extra})
    rep = speed.report(speed.read_answers(files))["0.0"]
    gumiho = rep["mt_bench"]["gumiho"]
    assert gumiho["wins_vs"] == [2, 4]  # 0.4 and 0.25 s beat 0.5; 0.5 ties, 0.6 loses
    low, high = gumiho["speedup_interval"]
    assert low < gumiho["speedup"] < high
    assert low >= 10 / 0.6 / 10 and high <= 10 / 0.25 / 10
    assert rep["mt_bench"]["medusa"]["speedup_interval"] == pytest.approx([1.25, 1.25])
    assert "wins_vs" not in rep["mt_bench"]["lookup"] and "wins_vs" not in rep["mt_bench"]["ar"]
    assert "speedup_interval" not in rep["mt_bench"]["ar"]
    assert rep["mean"]["gumiho"]["wins_vs"] == [3, 5]
    assert rep["mean"]["medusa"]["wins_vs"] == [0, 4]  # over what it answered
    assert speed.main(["--answers", *files, "--out", str(tmp_path / "r")]) == 0
    assert "| 2/4 |" in (tmp_path / "r.md").read_text()
    assert speed.main(["--answers", *files, "--out", str(tmp_path / "r2"),
                       "--versus", "medusa"]) == 0
    assert "faster than medusa" in (tmp_path / "r2.md").read_text()


def test_two_files_answering_one_question_are_refused(tmp_path, capsys):
    """Two files with the same method's answer to one question: which counted depended on
    the files' order, so neither does; questions split across files are fine. A --versus
    that no file holds is a note, not silence."""
    ar = [record(q, "ar", 10, 10, 1.0, [1] * 10) for q in range(3)]
    files = write_files(tmp_path, {"ar_a": ar[:2], "ar_b": ar[1:]})
    with pytest.raises(GumihoError, match="both answer ar mt_bench question 1 at T=0.0"):
        speed.read_answers(files)
    split = write_files(tmp_path, {"ar_a": ar[:2], "ar_b": ar[2:],
                                   "gm": [record(q, "gumiho", 10, 5, 0.5, [1, 2])
                                          for q in range(3)]})
    assert sorted(speed.read_answers(split)[("ar", "mt_bench", 0.0)]) == [0, 1, 2]
    assert speed.main(["--answers", *split, "--out", str(tmp_path / "r"), "--versus",
                       "nope"]) == 0
    assert "no 'nope' answers among the files" in capsys.readouterr().err


def test_a_label_keeps_two_drafters_of_one_method_apart(tmp_path):
    """--label names a run in the report: without it, two Gumiho drafters with the same
    tree settings would share one row."""
    ar = [record(q, "ar", 10, 10, 1.0, [1] * 10) for q in range(2)]
    old = [record(q, "gumiho", 10, 5, 0.5, [1, 2]) for q in range(2)]
    new = [record(q, "gumiho", 10, 4, 0.4, [1, 3]) for q in range(2)]
    for rec in new:
        rec["settings"]["label"] = "gumiho (stage 5)"
    files = write_files(tmp_path, {"ar": ar, "old": old, "new": new})
    rows = speed.report(speed.read_answers(files))["0.0"]["mt_bench"]
    assert set(rows) == {"ar", "gumiho", "gumiho (stage 5)"}
    assert rows["gumiho (stage 5)"]["speedup"] == pytest.approx(2.5)


def test_tree_sizes_of_ones_own_get_rows_of_their_own(tmp_path):
    """Two fixed tree sizes beside each other (GUMIHO_VARIANTS) are two rows named by their
    size; the reference size and old records without a tree keep the plain name, and
    auto's row names the shape it chose."""
    ar = [record(q, "ar", 10, 10, 1.0, [1] * 10) for q in range(2)]
    runs = {"ar": ar}
    for name, tree, wall in (("small", {"total_tokens": 4, "depth": 1}, 0.4),
                             ("large", {"total_tokens": 8, "depth": 2}, 0.5),
                             ("reference", {"total_tokens": 64, "depth": 7}, 0.6)):
        runs[name] = [record(q, "gumiho", 10, 4, wall, [1, 3]) for q in range(2)]
        for rec in runs[name]:
            rec["settings"]["tree"] = tree
    rows = speed.report(speed.read_answers(write_files(tmp_path, runs)))["0.0"]["mt_bench"]
    assert set(rows) == {"ar", "gumiho", "gumiho (tree 4, depth 1)", "gumiho (tree 8, depth 2)"}
    assert rows["gumiho (tree 4, depth 1)"]["speedup"] == pytest.approx(2.5)
    auto = {"method": "gumiho", "tree": {"total_tokens": 6, "depth": 2},
            "auto_tree": {"tree": {"total_tokens": 6, "depth": 2}}}
    assert speed.method_label(auto) == "gumiho (auto tree 6, depth 2)"
    wide = {"total_tokens": 256, "depth": 7, "top_k": 32, "mlp_topk": 35, "pruning": 64}
    assert speed.method_label({"method": "gumiho", "tree": wide}) == \
        "gumiho (tree 256, depth 7, beam 32, 64 a level)"
    assert speed.method_label({"method": "gumiho", "tree": wide, "auto_tree": {"tree": wide}}) \
        == "gumiho (auto tree 256, depth 7, beam 32, 64 a level)"
    assert speed.method_label({"method": "gumiho", "tree": {**wide, "top_k": 3, "pruning": 3}}
                              ) == "gumiho (tree 256, depth 7)"  # narrower: its size says it
    assert speed.method_label({"method": "lookup", "tree": {"total_tokens": 2}}) == "lookup"


def test_gen_answers_writes_the_label_and_resumes_without_comparing_it(tiny_target_dir,
                                                                       tmp_path):
    from gumiho.evaluation import gen_answers

    path = tmp_path / "a.jsonl"
    args = ["--target", tiny_target_dir, "--method", "ar", "--bench", "mt_bench",
            "--max-new-tokens", "4", "--answer-file", str(path), "--warmup", "0"]
    assert gen_answers.main([*args, "--question-end", "1", "--label", "first"]) == 0
    assert gen_answers.main([*args, "--question-end", "2", "--label", "second"]) == 0
    labels = [json.loads(line)["settings"]["label"] for line in path.read_text().splitlines()]
    assert labels == ["first", "second"]


def test_gen_answers_records_the_sampling_cut_and_resumes_only_with_it(tiny_target_dir,
                                                                      tmp_path, capsys):
    """--sample-top-k and --top-p reach every answer's settings; a file resumes with the
    same cut only, and a file from before the cut existed counts as made without one."""
    path = tmp_path / "a.jsonl"
    args = ["--target", tiny_target_dir, "--method", "ar", "--bench", "mt_bench",
            "--max-new-tokens", "4", "--answer-file", str(path), "--warmup", "0",
            "--temperature", "1"]
    cut = ["--sample-top-k", "20", "--top-p", "0.9"]
    assert gen_answers.main([*args, *cut, "--question-end", "1"]) == 0
    settings = json.loads(path.read_text())["settings"]
    assert (settings["sample_top_k"], settings["top_p"]) == (20, 0.9)
    assert gen_answers.main([*args, "--top-p", "0.9", "--question-end", "2"]) == 2
    assert "sample_top_k=20 in the file, 0 now" in capsys.readouterr().err
    assert gen_answers.main([*args, *cut, "--question-end", "2"]) == 0
    old = [json.loads(line) for line in path.read_text().splitlines()]
    for rec in old:  # as the code before the cut wrote them
        del rec["settings"]["sample_top_k"], rec["settings"]["top_p"]
    path.write_text("".join(json.dumps(rec) + "\n" for rec in old))
    assert gen_answers.main([*args, *cut, "--question-end", "3"]) == 2
    assert "sample_top_k=0 in the file, 20 now" in capsys.readouterr().err
    assert gen_answers.main([*args, "--question-end", "3"]) == 0
    assert len(path.read_text().splitlines()) == 3


def test_gen_answers_with_ignore_eos_answers_at_a_fixed_length(tiny_target_dir, tmp_path,
                                                               capsys, monkeypatch):
    """--ignore-eos reaches every turn's generate; the setting is recorded, a file resumes
    only with it, and the report gives such answers a table of their own."""
    from gumiho.generate import SpeculativeGenerator

    seen, generate = [], SpeculativeGenerator.generate

    def spy(self, prompt, max_new_tokens=256, **settings):
        seen.append(settings.get("ignore_eos"))
        return generate(self, prompt, max_new_tokens, **settings)

    monkeypatch.setattr(SpeculativeGenerator, "generate", spy)
    path = tmp_path / "a.jsonl"
    args = ["--target", tiny_target_dir, "--method", "ar", "--bench", "mt_bench",
            "--max-new-tokens", "5", "--answer-file", str(path), "--warmup", "0"]
    assert gen_answers.main([*args, "--ignore-eos", "--question-end", "2"]) == 0
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    assert seen == [True] * 4  # two questions of two turns
    assert [t["new_tokens"] for r in recs for t in r["turns"]] == [5] * 4
    assert all(r["settings"]["ignore_eos"] for r in recs)
    assert gen_answers.main([*args, "--question-end", "3"]) == 2
    assert "ignore_eos=True in the file, False now" in capsys.readouterr().err
    assert speed.sampling_key(recs[0]["settings"]) == "0.0, ignore eos"
    assert speed.sampling_key({"temperature": 0.0}) == 0.0  # older records: without it


def test_report_splits_answers_by_their_sampling_cut(tmp_path):
    """Answers sampled with a cut get a table of their own ("1.0, top-p 0.9"), with their
    own plain baseline; at T = 0 a cut is moot and answers pool as greedy ones."""
    def run(method, wall, temperature=1.0, **cut):
        recs = [record(q, method, 4, 2 if method != "ar" else 4, wall, [1, 3], "mt_bench",
                       None, temperature) for q in range(2)]
        for rec in recs:
            rec["settings"].update(cut)
        return recs
    files = write_files(tmp_path, {
        "ar": run("ar", 1.0), "gm": run("gumiho", 0.8),
        "ar_p": run("ar", 1.0, top_p=0.9), "gm_p": run("gumiho", 0.5, top_p=0.9),
        "ar_k": run("ar", 2.0, sample_top_k=5, top_p=0.5),
        "gm_k": run("gumiho", 1.0, sample_top_k=5, top_p=0.5),
        "ar0": run("ar", 1.0, 0.0, top_p=0.9), "gm0": run("gumiho", 0.5, 0.0)})
    rep = speed.report(speed.read_answers(files))
    assert set(rep) == {"0.0", "1.0", "1.0, top-p 0.9", "1.0, top-k 5, top-p 0.5"}
    assert rep["1.0"]["mt_bench"]["gumiho"]["speedup"] == pytest.approx(1.25)
    assert rep["1.0, top-p 0.9"]["mt_bench"]["gumiho"]["speedup"] == pytest.approx(2.0)
    assert rep["1.0, top-k 5, top-p 0.5"]["mt_bench"]["gumiho"]["speedup"] == \
        pytest.approx(2.0)
    assert rep["0.0"]["mt_bench"]["gumiho"]["speedup"] == pytest.approx(2.0)
    assert speed.main(["--answers", *files, "--out", str(tmp_path / "r")]) == 0
    assert "### T = 1.0, top-p 0.9" in (tmp_path / "r.md").read_text()


def test_report_names_an_answer_slowed_by_a_busy_machine(tmp_path, capsys):
    """One answer at a third of its run's median rate is named (stderr and report.md);
    the ordinary 2x spread of speculative answers is not."""
    ar = [record(q, "ar", 24, 24, 1.0, [1] * 24) for q in range(5)]
    ar[3] = record(3, "ar", 24, 24, 3.0, [1] * 24)  # 8 tokens/s against 24
    gm = [record(q, "gumiho", 24, 12, w, [1, 2]) for q, w in enumerate([0.5, 1.0, 0.6, 0.7, 0.9])]
    files = write_files(tmp_path, {"ar": ar, "gm": gm})
    assert [n.split(":")[0] for n in speed.slow_answers(speed.read_answers(files))] == [
        "mt_bench question 3 at T=0.0"]
    assert speed.main(["--answers", *files, "--out", str(tmp_path / "r")]) == 0
    assert "was the machine busy" in capsys.readouterr().err
    assert "Note: mt_bench question 3 at T=0.0: ar ran at 8.0 tokens/s against its median " \
        "24.0" in (tmp_path / "r.md").read_text()


def test_report_counts_greedy_answers_equal_to_plain(tmp_path):
    """At T=0 each method's row says how many answers are plain decoding's text; the mean
    row sums them; sampled rows and answers without text say nothing."""
    def run(method, texts, bench="mt_bench", temperature=0.0):
        return [record(q, method, 4, 2, 1.0, [1, 3], bench, text, temperature)
                for q, text in enumerate(texts)]
    files = write_files(tmp_path, {
        "ar": run("ar", ["a", "b", "c"]) + run("ar", ["x"], "humaneval"),
        "gm": run("gumiho", ["a", "B", "c"]) + run("gumiho", ["x"], "humaneval"),
        "md": run("medusa", ["a", "b", "c"]),
        "ar1": run("ar", ["a"], temperature=1.0), "gm1": run("gumiho", ["z"], temperature=1.0),
        "ea": [record(0, "eagle2", 4, 2, 1.0, [1, 3])]})
    rep = speed.report(speed.read_answers(files))
    t0 = rep["0.0"]
    assert t0["mt_bench"]["gumiho"]["identical"] == [2, 3]
    assert t0["humaneval"]["gumiho"]["identical"] == [1, 1]
    assert t0["mean"]["gumiho"]["identical"] == [3, 4]
    assert t0["mt_bench"]["medusa"]["identical"] == [3, 3]
    assert t0["mean"]["medusa"]["identical"] == [3, 3]  # over what it answered
    assert "identical" not in t0["mt_bench"]["ar"]
    assert "identical" not in t0["mt_bench"]["eagle2"]  # no text recorded
    assert "identical" not in rep["1.0"]["mt_bench"]["gumiho"]
    assert speed.main(["--answers", *files, "--out", str(tmp_path / "r")]) == 0
    text = (tmp_path / "r.md").read_text()
    assert "| MT-Bench | gumiho | 4.0 | 1.00x | 1.00-1.00 | 2.00 | 4.00 | 2/3 |" in text
    assert "| **mean** | gumiho | 4.0 | 1.00x | - | 2.00 | 4.00 | 3/4 |" in text


def test_a_lookup_chain_beside_a_drafter_gets_its_own_row(tmp_path):
    """`--lookup N` beside a drafter's tree is another run: its own row, not a clash with
    the same drafter without it (the lookup method's own 10-token chain is not a note;
    another length is)."""
    def run(method, lookup, first=False, gate=0.0):
        rec = record(1, method, 4, 2, 1.0, [1, 3])
        rec["settings"]["tree"] = {"fta": "off", "lookup": lookup,
                                   "lookup_first": first, "draft_gate": gate}
        return [rec]
    files = write_files(tmp_path, {"ar": [record(1, "ar", 4, 4, 2.0, [1] * 4)],
                                   "gm": run("gumiho", 0), "gml": run("gumiho", 10),
                                   "gmf": run("gumiho", 10, True),
                                   "gmg": run("gumiho", 10, True, 1.3),
                                   "lk": run("lookup", 10), "lk5": run("lookup", 5)})
    rows = speed.report(speed.read_answers(files))["0.0"]["mt_bench"]
    assert set(rows) == {"ar", "gumiho", "gumiho (lookup 10)", "gumiho (lookup 10, lookup first)",
                         "gumiho (lookup 10, lookup first, gated)", "lookup",
                         "lookup (lookup 5)"}


def test_answer_file_resume_drops_half_line(tmp_path):
    path = tmp_path / "a.jsonl"
    first = json.dumps(record(81, "ar", 1, 1, 0.1, [1])) + "\n"
    path.write_text(first + '{"question_id": 82, "tu')
    found = read_answer_file(path)
    assert [r["question_id"] for r in found.records] == [81]
    assert found.keep_bytes == len(first) and not found.needs_newline
    assert path.read_text().startswith(first)  # reading changes nothing


def test_the_report_reads_answers_without_torch():
    """`python -m gumiho.evaluation.speed` only reads answer files: importing torch and
    transformers for it cost ~11 s a report on a 2-core CPU (an evaluation writes one per
    run). Its modules import neither."""
    import subprocess
    import sys

    code = ("import sys, gumiho.evaluation.speed; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"


def test_small_end_to_end_evaluation(smollm2, tmp_path):
    files = []
    shipped = "gumiho/assets/smollm2/gumiho"
    both = ("mt_bench", "gsm8k_like")
    for method, extra, benches in (
            ("ar", [], both),
            ("gumiho", ["--draft", "random", "--total-tokens", "16"], ("gsm8k_like",)),
            ("gumiho", ["--draft", shipped, "--total-tokens", "16", "--fta", "exact"], both)):
        for bench in benches:  # (a random drafter's 49,152-token heads are slow on MT-Bench)
            out = tmp_path / f"{bench}_{method}_{len(files)}.jsonl"
            args = ["--method", method, "--bench", bench, "--question-end", "1",
                    "--max-new-tokens", "12", "--answer-file", str(out), *extra]
            assert gen_answers.main(args) == 0
            assert gen_answers.main(args) == 0  # resumes: nothing left to do
            lines = out.read_text().splitlines()
            assert len(lines) == 1
            rec = json.loads(lines[0])
            assert rec["env"]["git_commit"] and rec["settings"]["method"] == method
            files.append(str(out))
    assert speed.main(["--answers", *files, "--out", str(tmp_path / "report")]) == 0
    rep = json.loads((tmp_path / "report.json").read_text())["results"]["0.0"]
    assert set(rep) == {"mt_bench", "gsm8k_like", "mean"}
    assert rep["gsm8k_like"]["gumiho (random, tree 16, depth 7)"]["speedup"] > 0
    assert rep["mt_bench"]["gumiho (fta exact, tree 16, depth 7)"]["tau"] >= 1.0  # trained
    # MT-Bench: two turns, the second after the model's own first answer
    mt = json.loads((tmp_path / "mt_bench_ar_0.jsonl").read_text())
    assert len(mt["turns"]) == 2


@pytest.mark.parametrize("interleave", ["1", "0"])
def test_the_eval_script_runs_gumiho_variants_side_by_side(smollm2, tmp_path, interleave):
    """GUMIHO_VARIANTS: each flag set is its own row, run beside the plain Gumiho one, by
    one interleaved process (default) or one gen_answers each (INTERLEAVE=0); a space in
    the output path survives either."""
    import os
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "eval dir"
    # one variant where each run is a process of its own (~10 s each on 2 cores)
    variants = ["--min-confidence 0.1", "--min-confidence 0.3"][: 2 if interleave == "1" else 1]
    env = {**os.environ, "QUICK": "1", "OUT": str(out), "QEND": "1",
           "MAXNEW": "8", "BENCHES": "gsm8k_like", "LOOKUP": "0", "EAGLE_DRAFT": "",
           "MEDUSA_DRAFT": "", "GUMIHO_ARGS": "--total-tokens 8", "INTERLEAVE": interleave,
           "GUMIHO_VARIANTS": "|".join(variants),
           "COMMON_ARGS": "--engine eager"}  # floors act on eager steps (a GPU's default: graphs)
    proc = subprocess.run(["bash", "scripts/eval_smollm2.sh"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert ("gsm8k_like: 4 methods" in proc.stderr) == (interleave == "1")
    rep = json.loads((out / "report.json").read_text())["results"]["0.0"]
    rows = rep["gsm8k_like"]
    assert set(rows) == {"ar", "gumiho (tree 8, depth 7)",  # GUMIHO_ARGS's size, named
                         *(f"gumiho (tree 8, depth 7, confidence {v.split()[1]})"
                           for v in variants)}
    assert all(rows[label]["identical"] == [1, 1] for label in rows if label != "ar")


def test_report_gives_no_speedup_across_answer_lengths_and_names_each_commit(tmp_path,
                                                                            capsys):
    """Answers capped at another --max-new-tokens are another workload (and another text:
    "same text as plain 0/1" would read as a lossless failure): no speedup, one note. Runs
    from two commits are named, since the header shows the first file's alone."""
    ar = [record(1, "ar", 16, 16, 1.0, [1] * 16, text="a")]
    gm = [record(1, "gumiho", 8, 4, 0.2, [1, 2, 3, 2], text="b")]
    ar[0]["settings"]["max_new_tokens"], gm[0]["settings"]["max_new_tokens"] = 16, 8
    ar[0]["env"]["git_commit"], gm[0]["env"]["git_commit"] = "aaa", "bbb"
    files = write_files(tmp_path, {"ar": ar, "gm": gm})
    notes: list[str] = []
    row = speed.report(speed.read_answers(files), notes=notes)["0.0"]["mt_bench"]["gumiho"]
    assert "speedup" not in row and "identical" not in row
    assert notes == ["gumiho and ar on mt_bench ran differently (max_new_tokens=8 for "
                     "gumiho, 16 for ar): no speedup for it"]
    assert speed.commits(speed.read_answers(files)) == [
        "the answers come from 2 commits: aaa: ar mt_bench; bbb: gumiho mt_bench"]
    gm[0]["settings"]["max_new_tokens"], gm[0]["env"]["git_commit"] = 16, "aaa"
    files = write_files(tmp_path, {"ar": ar, "gm": gm})
    assert "speedup" in speed.report(speed.read_answers(files))["0.0"]["mt_bench"]["gumiho"]
    assert speed.commits(speed.read_answers(files)) == []


def test_a_question_end_past_the_benchmark_is_noted(capsys):
    from gumiho.evaluation.gen_answers import pick_questions

    assert len(pick_questions("mt_bench", 78, 1000)) == 2
    assert capsys.readouterr().err == ("note: --question-end 1000 is past mt_bench's 80 "
                                       "questions: answering 78..79\n")
    assert len(pick_questions("mt_bench", 0, 80)) == 80
    assert capsys.readouterr().err == ""
