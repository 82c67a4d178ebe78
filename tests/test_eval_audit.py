"""What an audit of the evaluation tools found: a resume checks the drafter's weights, not
only its path; the speed report says which questions, benchmarks and lines each of its
numbers covers; the eval scripts read paths from the caller's folder."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from gumiho.evaluation import gen_answers, speed

from conftest import child_env

ROOT = Path(__file__).resolve().parent.parent


def record(qid, method, wall=1.0, bench="mt_bench", tokens=10, **settings):
    turn = {"new_tokens": tokens, "cycles": 5, "wall_s": wall, "accept_lengths": [1, 2],
            "text": "same"}
    return {"question_id": qid, "settings": {"method": method, "bench": bench,
                                             "temperature": 0.0, **settings},
            "turns": [turn], "env": {"device": "cpu"}}


def write(path: Path, recs: list[dict], tail: str = "") -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs) + tail)
    return str(path)


def speed_report(tmp_path, files, *flags) -> tuple[dict, str, str]:
    """(results at T=0, report.md, stderr) of one `speed` run."""
    out = tmp_path / "r"
    proc = subprocess.run(["python3", "-m", "gumiho.evaluation.speed", "--answers", *files,
                           "--out", str(out), *flags], capture_output=True, text=True,
                          env=child_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(out.with_suffix(".json").read_text())["results"]["0.0"]
    return rep, out.with_suffix(".md").read_text(), proc.stderr


@pytest.fixture(scope="module")
def tiny_drafters(tmp_path_factory, tiny_target_dir):
    """Two EAGLE-2 drafters for the tiny target, of one shape, with other weights."""
    from gumiho.checkpoint import save_drafter
    from gumiho.drafters import random_drafter_model
    from gumiho.target import load_target

    target = load_target(tiny_target_dir, device="cpu")
    out = tmp_path_factory.mktemp("drafters")
    for seed in (0, 1):
        save_drafter(random_drafter_model("eagle2", target, seed=seed), out / f"seed{seed}")
    return out


def test_a_resume_with_other_weights_at_the_same_drafter_path_is_refused(
        tmp_path, tiny_target_dir, tiny_drafters, capsys):
    """The files of the drafter folder replaced by other weights: another drafter, refused
    naming it; an answer file written before the weights were recorded still resumes."""
    import shutil

    draft = tmp_path / "tr1"
    shutil.copytree(tiny_drafters / "seed0", draft)
    path = tmp_path / "a.jsonl"

    def args(end):
        return ["--target", tiny_target_dir, "--method", "eagle2", "--draft", str(draft),
                "--bench", "gsm8k_like", "--question-end", str(end), "--max-new-tokens", "2",
                "--warmup", "0", "--answer-file", str(path), "--total-tokens", "4"]

    assert gen_answers.main(args(1)) == 0
    shutil.copy(tiny_drafters / "seed1" / "model.safetensors", draft / "model.safetensors")
    before = path.read_bytes()
    capsys.readouterr()
    assert gen_answers.main(args(2)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert f"drafter {str(draft)!r}" in err and "weights" in err, err
    assert path.read_bytes() == before
    # a file from before the weights were recorded: resumes as it did
    old = json.loads(before)
    del old["settings"]["draft_sha256"]
    write(path, [old])
    assert gen_answers.main(args(2)) == 0
    assert len(path.read_text().splitlines()) == 2


def test_speed_refuses_to_pool_answers_of_other_weights_at_one_path(tmp_path, capsys):
    """Two files of one row whose drafter had other weights are refused; a file without
    the record (older code) is not compared."""
    a = [record(0, "gumiho", draft="tr1", draft_sha256="aa" * 32)]
    b = [record(1, "gumiho", draft="tr1", draft_sha256="bb" * 32)]
    old = [record(2, "gumiho", draft="tr1")]
    files = [write(tmp_path / "a.jsonl", a), write(tmp_path / "b.jsonl", b)]
    assert speed.main(["--answers", *files, "--out", str(tmp_path / "r")]) == 2
    assert "made differently (the weights of drafter 'tr1'" in capsys.readouterr().err
    files = [files[0], write(tmp_path / "old.jsonl", old)]
    assert sorted(speed.read_answers(files)[("gumiho", "mt_bench", 0.0)]) == [0, 2]


def test_mean_rows_over_fewer_benchmarks_are_named(tmp_path):
    """ar on MT-Bench and HumanEval, gumiho on MT-Bench alone, lookup on HumanEval alone:
    each mean row covers what its method ran, and the table and a note say which rows
    cover fewer benchmarks than the report."""
    recs = [record(0, "ar", bench="mt_bench"), record(0, "ar", bench="humaneval"),
            record(0, "gumiho", 0.5, bench="mt_bench"),
            record(0, "lookup", 0.8, bench="humaneval")]
    rep, md, err = speed_report(tmp_path, [write(tmp_path / "a.jsonl", recs)])
    assert rep["mean"]["ar"]["benchmarks"] == ["mt_bench", "humaneval"]
    assert rep["mean"]["gumiho"]["benchmarks"] == ["mt_bench"]
    note = ("mean rows at T=0.0 over fewer benchmarks than the report's 2 (MT-Bench, "
            "HumanEval): gumiho: MT-Bench; lookup: HumanEval (each mean averages only what "
            "its method ran)")
    assert f"note: {note}" in err and f"Note: {note}" in md
    assert "| **mean** (1 of 2) | gumiho |" in md and "| **mean** | ar |" in md


def test_speed_names_left_out_answers_and_a_half_written_line(tmp_path):
    """ar: 2 answers and a half-written third line; lookup: 4. Notes name the damaged line
    and the 2 lookup answers without an ar answer; the speedup's basis is ar's rate on the
    questions both answered, shown in the row."""
    ar = write(tmp_path / "ar.jsonl", [record(q, "ar") for q in range(2)],
               tail='{"question_id": 2, "tur')
    lk = write(tmp_path / "lk.jsonl", [record(q, "lookup", 0.5) for q in range(4)])
    rep, md, err = speed_report(tmp_path, [ar, lk])
    assert f"{ar} line 3 is half-written" in err and f"{ar} line 3 is half-written" in md
    assert "mt_bench at T=0.0: 2 lookup answers (questions 2, 3) left out of its row (no " \
        "ar answer to pair with)" in err
    row = rep["mt_bench"]["lookup"]
    assert row["questions"] == 2 and row["baseline_tokens_per_s"] == pytest.approx(10.0)
    assert row["speedup"] == pytest.approx(row["tokens_per_s"] / 10.0)
    assert "| MT-Bench | lookup | 20.0 | 2.00x | 2.00-2.00 |" in md
    assert "| questions (ar tokens/s on them) |" in md


def test_the_speedups_basis_is_shown_where_it_is_not_the_baseline_row(tmp_path):
    """ar answered 4 questions, gumiho 2: gumiho's speedup divides by ar's rate on those 2,
    which the row shows beside its question count; one question has no interval."""
    ar = [record(q, "ar", wall) for q, wall in enumerate([1.0, 1.0, 2.0, 2.0])]
    gm = [record(q, "gumiho", 0.5) for q in range(2)] + [
        record(0, "gumiho", 0.5, bench="humaneval")]
    ar.append(record(0, "ar", bench="humaneval"))
    rep, md, err = speed_report(tmp_path, [write(tmp_path / "ar.jsonl", ar),
                                           write(tmp_path / "gm.jsonl", gm)])
    assert rep["mt_bench"]["ar"]["tokens_per_s"] == pytest.approx(40 / 6)
    assert rep["mt_bench"]["gumiho"]["speedup"] == pytest.approx(2.0)
    assert "| MT-Bench | gumiho | 20.0 | 2.00x |" in md
    assert "| 2 (10.0) |" in md and "| 4 |" in md
    assert "| HumanEval | gumiho | 20.0 | 2.00x | - |" in md
    assert "speedup_interval" not in rep["humaneval"]["gumiho"]


def test_speed_reports_the_questions_asked_for(tmp_path):
    """Files holding answers to 3 questions, a report asked for the first one: 1/1, and a
    note on the answers left out (an earlier run's, still in the files)."""
    from gumiho.evaluation.benchmarks import load_questions

    ids = [q["question_id"] for q in load_questions("gsm8k_like")[:3]]
    files = [write(tmp_path / f"{m}.jsonl", [record(q, m, bench="gsm8k_like") for q in ids])
             for m in ("ar", "gumiho")]
    rep, md, err = speed_report(tmp_path, files, "--question-end", "1")
    assert rep["gsm8k_like"]["gumiho"]["identical"] == [1, 1]
    assert rep["gsm8k_like"]["ar"]["questions"] == 1
    assert "note: 4 answers in the files are to other questions than --question-begin 0 " \
        "--question-end 1 asks for: left out of the report" in err


def test_the_eval_script_reads_paths_from_the_callers_folder(tmp_path):
    """A relative GUMIHO_DRAFT and OUT are the caller's, not the repository's; the default
    drafters and the benchmarks are found from any folder."""
    (tmp_path / "tr1").symlink_to(ROOT / "gumiho/assets/smollm2/gumiho")
    env = {**os.environ, "QUICK": "1", "OUT": "out", "QEND": "1", "MAXNEW": "3",
           "BENCHES": "gsm8k_like", "LOOKUP": "0", "EAGLE_DRAFT": "", "GUMIHO_DRAFT": "tr1",
           "GUMIHO_ARGS": "--total-tokens 4 --depth 1", "MEDUSA_ARGS": "--total-tokens 4"}
    env.pop("MEDUSA_DRAFT", None)  # the shipped one, found from here
    proc = subprocess.run(["bash", str(ROOT / "scripts/eval_smollm2.sh")], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads((tmp_path / "out/report.json").read_text())["results"]["0.0"]
    assert {label.split(" ")[0] for label in rows["gsm8k_like"]} == {"ar", "gumiho", "medusa"}
    assert not (ROOT / "out").exists()


def test_the_scripts_parse():
    for name in ("eval_smollm2.sh", "eval_llama3.sh"):
        subprocess.run(["bash", "-n", str(ROOT / "scripts" / name)], check=True)
