"""Review of the trainer (session 66): a run's end cut off after its last epoch's save, the
seed's range, a run dir holding a kill's leftover temp file, and the plot's --out."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_training import Killed, kill_at

import gumiho.train.__main__ as trainer
import gumiho.train.accel as accel
from gumiho.errors import GumihoError
from gumiho.train import plot
from gumiho.train.__main__ import check_run_dir, main
from gumiho.train.state import LOG


@pytest.fixture(autouse=True)
def bf16_is_fast(monkeypatch):
    monkeypatch.setattr(accel, "bf16_slowdown", lambda: 1.0)


def train_args(data, out, *extra):
    # 10 samples, 2 a micro-batch, 2 micro-batches a step: 2 steps an epoch, so the run's
    # last step (4) is its second epoch's end, as every run by --epochs alone
    return ["--target", data[0], "--data", data[1], "--method", "gumiho", "--output-dir",
            str(out), "--max-steps", "4", "--batch-size", "2", "--grad-accum", "2",
            "--warmup-steps", "2", "--log-every", "1", "--ploss-fraction", "0.5", *extra]




@pytest.mark.parametrize("name, call", [("save_drafter", 3), ("evaluate", 1)],
                         ids=["final_export", "final_evaluation"])
def test_a_kill_after_the_last_epochs_save_leaves_a_run_the_rerun_finishes(
        tiny_target_dir, tiny_data_dir, tmp_path, monkeypatch, capsys, name, call):
    """The last step is an epoch's end: its save writes checkpoint-epoch2 and a state at
    step 4, then the run's end evaluates and writes OUT's weights and summary. A kill in
    between left a state at the last step and no weights in OUT: the rerun said "already
    trained ... nothing to do" and never wrote them. Now it writes them, an uninterrupted
    run's weights, and a third run leaves them alone."""
    data = (tiny_target_dir, tiny_data_dir)
    extra = ("--eval-data", tiny_data_dir, "--export-dtype", "float32")
    assert main(train_args(data, tmp_path / "whole", *extra)) == 0
    out = tmp_path / "cut"
    with monkeypatch.context() as patch:
        kill_at(patch, name, call)
        with pytest.raises(Killed):
            main(train_args(data, out, *extra))
    assert json.loads((out / "state" / "progress.json").read_text())["progress"]["step"] == 4
    assert not (out / "model.safetensors").exists()
    capsys.readouterr()
    assert main(train_args(data, out, *extra)) == 0
    assert "final export and summary were not written" in capsys.readouterr().out
    whole = load_file(str(tmp_path / "whole" / "model.safetensors"))
    cut = load_file(str(out / "model.safetensors"))
    assert whole.keys() == cut.keys()
    for key in whole:
        torch.testing.assert_close(cut[key], whole[key], atol=0, rtol=0)
    summary = json.loads((out / "train_summary.json").read_text())
    expected = json.loads((tmp_path / "whole" / "train_summary.json").read_text())
    assert summary["steps"] == 4 and summary["train_tokens_per_s"] is None  # none trained
    assert summary["held_out_accuracy"] == expected["held_out_accuracy"]
    assert json.loads((out / "config.json").read_text())["trained_steps"] == 4
    steps = [json.loads(line)["step"] for line in (out / LOG).open()]
    assert steps == [1, 2, 3, 4]
    capsys.readouterr()
    written = (out / "train_summary.json").read_text()
    assert main(train_args(data, out, *extra)) == 0
    assert "already trained to step 4 of 4; nothing to do" in capsys.readouterr().out
    assert (out / "train_summary.json").read_text() == written


@pytest.mark.host
@pytest.mark.parametrize("seed", ["-1", str(2**32)])
def test_a_seed_outside_numpys_range_is_one_line(capsys, seed):
    """accelerate's set_seed seeds numpy too, which takes 0..2^32-1: another seed was an
    internal error once the target had loaded."""
    with pytest.raises(SystemExit) as exit_:
        main(["--online", "--output-dir", "unused", "--seed", seed, "--dry-run"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "--seed" in err[0], err
    assert trainer.seed_arg(str(2**32 - 1)) == 2**32 - 1


@pytest.mark.host
@pytest.mark.parametrize("leftover", ["train_summary.json.tmp", f"{LOG}.tmp"])
def test_a_run_cut_off_mid_write_before_its_first_state_is_its_own_dir(tmp_path, leftover):
    """A run whose first save is its end (it stops before an epoch's end) writes OUT's
    export and summary before any state; a kill -9 while the summary (or the log, trimmed
    on a rerun) was written leaves its temp file, and the rerun refused its own dir."""
    for name in (LOG, "model.safetensors", "config.json", leftover):
        (tmp_path / name).write_text("{}")
    check_run_dir(tmp_path)
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(GumihoError, match="holds files but no training run"):
        check_run_dir(tmp_path)


@pytest.fixture
def logged_run(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": 2, "eval": {"acc_serial1": 0.1}}, {"step": 4, "eval": {"acc_serial1": 0.2}}]
    (run / LOG).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


@pytest.mark.host
@pytest.mark.parametrize("name, says", [("missing/curves.png", "does not exist"),
                                        ("curves.txt", "cannot write '.txt' images"),
                                        (".", "cannot write it")])
def test_a_plot_that_cannot_be_written_is_one_line(logged_run, tmp_path, capsys, name, says):
    """--out in a folder that is not there, in a format matplotlib has no writer for, or a
    folder: internal errors (FileNotFoundError, ValueError, IsADirectoryError) before."""
    out = tmp_path / name if name != "." else tmp_path
    assert plot.main([str(logged_run), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --out") and says in err[0], err
    assert "internal error" not in err[0]


@pytest.mark.host
def test_a_plot_named_without_a_suffix_is_written_under_that_name(logged_run, tmp_path,
                                                                 capsys):
    """matplotlib adds ".png" to such a name, and the path printed was not the file
    written; another format goes by its suffix."""
    out = tmp_path / "curves"
    assert plot.main([str(logged_run), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert out.read_bytes().startswith(b"\x89PNG") and not (tmp_path / "curves.png").exists()
    svg = tmp_path / "curves.svg"
    assert plot.main([str(logged_run), "--out", str(svg)]) == 0
    assert b"<svg" in svg.read_bytes()[:1000]


class TwoProcessSave:
    """The main process's accelerator in a group of two whose other process writes its
    part of a save (its RNG file) late: the file appears by the next barrier, as a real
    barrier waits for it; a save with no barrier between would find its folder gone."""

    is_main_process, num_processes = True, 1  # (the barrier: accelerator.wait_for_everyone)

    def __init__(self):
        self.late: list = []

    def save_state(self, path):
        Path(path).mkdir(parents=True, exist_ok=True)
        Path(path, "random_states_0.pkl").write_bytes(b"main")
        self.late.append(Path(path, "random_states_1.pkl"))

    def wait_for_everyone(self):
        for file in self.late:  # the other process writes into the folder it was given
            if not file.parent.is_dir():
                raise FileNotFoundError(f"Parent directory {file.parent} does not exist.")
            file.write_bytes(b"other")
        self.late.clear()


@pytest.mark.host
def test_a_state_is_renamed_into_place_after_every_process_wrote_its_part(tmp_path):
    """accelerate's save_state has no barrier at its end: with the main process marking
    the state complete and renaming it at once, a second process slower to write its RNG
    file found state.tmp gone (reproduced with two gloo processes, one delayed by 3 s: a
    RuntimeError there, and a state marked complete without its file)."""
    from gumiho.train.state import RunState, save_run_state, state_dir

    scheduler = torch.optim.lr_scheduler.LambdaLR(
        torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0), lambda s: 1.0)
    save_run_state(TwoProcessSave(), tmp_path, RunState(step=3), {}, scheduler)
    assert state_dir(tmp_path) == tmp_path / "state"
    assert (tmp_path / "state" / "random_states_1.pkl").read_bytes() == b"other"
    assert not (tmp_path / "state.tmp").exists()


@pytest.mark.host
def test_plot_names_without_a_chain_is_refused(logged_run, tmp_path, capsys):
    """--names labels a --chain's runs; without --chain it was dropped without a word."""
    out = tmp_path / "c.png"
    assert plot.main([str(logged_run), "--out", str(out), "--names", "CPU"]) == 2
    assert "--names labels the runs of a --chain" in capsys.readouterr().err
    assert not out.exists()


def test_held_out_accuracy_averages_each_position_over_the_batches_that_score_it(
        tiny_target_dir, tiny_data_dir, monkeypatch):
    """A batch of short samples holds no position for the later heads and logs no
    accuracy for them (as in training's logs); the held-out mean divided their sums by
    every batch, so such a batch read as an accuracy of 0 there."""
    from gumiho.config import TrainConfig
    from gumiho.ge_data.shards import load_samples
    from gumiho.modeling import DraftHead
    from gumiho.target import load_target
    from gumiho.train import step
    from gumiho.train.start import new_model

    tiny = load_target(tiny_target_dir, device="cpu")
    _, samples = load_samples(tiny_data_dir)
    short = {k: v[:6].clone() for k, v in samples[0].items() if k != "id"}
    short["loss_mask"][:] = 0
    short["loss_mask"][2:] = 1  # the last scored position, 5: MLP heads 1..3 reach it
    model = new_model(tiny, TrainConfig(online=True), seed=0)
    head = DraftHead.for_model(tiny, model)
    rows = step.batch_accuracies(model, tiny, head, [samples[0], short], "gumiho", 0, 1)
    assert "acc_mlp5" in rows[0] and "acc_mlp3" in rows[1] and "acc_mlp4" not in rows[1]
    made = [{"acc_serial1": 0.4, "acc_mlp5": 0.5}, {"acc_serial1": 0.2}]
    monkeypatch.setattr(step, "batch_accuracies", lambda *args: made)
    acc = step.evaluate(model, tiny, head, [samples[0], short], "gumiho", 0, 1)
    assert acc == pytest.approx({"acc_serial1": 0.3, "acc_mlp5": 0.5})


@pytest.mark.parametrize("flag, value", [("lr", float("inf")), ("grad_clip", float("inf")),
                                         ("lr", float("nan")), ("noise", float("inf")),
                                         ("ploss_weight", float("inf"))])
def test_an_infinite_rate_or_weight_is_one_line(flag, value):
    from gumiho.config import TrainConfig

    with pytest.raises(GumihoError, match=f"--{flag.replace('_', '-')} must be"):
        TrainConfig(online=True, **{flag: value})
