"""Review of the evaluation tools (session 66): the speed report's file names, a question
answered twice in one answer file, the official tau without verify cycles, rows whose
benchmark the baseline did not answer, and the table's name for what texts are compared
with."""

import json
import os

import pytest
from test_evaluation import record as evaluation_record
from test_evaluation import write_files

from gumiho.errors import GumihoError
from gumiho.evaluation import speed


def record(*args, text="same", **kwargs):
    """test_evaluation's answer record, each turn's text the same by default."""
    return evaluation_record(*args, text=text, **kwargs)


def two_runs(tmp_path):
    return write_files(tmp_path, {"ar": [record(1, "ar", 10, 10, 2.0, [1] * 10)],
                                  "gm": [record(1, "gumiho", 10, 4, 1.0, [1, 4, 2, 3])]})


def test_a_dot_in_the_report_name_is_no_extension(tmp_path):
    """--out report_T0.7 wrote report_T0.md/.json/.png (Path.with_suffix), which --out
    report_T0.5 then replaced without a word; --out r.md still writes r.md, r.json, r.png."""
    files = two_runs(tmp_path)
    for name in ("report_T0.7", "report_T0.5"):
        assert speed.main(["--answers", *files, "--out", str(tmp_path / name)]) == 0
    for name in ("report_T0.7", "report_T0.5"):
        for suffix in (".md", ".json", ".png"):
            assert (tmp_path / f"{name}{suffix}").is_file(), name + suffix
    assert not (tmp_path / "report_T0.md").exists()
    assert speed.main(["--answers", *files, "--out", str(tmp_path / "r.md")]) == 0
    assert sorted(p.name for p in tmp_path.glob("r.*")) == ["r.json", "r.md", "r.png"]
    # a report written under the whole name is replaced by the next one, nothing else is
    (tmp_path / "notes_v1.2.md").write_text("my notes")
    assert speed.main(["--answers", *files, "--out", str(tmp_path / "notes_v1.2")]) == 2
    assert (tmp_path / "notes_v1.2.md").read_text() == "my notes"


def test_a_question_answered_twice_in_one_file_is_refused(tmp_path):
    """Two answers to one question in one file (two runs writing to it at once): the later
    silently replaced the earlier; it is refused with both lines, as across two files. The
    same file named twice on the command line is no duplicate."""
    files = write_files(tmp_path, {
        "ar": [record(1, "ar", 10, 10, 2.0, [1] * 10), record(2, "ar", 10, 10, 2.0, [1] * 10),
               record(1, "ar", 10, 10, 9.0, [1] * 10)]})
    with pytest.raises(GumihoError, match=r"question 1 at T=0.0 twice \(lines 1 and 3\)"):
        speed.read_answers(files)
    good = two_runs(tmp_path)
    assert sorted(speed.read_answers([*good, good[0]])) == [
        ("ar", "mt_bench", 0.0), ("gumiho", "mt_bench", 0.0)]


def test_the_official_tau_without_verify_cycles_is_one(tmp_path):
    """Answers that all ended at their prefill (one token, one cycle): new_tokens / (cycles
    - 1) pooled over 5 answers read 5.0 (tokens over a floor of one cycle); each answer's
    own figure (GenerationResult.tau_official) is 1."""
    files = write_files(tmp_path, {"ar": [record(q, "ar", 1, 1, 0.1, [1]) for q in range(5)]})
    row = speed.report(speed.read_answers(files))["0.0"]["mt_bench"]["ar"]
    assert row["tau"] == 1.0
    assert row["tau_official"] == 1.0
    # with verify cycles, the formula as before: 16 tokens over 7 - 2 cycles
    files = write_files(tmp_path, {"gm": [record(1, "gumiho", 10, 4, 1.0, [1, 4, 2, 3]),
                                          record(2, "gumiho", 6, 3, 0.5, [1, 1, 4])]})
    row = speed.report(speed.read_answers(files))["0.0"]["mt_bench"]["gumiho"]
    assert row["tau_official"] == pytest.approx(16 / 5)


def test_a_row_whose_benchmark_the_baseline_skipped_is_noted(tmp_path):
    """The baseline answered MT-Bench only: Gumiho's HumanEval row, and so its mean row,
    have no speedup; the docstring promises a note for a row without a baseline, and there
    was none (only a note when the baseline ran nowhere)."""
    files = write_files(tmp_path, {
        "ar": [record(1, "ar", 10, 10, 2.0, [1] * 10)],
        "gm": [record(1, "gumiho", 10, 4, 1.0, [1, 4, 2, 3]),
               record(2, "gumiho", 10, 4, 1.0, [1, 4, 2, 3], bench="humaneval")]})
    notes = []
    rep = speed.report(speed.read_answers(files, notes), notes=notes)["0.0"]
    assert "speedup" not in rep["humaneval"]["gumiho"]
    assert "speedup" not in rep["mean"]["gumiho"]
    assert any("no ar answers on humaneval at T=0.0: no speedup for gumiho there" in n
               for n in notes), notes
    # no baseline anywhere: main's one note, not one a benchmark or a temperature
    notes = []
    speed.report(speed.read_answers(files[1:], notes), notes=notes)
    assert not any("no ar answers" in n for n in notes), notes
    # none at one temperature: one note for it, not one a benchmark
    hot = [{**r, "settings": {**r["settings"], "temperature": 1.0}}
           for r in map(json.loads, (tmp_path / "gm.jsonl").read_text().splitlines())]
    (tmp_path / "hot.jsonl").write_text("".join(json.dumps(r) + "\n" for r in hot))
    notes = []
    speed.report(speed.read_answers([*files, str(tmp_path / "hot.jsonl")], notes),
                 notes=notes)
    assert [n for n in notes if "no ar answers" in n] == [
        "no ar answers at T=1.0: no speedups there",
        "no ar answers on humaneval at T=0.0: no speedup for gumiho there, nor in the mean "
        "row (answer it with ar too)"]


def test_the_table_names_the_baseline_texts_are_compared_with(tmp_path):
    """--baseline lookup: `identical` counts answers with lookup's text; the column read
    "same text as plain"."""
    files = write_files(tmp_path, {
        "lk": [record(1, "lookup", 10, 5, 1.5, [1, 2, 3, 2, 2])],
        "gm": [record(1, "gumiho", 10, 4, 1.0, [1, 4, 2, 3])]})
    assert speed.main(["--answers", *files, "--out", str(tmp_path / "r"),
                       "--baseline", "lookup"]) == 0
    text = (tmp_path / "r.md").read_text()
    assert "same text as lookup" in text and "same text as plain" not in text
    assert speed.main(["--answers", *two_runs(tmp_path), "--out", str(tmp_path / "r2")]) == 0
    assert "same text as plain" in (tmp_path / "r2.md").read_text()


def test_a_resume_under_other_gumiho_switches_is_refused(tmp_path, monkeypatch):
    """GUMIHO_FUSED=0, GUMIHO_ROWGEMM=0 and the like change which kernels run: answers timed
    under other switches must not share a file. A file from before switches were recorded
    resumes when none is set; the API key, cache folder, GUMIHO_DEBUG and the like are no
    switches."""
    from gumiho.evaluation.answers import AnswerFile
    from gumiho.evaluation.gen_answers import check_resume, switches

    for name in [k for k in os.environ if k.startswith("GUMIHO_")]:
        monkeypatch.delenv(name)
    for name, value in (("GUMIHO_API_KEY", "secret"), ("GUMIHO_CACHE", str(tmp_path)),
                        ("GUMIHO_DEBUG", "1"), ("GUMIHO_DEVICE", "cpu"),
                        ("GUMIHO_ERROR_FILE", "e"), ("GUMIHO_ARGS", "--x")):
        monkeypatch.setenv(name, value)  # (a traceback asked for, the eval scripts' own)
    assert switches() == {}
    settings = {"method": "gumiho"}
    old = {"settings": settings, "env": {"device": "cpu", "threads": 2}}  # no "switches"
    found = AnswerFile(records=[old], lines=[1], keep_bytes=0, needs_newline=False)
    check_resume(tmp_path / "a.jsonl", found, settings,
                 env={"device": "cpu", "threads": 2, "switches": switches()})
    monkeypatch.setenv("GUMIHO_FUSED", "0")
    with pytest.raises(GumihoError, match="switches"):
        check_resume(tmp_path / "a.jsonl", found, settings,
                     env={"device": "cpu", "threads": 2, "switches": switches()})
