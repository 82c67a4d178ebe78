"""The interleaved evaluation runner: every method answers question i before any answers
question i+1, the order rotates, the target loads once, the answer files are gen_answers'
own (same records, same resume), and bad flags get one line."""

import json

import pytest

from gumiho.errors import GumihoError
from gumiho.evaluation import gen_answers, interleave, speed
from gumiho.evaluation.benchmarks import load_questions

from conftest import DEVICE

QIDS = [q["question_id"] for q in load_questions("gsm8k_like")]


def common(target: str, end: int = 3) -> list[str]:
    return ["--target", target, "--bench", "gsm8k_like", "--question-end", str(end),
            "--max-new-tokens", "3", "--warmup", "0"]


def runs(tmp_path) -> list[str]:
    return ["--run", f"--method ar --answer-file {tmp_path / 'ar.jsonl'}",
            "--run", f"--method lookup --lookup 4 --answer-file {tmp_path / 'lk.jsonl'}",
            "--run", f"--method gumiho --draft random --total-tokens 6 "
                     f"--answer-file {tmp_path / 'gm.jsonl'}"]


def texts(path) -> list[tuple]:
    return [(r["question_id"], [t["text"] for t in r["turns"]])
            for r in map(json.loads, path.read_text().splitlines())]


@pytest.fixture
def order(monkeypatch):
    """(answer file name, question id) in the order questions were answered."""
    seen = []
    real = gen_answers.Job.answer

    def spy(job, question):
        seen.append((job.path.name, question["question_id"]))
        return real(job, question)
    monkeypatch.setattr(gen_answers.Job, "answer", spy)
    return seen


def test_rotating_order_one_target_and_gen_answers_records(tmp_path, tiny_target_dir, order,
                                                           monkeypatch):
    loads = []
    real_load = interleave.load_target
    monkeypatch.setattr(interleave, "load_target",
                        lambda *a, **k: loads.append(a) or real_load(*a, **k))
    assert interleave.main([*common(tiny_target_dir), *runs(tmp_path)]) == 0
    assert len(loads) == 1  # one target shared by the three generators
    names = ["ar.jsonl", "lk.jsonl", "gm.jsonl"]
    expected = [(names[(i + k) % 3], qid) for i, qid in enumerate(QIDS[:3]) for k in range(3)]
    assert order == expected  # question by question, first method rotating
    # the same records gen_answers writes alone (greedy: every method's text is plain's)
    alone = tmp_path / "alone.jsonl"
    assert gen_answers.main([*common(tiny_target_dir), "--method", "ar",
                             "--answer-file", str(alone)]) == 0
    for name in names:
        assert texts(tmp_path / name) == texts(alone)
    ar = json.loads((tmp_path / "ar.jsonl").read_text().splitlines()[0])
    assert ar["settings"]["method"] == "ar" and ar["env"]["device"].startswith(DEVICE.type)
    files = [str(tmp_path / n) for n in names]
    assert speed.main(["--answers", *files, "--out", str(tmp_path / "report")]) == 0


def test_interrupted_then_resumed(tmp_path, tiny_target_dir, order, monkeypatch):
    real = gen_answers.Job.answer
    calls = []

    def stop_at_fifth(job, question):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real(job, question)
    monkeypatch.setattr(gen_answers.Job, "answer", stop_at_fifth)
    assert interleave.main([*common(tiny_target_dir), *runs(tmp_path)]) == 130
    counts = [len((tmp_path / n).read_text().splitlines())
              for n in ("ar.jsonl", "lk.jsonl", "gm.jsonl")]
    assert sorted(counts) == [1, 1, 2]  # four answers kept, the fifth never started
    monkeypatch.setattr(gen_answers.Job, "answer", real)
    assert interleave.main([*common(tiny_target_dir), *runs(tmp_path)]) == 0
    for name in ("ar.jsonl", "lk.jsonl", "gm.jsonl"):
        assert [qid for qid, _ in texts(tmp_path / name)] == QIDS[:3]
    assert interleave.main([*common(tiny_target_dir), *runs(tmp_path)]) == 0  # all done


@pytest.mark.parametrize("run_flags, message", [
    ("--method ar --bench mt_bench --answer-file {d}/x.jsonl", "give --bench once"),
    ("--method ar --seed=3 --answer-file {d}/x.jsonl", "give --seed once"),
    ("--method ar --answer-file {d}/ar.jsonl", "two runs write the same answer file"),
    ("--method ar --answer-file {d}/./ar.jsonl", "two runs write the same answer file"),
    ("--method ar --answer-file '{d}/x.jsonl", "No closing quotation"),
])
def test_bad_runs(tmp_path, tiny_target_dir, run_flags, message):
    argv = [*common(tiny_target_dir), "--run", f"--method ar --answer-file {tmp_path}/ar.jsonl",
            "--run", run_flags.format(d=tmp_path)]
    with pytest.raises(GumihoError, match=message):
        interleave.parse_runs(argv)
    assert not list(tmp_path.iterdir())  # nothing written


def test_a_shared_target_keeps_its_own_device(smollm2):
    from gumiho.generate import SpeculativeGenerator
    with pytest.raises(TypeError, match="already loaded Target"):
        SpeculativeGenerator.load(smollm2, "ar", device="cpu")
    gen = SpeculativeGenerator.load(smollm2, "ar")
    assert gen.target is smollm2


def test_an_abbreviated_shared_flag_inside_a_run_is_refused(tmp_path, tiny_target_dir, capsys):
    """argparse would read --max-new as --max-new-tokens for that run alone, past the
    "give it once" check: runs of different settings answering "the same" questions."""
    argv = [*common(tiny_target_dir), "--run", f"--method ar --answer-file {tmp_path}/a.jsonl",
            "--run", f"--method lookup --max-new 64 --answer-file {tmp_path}/b.jsonl"]
    with pytest.raises(SystemExit) as exit_:
        interleave.parse_runs(argv)
    assert exit_.value.code == 2 and "--max-new" in capsys.readouterr().err
