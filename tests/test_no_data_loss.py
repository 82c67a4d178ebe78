"""Resuming long jobs loses nothing (issue 13): gen_answers keeps every valid record and
drops only a half-written last one; Ctrl-C exits 130 and the same command resumes;
allocation counts what it skips and remakes a damaged shard."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gumiho.errors import GumihoError
from gumiho.evaluation import gen_answers, speed
from gumiho.evaluation.answers import read_answer_file
from gumiho.evaluation.benchmarks import load_questions
from gumiho.ge_data import allocation
from gumiho.ge_data.conversations import load_conversations
from gumiho.ge_data.shards import load_samples, shard_path
from gumiho.paths import write_atomically
from gumiho.target import choose_device_dtype

from conftest import child_env

QIDS = [q["question_id"] for q in load_questions("gsm8k_like")]


def answer_args(target: str, path: Path, end: int = 3, *extra: str) -> list[str]:
    return ["--target", target, "--method", "ar", "--bench", "gsm8k_like", "--question-end",
            str(end), "--max-new-tokens", "3", "--warmup", "0", "--answer-file", str(path),
            *extra]


def test_resume_keeps_every_record_and_drops_only_a_half_written_one(tmp_path,
                                                                      tiny_target_dir):
    path = tmp_path / "a.jsonl"
    assert gen_answers.main(answer_args(tiny_target_dir, path, 2)) == 0
    complete = path.read_bytes()
    path.write_bytes(complete + complete.splitlines()[0][:50])  # killed mid-record
    assert gen_answers.main(answer_args(tiny_target_dir, path, 4)) == 0
    data = path.read_bytes()
    assert data.startswith(complete)  # the valid records, byte for byte
    records = read_answer_file(path).records
    assert [r["question_id"] for r in records] == QIDS[:4]


def test_resume_after_a_record_without_its_newline(tmp_path, tiny_target_dir):
    path = tmp_path / "a.jsonl"
    assert gen_answers.main(answer_args(tiny_target_dir, path, 1)) == 0
    path.write_bytes(path.read_bytes().rstrip(b"\n"))  # killed between record and newline
    assert gen_answers.main(answer_args(tiny_target_dir, path, 2)) == 0
    assert [r["question_id"] for r in read_answer_file(path).records] == QIDS[:2]


def test_damaged_middle_line_is_refused_and_kept(tmp_path, tiny_target_dir, capsys):
    path = tmp_path / "a.jsonl"
    assert gen_answers.main(answer_args(tiny_target_dir, path, 3)) == 0
    lines = path.read_bytes().splitlines(keepends=True)
    damaged = lines[0] + b'{"question_id": 1, "tu\n' + lines[2]
    path.write_bytes(damaged)
    assert gen_answers.main(answer_args(tiny_target_dir, path, 4)) == 2
    assert "line 2 is damaged" in capsys.readouterr().err
    assert path.read_bytes() == damaged


def test_other_settings_are_refused_unless_overwrite(tmp_path, tiny_target_dir, capsys):
    path = tmp_path / "a.jsonl"
    assert gen_answers.main(answer_args(tiny_target_dir, path, 2)) == 0
    before = path.read_bytes()
    for extra, setting in ((["--temperature", "0.7"], "temperature="),
                           (["--seed", "3"], "seed="),
                           (["--chat-template", "vicuna"], "chat_template="),
                           (["--method", "medusa", "--draft", "random"], "method=")):
        assert gen_answers.main(answer_args(tiny_target_dir, path, 2, *extra)) == 2
        assert setting in capsys.readouterr().err
        assert path.read_bytes() == before
    assert gen_answers.main(answer_args(tiny_target_dir, path, 1, "--seed", "3",
                                        "--overwrite")) == 0
    records = read_answer_file(path).records
    assert len(records) == 1 and records[0]["settings"]["seed"] == 3


def test_answers_timed_by_other_code_or_hardware_are_refused(tmp_path, tiny_target_dir,
                                                              capsys, monkeypatch):
    """Speeds in one answer file must compare: a resume under another dtype, another
    commit of the code or another torch is refused, naming what differs."""
    path = tmp_path / "a.jsonl"
    assert gen_answers.main(answer_args(tiny_target_dir, path, 1)) == 0
    before = path.read_bytes()
    assert gen_answers.main(answer_args(tiny_target_dir, path, 2, "--dtype", "bfloat16")) == 2
    assert "dtype='torch.float32' in the file, 'torch.bfloat16' now" in capsys.readouterr().err
    monkeypatch.setattr(gen_answers, "code_version", lambda: "0123abc")
    assert gen_answers.main(answer_args(tiny_target_dir, path, 2)) == 2
    err = capsys.readouterr().err
    assert "git_commit=" in err and "'0123abc' now" in err, err
    assert path.read_bytes() == before


def test_nothing_to_do_leaves_the_file_alone(tmp_path, tiny_target_dir, capsys):
    path = tmp_path / "a.jsonl"
    assert gen_answers.main(answer_args(tiny_target_dir, path, 2)) == 0
    stamp = path.stat().st_mtime_ns
    assert gen_answers.main(answer_args(tiny_target_dir, path, 2)) == 0
    assert "already answered" in capsys.readouterr().err
    assert path.stat().st_mtime_ns == stamp


def test_speed_without_shared_questions_reports_no_speedup(tmp_path, capsys):
    def rec(qid, method):
        return {"question_id": qid, "settings": {"method": method, "bench": "mt_bench",
                                                 "temperature": 0.0},
                "turns": [{"new_tokens": 4, "cycles": 2, "wall_s": 1.0,
                           "accept_lengths": [1, 3]}], "env": {}}

    (tmp_path / "ar.jsonl").write_text(json.dumps(rec(1, "ar")) + "\n")
    (tmp_path / "g.jsonl").write_text(json.dumps(rec(2, "gumiho")) + "\n")
    files = [str(tmp_path / "ar.jsonl"), str(tmp_path / "g.jsonl")]
    assert speed.main(["--answers", *files, "--out", str(tmp_path / "r")]) == 0
    assert "share no mt_bench question" in capsys.readouterr().err
    rep = json.loads((tmp_path / "r.json").read_text())["results"]["0.0"]
    assert "speedup" not in rep["mt_bench"]["gumiho"] and rep["mt_bench"]["gumiho"]["tau"] == 2
    # a second run may replace its own report
    assert speed.main(["--answers", *files, "--out", str(tmp_path / "r")]) == 0


def test_speed_refuses_to_pool_different_runs(tmp_path, capsys):
    def rec(qid, draft):
        return {"question_id": qid, "settings": {"method": "gumiho", "bench": "mt_bench",
                                                 "temperature": 0.0, "draft": draft},
                "turns": [{"new_tokens": 4, "cycles": 2, "wall_s": 1.0,
                           "accept_lengths": [1, 3]}], "env": {}}

    (tmp_path / "a.jsonl").write_text(json.dumps(rec(1, "runs/a")) + "\n")
    (tmp_path / "b.jsonl").write_text(json.dumps(rec(2, "runs/b")) + "\n")
    assert speed.main(["--answers", str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"),
                       "--out", str(tmp_path / "r")]) == 2
    assert "made differently (draft=" in capsys.readouterr().err
    # the same drafter timed in another dtype
    other = rec(2, "runs/a")
    other["env"] = {"device": "cpu", "dtype": "torch.bfloat16"}
    first = rec(1, "runs/a")
    first["env"] = {"device": "cpu", "dtype": "torch.float32"}
    (tmp_path / "a.jsonl").write_text(json.dumps(first) + "\n")
    (tmp_path / "b.jsonl").write_text(json.dumps(other) + "\n")
    assert speed.main(["--answers", str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"),
                       "--out", str(tmp_path / "r")]) == 2
    assert "made differently (dtype=" in capsys.readouterr().err
    # ... and with another attention (sdpa_invariant's bf16 is exact, sdpa's is not)
    other["env"] = {"device": "cpu", "dtype": "torch.float32", "attention": "sdpa_invariant"}
    (tmp_path / "b.jsonl").write_text(json.dumps(other) + "\n")
    assert speed.main(["--answers", str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"),
                       "--out", str(tmp_path / "r")]) == 2
    assert "made differently (attention=" in capsys.readouterr().err


def test_malformed_conversations_are_counted(tmp_path):
    good = {"id": "a", "conversations": [{"from": "human", "value": "hi"},
                                         {"from": "gpt", "value": "hello"}]}
    lines = [json.dumps(good), "{not json", json.dumps({"conversations": "oops"}),
             json.dumps({"conversations": ["not a turn"]}), json.dumps([1, 2]),
             json.dumps({**good, "id": "b"})]
    path = tmp_path / "c.jsonl"
    path.write_text("\n".join(lines) + "\n")
    notes: list[str] = []
    conversations = load_conversations(str(path), notes)
    assert [c["id"] for c in conversations] == ["a", "b"]
    assert any("1 line(s) are not valid JSON" in n and "line 2" in n for n in notes)
    assert any("3 of 5 records are not usable" in n for n in notes)
    array = tmp_path / "c.json"
    array.write_text("[" + json.dumps(good) + ", {\"conversations\": [" + "\n")
    notes = []
    assert len(load_conversations(str(array), notes)) == 1
    assert "cut off or invalid at line 2" in notes[0]
    (tmp_path / "bad.jsonl").write_text("[1]\n{}\n")
    with pytest.raises(GumihoError, match="no usable"):
        load_conversations(str(tmp_path / "bad.jsonl"))


def test_allocation_remakes_a_truncated_shard(tmp_path, tiny_target_dir, capsys):
    args = ["--outdir", str(tmp_path / "d"), "--target", tiny_target_dir, "--end", "4",
            "--shard-size", "2", "--max-len", "64"]
    assert allocation.main(args) == 0
    count = len(load_samples(tmp_path / "d")[1])
    shard = shard_path(tmp_path / "d", 1)
    os.truncate(shard, shard.stat().st_size // 2)
    kept = shard_path(tmp_path / "d", 0).stat().st_mtime_ns
    capsys.readouterr()
    assert allocation.main(args) == 0
    assert "is damaged" in capsys.readouterr().err
    assert len(load_samples(tmp_path / "d")[1]) == count
    assert shard_path(tmp_path / "d", 0).stat().st_mtime_ns == kept


def run_and_interrupt(cmd: list[str], ready, timeout: float = 240) -> tuple[int, str]:
    """Start `python -m ...`, send SIGINT once ready() is true, return (status, stderr)."""
    env = child_env()
    proc = subprocess.Popen([sys.executable, "-m", *cmd], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            # a shell's background job ignores SIGINT, and children inherit it
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + timeout
    while not ready() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    if proc.poll() is not None:  # nothing left to interrupt: say why rather than ESRCH
        _, err = proc.communicate()
        pytest.fail(f"{cmd[0]} ended (status {proc.returncode}) before the interrupt; give "
                    f"it more work. Its stderr ends: {err[-800:]}")
    os.killpg(proc.pid, signal.SIGINT)  # like Ctrl-C: the whole foreground group
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err


def test_ctrl_c_in_gen_answers_then_resume(tmp_path, tiny_target_dir):
    path = tmp_path / "a.jsonl"
    cmd = ["gumiho.evaluation.gen_answers", *answer_args(tiny_target_dir, path, 40)]
    cmd[cmd.index("--max-new-tokens") + 1] = "40"

    def two_answers():
        return path.exists() and path.read_bytes().count(b"\n") >= 2

    code, err = run_and_interrupt(cmd, two_answers)
    lines = [line for line in err.splitlines() if line.startswith(("error", "interrupted"))]
    assert code == 130 and "Traceback" not in err, err
    assert lines == ["interrupted: every finished answer is kept in the answer file; rerun "
                     "the same command to resume"]
    kept = read_answer_file(path).records
    assert len(kept) >= 2
    resume = answer_args(tiny_target_dir, path, len(kept) + 1)
    resume[resume.index("--max-new-tokens") + 1] = "40"
    assert gen_answers.main(resume) == 0
    assert [r["question_id"] for r in read_answer_file(path).records] == \
        QIDS[: len(kept) + 1]


def test_ctrl_c_in_allocation_then_resume(tmp_path, tiny_target_dir):
    out = tmp_path / "d"
    # enough shards that the run is still writing them when the interrupt comes: on a GPU
    # each takes milliseconds, and 150 were all written before a poll on a loaded host (the
    # sixth lease); the resume below makes the rest, so the CPU keeps the smaller count
    shards = 150 if choose_device_dtype()[0].type == "cpu" else 3000
    args = ["--outdir", str(out), "--target", tiny_target_dir, "--end", str(shards),
            "--shard-size", "1", "--max-len", "256"]
    # interrupted with two worker processes (Ctrl-C reaches them and allocation, which
    # stops them), resumed by the one CPU worker in allocation's own process
    code, err = run_and_interrupt(["gumiho.ge_data.allocation", *args, "--workers", "2"],
                                  lambda: shard_path(out, 1).exists())
    lines = [line for line in err.splitlines() if line.startswith(("error", "interrupted"))]
    assert code == 130 and "Traceback" not in err, err
    assert lines == ["interrupted: finished shards are kept; rerun the same command to "
                     "resume"]
    finished = {p.name: p.stat().st_mtime_ns for p in out.glob("shard_*.pt")}
    assert allocation.main(args) == 0
    assert all((out / n).stat().st_mtime_ns == t for n, t in finished.items())
    assert len(list(out.glob("shard_*.pt"))) == shards


def test_an_atomic_write_that_fails_leaves_the_old_file(tmp_path):
    """write_atomically (checkpoints, shards, manifests, answer files, caches): a writer
    that dies half way leaves the old file whole and no temp file behind; one that
    finishes replaces it."""
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"old")

    def dies(tmp: Path) -> None:
        tmp.write_bytes(b"ha")  # half of the new file, then the process is interrupted
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_atomically(path, dies)
    assert path.read_bytes() == b"old" and sorted(tmp_path.iterdir()) == [path]
    write_atomically(path, lambda tmp: tmp.write_bytes(b"new"), unique=True)
    assert path.read_bytes() == b"new" and sorted(tmp_path.iterdir()) == [path]
