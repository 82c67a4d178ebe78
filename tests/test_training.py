"""Training: the loss goes down, resume reproduces an uninterrupted run, the teacher-forced
pass matches inference, and a trained checkpoint decodes losslessly."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import gumiho.train.__main__ as trainer
import gumiho.train.accel as accel
from gumiho.checkpoint import to_official
from gumiho.config import TrainConfig, TreeConfig
from gumiho.drafters import PlainDrafter, load_drafter
from gumiho.engine import GenerateConfig, prefill, run
from gumiho.errors import GumihoError
from gumiho.ge_data.shards import load_samples
from gumiho.kv_cache import KVCache
from gumiho.modeling import DraftHead
from gumiho.serial_drafter import SerialDrafter
from gumiho.target import load_target
from gumiho.train.__main__ import main
from gumiho.train.accel import bf16_slowdown
from gumiho.train.dataset import collate
from gumiho.train.loss import LossWeights
from gumiho.train.start import new_model
from gumiho.train.step import batch_loss, noise_device

from conftest import DEVICE


@pytest.fixture(autouse=True)
def bf16_is_fast(monkeypatch):
    """These tests are about what bf16 training computes, not whether this CPU does it
    quickly: the refusal on a slow CPU has its own test."""
    monkeypatch.setattr(accel, "bf16_slowdown", lambda: 1.0)


@pytest.fixture(scope="module")
def tiny(tiny_target_dir):
    return load_target(tiny_target_dir, device=str(DEVICE))


@pytest.mark.parametrize("method", ["gumiho", "eagle2", "medusa"])
def test_training_steps_lower_the_loss(tiny, tiny_data_dir, method):
    _, samples = load_samples(tiny_data_dir)
    batch = collate(samples[:4])
    model = new_model(tiny, TrainConfig(method=method, online=True), seed=0)
    head = DraftHead.for_model(tiny, model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=3e-3)
    losses = []
    for _ in range(8):  # a fixed batch (the noise seed is fixed too)
        loss, _ = batch_loss(model, tiny, head, batch, method, epoch=3, noise=0.2)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    # every step on the fixed batch lowers it
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses


@pytest.mark.parametrize("method", ["gumiho", "eagle2", "medusa"])
def test_online_batches_backpropagate_in_fp32(tiny, tiny_data_dir, method):
    """An online batch has no stored features: the target computes them, and they must be
    tensors the drafter's backward can keep (Medusa's heads read them as they are, and
    PyTorch refuses an inference-mode tensor there)."""
    _, samples = load_samples(tiny_data_dir)
    batch = collate(samples[:2])
    batch.pop("hidden_state")
    model = new_model(tiny, TrainConfig(method=method, online=True), seed=0)
    loss, _ = batch_loss(model, tiny, DraftHead.for_model(tiny, model), batch, method,
                         epoch=3, noise=0.2)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None for g in grads) and any(bool(g.abs().sum()) for g in grads)


def test_mlp_ploss_joins_after_the_epochs_asked(tiny, tiny_data_dir):
    """Gumiho's MLP heads get ploss from epoch `mlp_p_from_epoch` on (the reference: after
    2 epochs; `--mlp-ploss-after-epochs` moves it for short runs)."""
    _, samples = load_samples(tiny_data_dir)
    batch = collate(samples[:4])
    model = new_model(tiny, TrainConfig(method="gumiho", online=True), seed=0)
    head = DraftHead.for_model(tiny, model)

    def loss(epoch, after):
        value, _ = batch_loss(model, tiny, head, batch, "gumiho", epoch=epoch, noise=0.2,
                              log_acc=False, weights=LossWeights(mlp_p_from_epoch=after))
        return float(value.detach())

    reference_early, reference_late = loss(1, 2), loss(2, 2)
    assert reference_late > reference_early  # ploss joined at the third epoch
    assert loss(0, 0) == pytest.approx(reference_late)  # ...or from the first, if asked
    assert loss(1, 1) == pytest.approx(reference_late)


def test_mlp_ploss_weight_reaches_the_loss(tiny_target_dir, tiny_data_dir, tmp_path):
    """--mlp-ploss-weight 0 with ploss joining at once trains exactly as ploss never
    joining; the reference weight trains otherwise."""
    data = (tiny_target_dir, tiny_data_dir)

    def trained(name, *flags):
        assert main(train_args(data, tmp_path / name, "--export-dtype", "float32", *flags)) == 0
        return load_file(str(tmp_path / name / "model.safetensors"))

    never = trained("never", "--mlp-ploss-after-epochs", "99")
    zero = trained("zero", "--mlp-ploss-after-epochs", "0", "--mlp-ploss-weight", "0")
    reference = trained("reference", "--mlp-ploss-after-epochs", "0")
    assert all(torch.equal(zero[k], never[k]) for k in never)
    assert any(not torch.equal(reference[k], never[k]) for k in never if k.startswith("mlp"))


def test_mlp_detach_keeps_the_heads_losses_off_the_serial_layers(tiny, tiny_data_dir):
    """--mlp-detach: the same loss; the MLP heads get the gradient they get without it, and
    every other weight the gradient of the serial step's losses alone. Without it the
    heads' losses reach the serial layers and the fusion layer (the reference)."""
    _, samples = load_samples(tiny_data_dir)
    batch = collate(samples[:4])
    model = new_model(tiny, TrainConfig(method="gumiho", online=True), seed=0)
    head = DraftHead.for_model(tiny, model)
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}

    def grads(weights: LossWeights, detach: bool):
        loss, _ = batch_loss(model, tiny, head, batch, "gumiho", epoch=3, noise=0.2, seed=5,
                             weights=weights, mlp_detach=detach)
        model.zero_grad()
        loss.backward()
        return float(loss.detach()), {k: p.grad.clone() for k, p in params.items()}

    loss, joint = grads(LossWeights(mlp_p=0.1), detach=False)
    detached_loss, detached = grads(LossWeights(mlp_p=0.1), detach=True)
    _, serial_only = grads(LossWeights(mlp_v=0.0, mlp_p=0.0), detach=False)
    assert detached_loss == pytest.approx(loss, rel=1e-6)
    heads = [k for k in params if k.startswith("mlp.")]
    others = [k for k in params if not k.startswith("mlp.")]
    assert heads and {"fc.weight"} <= set(others)
    for k in heads:
        torch.testing.assert_close(detached[k], joint[k])
    for k in others:
        torch.testing.assert_close(detached[k], serial_only[k])
    moved = [k for k in others if not torch.allclose(joint[k], serial_only[k], rtol=1e-3)]
    assert "fc.weight" in moved and any(k.startswith("layers.") for k in moved)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_heads_only_trains_the_mlp_heads_and_nothing_else(tiny_target_dir, tiny_data_dir,
                                                          tmp_path, precision):
    """--heads-only from a checkpoint: every weight but the MLP heads' is saved bit for bit
    as it started (the serial layers, fc), the heads train (on the same data they move as
    in a whole run), and the serial step's losses stay out of the gradient. In bf16 too,
    where the warm start once read the checkpoint in the bf16 target's dtype and rounded
    every weight before the first step."""
    data = (tiny_target_dir, tiny_data_dir)
    assert main(train_args(data, tmp_path / "first", "--export-dtype", "float32")) == 0
    first = load_file(str(tmp_path / "first" / "model.safetensors"))
    common = ("--export-dtype", "float32", "--init-from", str(tmp_path / "first"),
              "--mlp-ploss-after-epochs", "0", "--precision", precision)
    assert main(train_args(data, tmp_path / "heads", *common, "--heads-only")) == 0
    assert main(train_args(data, tmp_path / "whole", *common)) == 0
    heads, whole = (load_file(str(tmp_path / n / "model.safetensors")) for n in ("heads", "whole"))
    mlp = [k for k in first if k.startswith("mlp.")]
    assert mlp and heads.keys() == first.keys()
    for key in first:
        if key not in mlp:
            assert torch.equal(heads[key], first[key]), key
    assert any(not torch.equal(heads[k], first[k]) for k in mlp)
    assert any(not torch.equal(whole[k], first[k]) for k in first if k not in mlp)
    log = [json.loads(line) for line in (tmp_path / "heads" / "train_log.jsonl").open()]
    assert all("acc_mlp1" in row for row in log if "loss" in row)


def test_heads_only_loss_has_no_serial_gradient(tiny, tiny_data_dir):
    """The heads-only loss is the heads' part of the whole loss: the same MLP gradients as
    a whole pass whose serial losses are weighted 0, and no gradient on anything else."""
    _, samples = load_samples(tiny_data_dir)
    batch = collate(samples[:4])
    config = TrainConfig(method="gumiho", online=True, heads_only=True)
    model = new_model(tiny, config, seed=0)
    head = DraftHead.for_model(tiny, model)
    trained = {k for k, p in model.named_parameters() if p.requires_grad}
    assert trained and all(k.startswith("mlp.") for k in trained)
    loss, logs = batch_loss(model, tiny, head, batch, "gumiho", epoch=3, noise=0.2, seed=5,
                            weights=LossWeights(mlp_p=0.1, heads_only=True))
    loss.backward()
    got = {k: p.grad.clone() for k, p in model.named_parameters() if p.requires_grad}
    assert logs["ploss"] == 0.0 and logs["vloss"] > 0
    model.zero_grad()
    model.requires_grad_(True)
    model.embed_tokens.weight.requires_grad_(False)
    loss, _ = batch_loss(model, tiny, head, batch, "gumiho", epoch=3, noise=0.2, seed=5,
                         weights=LossWeights(v=0.0, p=0.0, mlp_p=0.1), mlp_detach=True)
    loss.backward()
    for key, grad in got.items():
        torch.testing.assert_close(grad, dict(model.named_parameters())[key].grad)


@pytest.mark.parametrize("method", ["eagle2", "medusa"])
def test_heads_only_is_refused_without_mlp_heads(method):
    with pytest.raises(GumihoError, match="--heads-only"):
        TrainConfig(method=method, online=True, heads_only=True)
    with pytest.raises(GumihoError, match="--serial2-weight"):
        TrainConfig(method="gumiho", online=True, heads_only=True, serial2_weight=1.0)


def test_serial_step_2_joins_the_loss_when_weighted(tiny, tiny_data_dir):
    """--serial2-weight w adds w x (vloss + 0.1 ploss) of serial step 2 (run on step 1's own
    output) to the reference loss, and its gradient; step 2's accuracy is the one logged
    without it. At 0 the loss is the reference's."""
    _, samples = load_samples(tiny_data_dir)
    batch = collate(samples[:4])
    model = new_model(tiny, TrainConfig(method="gumiho", online=True), seed=0)
    head = DraftHead.for_model(tiny, model)

    def run(serial2: float):
        loss, logs = batch_loss(model, tiny, head, batch, "gumiho", epoch=3, noise=0.2,
                                seed=5, weights=LossWeights(serial2=serial2))
        model.zero_grad()
        loss.backward()
        return loss.detach(), logs, model.layers[0].self_attn.q_proj.weight.grad.clone()

    reference, ref_logs, ref_grad = run(0.0)
    assert "vloss2" not in ref_logs
    torch.testing.assert_close(run(0.0)[0], reference, rtol=0, atol=0)
    weighted, logs, grad = run(0.5)
    assert logs["vloss2"] > 0 and logs["ploss2"] > 0
    assert logs["acc_serial2"] == ref_logs["acc_serial2"]
    expected = reference + 0.5 * (logs["vloss2"] + 0.1 * logs["ploss2"])
    torch.testing.assert_close(weighted, expected, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(grad, ref_grad, rtol=1e-4)


def test_ploss_weight_reaches_the_loss(tiny_target_dir, tiny_data_dir, tmp_path):
    """--ploss-weight 0 leaves the serial step's ploss out of the gradient: which positions
    its ploss would score (--ploss-fraction) no longer matters; at the reference weight it
    does. EAGLE-2, so no MLP heads' terms come in."""
    data = (tiny_target_dir, tiny_data_dir)

    def trained(name, *flags):
        args = train_args(data, tmp_path / name, "--export-dtype", "float32", *flags)
        args[args.index("--method") + 1] = "eagle2"
        assert main(args) == 0
        return load_file(str(tmp_path / name / "model.safetensors"))

    zero_half = trained("zero_half", "--ploss-weight", "0")
    zero_all = trained("zero_all", "--ploss-weight", "0", "--ploss-fraction", "1.0")
    half, whole = trained("half"), trained("all", "--ploss-fraction", "1.0")
    assert all(torch.equal(zero_half[k], zero_all[k]) for k in zero_all)
    assert any(not torch.equal(half[k], whole[k]) for k in whole)
    saved = json.loads((tmp_path / "zero_half" / "config.json").read_text())
    assert saved["training"]["ploss_weight"] == 0


def test_a_run_saved_before_a_flag_existed_resumes(tiny_target_dir, tiny_data_dir, tmp_path):
    """A saved run whose settings lack a newer flag resumes when the flag keeps its
    default (and is refused when it does not)."""
    data = (tiny_target_dir, tiny_data_dir)
    assert main(train_args(data, tmp_path, "--stop-after-steps", "1")) == 0
    progress = tmp_path / "state" / "progress.json"
    saved = json.loads(progress.read_text())
    del saved["settings"]["mlp_ploss_after_epochs"]
    progress.write_text(json.dumps(saved))
    assert main(train_args(data, tmp_path, "--mlp-ploss-after-epochs", "1")) == 2
    assert main(train_args(data, tmp_path)) == 0
    assert json.loads(progress.read_text())["progress"]["step"] == 4


def train_args(data, out, *extra):
    return ["--target", data[0], "--data", data[1], "--method", "gumiho", "--output-dir",
            str(out), "--max-steps", "4", "--batch-size", "2", "--grad-accum", "2",
            "--warmup-steps", "2", "--log-every", "1", "--ploss-fraction", "0.5", *extra]


@pytest.mark.parametrize("flags", [(), ("--heads-only",)], ids=["whole", "heads_only"])
def test_resume_reproduces_an_uninterrupted_run(tiny_target_dir, tiny_data_dir, tmp_path,
                                                flags):
    data = (tiny_target_dir, tiny_data_dir)
    assert main(train_args(data, tmp_path / "whole", *flags)) == 0
    assert main(train_args(data, tmp_path / "split", "--stop-after-steps", "2", *flags)) == 0
    halfway = load_file(str(tmp_path / "split" / "model.safetensors"))
    assert main(train_args(data, tmp_path / "split", *flags)) == 0  # the same command resumes
    whole = load_file(str(tmp_path / "whole" / "model.safetensors"))
    split = load_file(str(tmp_path / "split" / "model.safetensors"))
    assert whole.keys() == split.keys() and "embed_tokens.weight" not in whole
    assert any(not torch.equal(halfway[k], split[k]) for k in whole)  # it did train on
    for key in whole:
        torch.testing.assert_close(split[key], whole[key], atol=0, rtol=0)


def test_a_finished_run_run_again_keeps_its_summary_and_weights(tiny_target_dir,
                                                                tiny_data_dir, tmp_path,
                                                                capsys):
    """The same command after the run finished: nothing to do, and its summary (the
    run's time and tokens/s) is not overwritten by an empty one."""
    data = (tiny_target_dir, tiny_data_dir)
    assert main(train_args(data, tmp_path)) == 0
    summary = (tmp_path / "train_summary.json").read_text()
    weights = (tmp_path / "model.safetensors").stat().st_mtime_ns
    capsys.readouterr()
    assert main(train_args(data, tmp_path)) == 0
    assert "already trained to step 4 of 4; nothing to do" in capsys.readouterr().out
    assert (tmp_path / "train_summary.json").read_text() == summary
    assert (tmp_path / "model.safetensors").stat().st_mtime_ns == weights


def test_log_every_leaves_the_trained_weights_alone(tiny_target_dir, tiny_data_dir, tmp_path):
    """Terms that are only logged (serial step 2's accuracy, the MLP heads before their
    ploss) run on logging steps alone: their ploss sample must not shift the others'."""
    data = (tiny_target_dir, tiny_data_dir)
    for every in ("1", "100"):
        assert main(train_args(data, tmp_path / every, "--mlp-ploss-after-epochs", "1",
                               "--log-every", every)) == 0
    often, rarely = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("1", "100"))
    for key in often:
        torch.testing.assert_close(often[key], rarely[key], atol=0, rtol=0)


class Killed(BaseException):
    """A kill at a chosen moment (raised past the trainer's handlers)."""


def kill_at(monkeypatch, name: str, call: int):
    """Make trainer.`name` die on its `call`-th call."""
    real, calls = getattr(trainer, name), []

    def dying(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            raise Killed
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer, name, dying)


def test_a_kill_while_exporting_loses_nothing(tiny_target_dir, tiny_data_dir, tmp_path,
                                              monkeypatch):
    """A kill inside the last export (after the state once was saved first, so a rerun
    found a finished run without weights or summary): the rerun ends the run, its weights
    an uninterrupted run's, its summary written; the epoch's checkpoint is there too."""
    data = (tiny_target_dir, tiny_data_dir)
    assert main(train_args(data, tmp_path / "whole")) == 0
    for call in (1, 2):  # the epoch's export (step 3), the last one (step 4)
        out = tmp_path / f"cut{call}"
        with monkeypatch.context() as patch:
            kill_at(patch, "save_drafter", call)
            with pytest.raises(Killed):
                main(train_args(data, out))
        assert main(train_args(data, out)) == 0
        whole = load_file(str(tmp_path / "whole" / "model.safetensors"))
        cut = load_file(str(out / "model.safetensors"))
        for key in whole:
            torch.testing.assert_close(cut[key], whole[key], atol=0, rtol=0)
        assert (out / "train_summary.json").is_file()
        assert (out / "checkpoint-epoch1" / "model.safetensors").is_file()


def test_steps_logged_before_the_first_save_are_logged_once(tiny_target_dir, tiny_data_dir,
                                                            tmp_path, monkeypatch):
    data = (tiny_target_dir, tiny_data_dir)
    with monkeypatch.context() as patch:
        kill_at(patch, "save_run_state", 1)  # at the epoch's end, step 3
        with pytest.raises(Killed):
            main(train_args(data, tmp_path))
    assert main(train_args(data, tmp_path)) == 0
    steps = [json.loads(line)["step"] for line in (tmp_path / "train_log.jsonl").open()]
    assert steps == [1, 2, 3, 4]


@pytest.mark.parametrize("damage", ["optimizer.bin", "model.safetensors", "scheduler.pt",
                                    "progress.json"])
def test_a_damaged_saved_state_is_one_line(tiny_target_dir, tiny_data_dir, tmp_path, capsys,
                                           damage):
    data = (tiny_target_dir, tiny_data_dir)
    assert main(train_args(data, tmp_path, "--stop-after-steps", "1", "--save-every",
                           "1")) == 0
    path = tmp_path / "state" / damage
    with path.open("r+b") as f:
        f.truncate(max(path.stat().st_size // 2, 1))
    capsys.readouterr()
    assert main(train_args(data, tmp_path)) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "is damaged" in err[-1], err
    assert "internal error" not in err[-1]


def test_medusa_with_a_ploss_sample_logs_what_it_has(tiny_target_dir, tiny_data_dir,
                                                     tmp_path):
    """A micro-batch whose sample leaves a head no position logs no accuracy for it: the
    step's mean is over the micro-batches that have one (was a KeyError)."""
    data = (tiny_target_dir, tiny_data_dir)
    args = train_args(data, tmp_path, "--ploss-fraction", "0.01")
    args[args.index("--method") + 1] = "medusa"
    assert main(args) == 0
    rows = [json.loads(line) for line in (tmp_path / "train_log.jsonl").open()]
    assert len(rows) == 4 and all("loss" in r for r in rows)
    # some steps' samples held no position for a head: it is missing there, not zero
    assert any("acc_medusa1" not in r for r in rows) and any("acc_medusa1" in r for r in rows)


@pytest.mark.parametrize("method, flags, says", [
    ("gumiho", ["--max-len", "16"], "--max-len: it is for --online"),
    ("gumiho", ["--template", "vicuna"], "--template: it is for --online"),
    ("eagle2", ["--mlp-detach"], "--mlp-detach: eagle2 drafters do not use it"),
    ("eagle2", ["--mlp-ploss-weight", "5"], "--mlp-ploss-weight"),
    ("medusa", ["--noise", "0.5"], "--noise: medusa drafters do not use it"),
    ("gumiho", ["--eval-every", "2"], "--eval-data"),
])
def test_flags_that_would_do_nothing_are_refused(tiny_target_dir, tiny_data_dir, tmp_path,
                                                 capsys, method, flags, says):
    args = train_args((tiny_target_dir, tiny_data_dir), tmp_path / "run", *flags,
                      "--dry-run")
    args[args.index("--method") + 1] = method
    assert main(args) == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_the_logged_learning_rate_is_the_one_each_step_used(tiny_target_dir, tiny_data_dir,
                                                            tmp_path):
    data = (tiny_target_dir, tiny_data_dir)
    assert main(train_args(data, tmp_path, "--lr", "1e-3")) == 0  # warm-up 2, 4 steps
    lrs = [json.loads(line)["lr"] for line in (tmp_path / "train_log.jsonl").open()]
    assert lrs == pytest.approx([5e-4, 1e-3, 1e-3, 5e-4])


def test_reading_data_leaves_a_shard_being_written_alone(tiny_data_dir, tmp_path):
    """Training reads a data dir while its allocation may still write a shard there: the
    reader names the missing shard and touches no temp file (the allocation's own)."""
    data = tmp_path / "data"
    shutil.copytree(tiny_data_dir, data)
    (data / "shard_00001.pt").rename(data / "shard_00001.pt.tmp")
    with pytest.raises(GumihoError, match="1 shards missing"):
        load_samples(data)
    assert (data / "shard_00001.pt.tmp").is_file()


@pytest.mark.host  # the CPU's bf16 autocast; on a GPU bf16 is the default path anyway
def test_bf16_precision_trains_resumes_exactly_and_decodes_like_plain(
        tiny, tiny_target_dir, tiny_data_dir, tmp_path):
    data = (tiny_target_dir, tiny_data_dir)
    # a small draft vocabulary: bf16 products are slow on some CPUs (26x float32's on an
    # AVX2 EPYC), and the head over the whole vocabulary was most of them
    small = ("--draft-vocab", "512")
    bf16 = (*small, "--precision", "bf16", "--eval-data", tiny_data_dir, "--eval-every", "2")
    assert main(train_args(data, tmp_path / "fp32", *small)) == 0
    assert main(train_args(data, tmp_path / "whole", *bf16)) == 0
    assert main(train_args(data, tmp_path / "split", *bf16, "--stop-after-steps", "2")) == 0
    assert main(train_args(data, tmp_path / "split", *bf16)) == 0
    fp32, whole, split = (load_file(str(tmp_path / d / "model.safetensors"))
                          for d in ("fp32", "whole", "split"))
    for key in whole:
        torch.testing.assert_close(split[key], whole[key], atol=0, rtol=0)
    # autocast really ran: the same steps in fp32 end elsewhere, but close by
    assert any(not torch.equal(fp32[k], whole[k]) for k in whole)
    log = [json.loads(line) for line in (tmp_path / "whole" / "train_log.jsonl").open()]
    losses = [r["vloss"] for r in log if "vloss" in r]
    assert len(losses) == 4 and all(v == v and v < 10 for v in losses)  # finite
    prompt = tiny.chat_ids("Tell me about the sea.")
    config = GenerateConfig(max_new_tokens=24)
    plain = run(tiny, PlainDrafter(), prompt, config)
    drafter = load_drafter("gumiho", tiny, str(tmp_path / "whole"),
                           tree=TreeConfig(total_tokens=32))
    assert run(tiny, drafter, prompt, config).token_ids == plain.token_ids


@pytest.mark.host  # a machine without a GPU, simulated
def test_bf16_on_a_cpu_with_slow_bf16_products_is_refused(tiny_target_dir, tiny_data_dir,
                                                           tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(accel, "bf16_slowdown", lambda: 12.0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = train_args((tiny_target_dir, tiny_data_dir), tmp_path / "run", "--precision", "bf16")
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --precision bf16: ")
    assert "12x slower" in err[0] and "--precision fp32" in err[0]
    assert not (tmp_path / "run" / "model.safetensors").exists()


@pytest.mark.parametrize("asked", [None, "bf16"])
def test_precision_follows_the_device_training_runs_on(monkeypatch, asked):
    """GUMIHO_DEVICE=cpu on a GPU machine trains on the CPU: the default precision is the
    CPU's (fp32), and bf16 there meets the slow-CPU check (it was bf16 by default wherever a
    GPU existed, which the fifth lease's suite caught)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("GUMIHO_DEVICE", "cpu")
    monkeypatch.setattr(accel, "bf16_slowdown", lambda: 12.0)
    config = TrainConfig(method="gumiho", online=True, precision=asked)
    if asked is None:
        assert accel.precision(config) == ("no", "float32")
    else:
        with pytest.raises(GumihoError, match="12x slower"):
            accel.precision(config)


@pytest.mark.host
def test_training_on_the_cpu_after_a_gpu_state_in_the_same_process():
    """A GPU session's test suite ran a CPU-only training test in a worker whose accelerate
    state was already on the GPU: accelerate refused cpu=True. The state moves now (faked
    here: the CPU machine's state is relabelled as a GPU one); another precision too."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState

    try:
        Accelerator(cpu=True)
        PartialState._shared_state["device"] = torch.device("cuda")
        with pytest.raises(ValueError, match="cpu=True"):  # what accelerate alone does
            Accelerator(cpu=True)
        accel.fresh_accelerator_state("no", on_cpu=True)
        assert Accelerator(cpu=True).device.type == "cpu"
        with pytest.raises(ValueError, match="mixed_precision"):
            Accelerator(cpu=True, mixed_precision="bf16")
        accel.fresh_accelerator_state("bf16", on_cpu=True)
        assert Accelerator(cpu=True, mixed_precision="bf16").mixed_precision == "bf16"
    finally:  # the next test starts from no state at all
        AcceleratorState._reset_state(reset_partial_state=True)


def test_bf16_slowdown_is_a_measured_ratio():
    ratio = bf16_slowdown(rows=16, width=32, out=48)
    assert 0 < ratio < float("inf")


def test_trained_checkpoint_decodes_like_plain(tiny, tiny_target_dir, tiny_data_dir,
                                               tmp_path):
    assert main(train_args((tiny_target_dir, tiny_data_dir), tmp_path)) == 0
    prompt = tiny.chat_ids("Tell me about the sea.")
    config = GenerateConfig(max_new_tokens=24)
    plain = run(tiny, PlainDrafter(), prompt, config)
    for fta in ("off", "exact"):
        drafter = load_drafter("gumiho", tiny, str(tmp_path), tree=TreeConfig(fta=fta,
                               total_tokens=32))
        assert run(tiny, drafter, prompt, config).token_ids == plain.token_ids


def test_teacher_forced_pass_matches_inference(tiny):
    model = new_model(tiny, TrainConfig(online=True), seed=1).eval()
    with torch.no_grad():  # non-trivial residual blocks
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    ids = torch.tensor([[5, 900, 31, 77, 4000, 12, 8, 640]])
    features = tiny.features(ids)
    with torch.no_grad():
        train_out = model(ids, features, torch.ones_like(ids, dtype=torch.bool))
    drafter = SerialDrafter(model, TreeConfig(top_k=3))
    p = 5  # the drafter has seen pairs 0..p-1; pair p-1 = (f_{p-1}, x_p)
    cache = KVCache.for_model(tiny.model, 32)
    prefill(tiny, cache, ids[:, :p])
    drafter.begin(tiny, 32)
    drafter.observe(features[0, :p], ids[0, 1 : p + 1])
    _, out1, _, _ = drafter._catch_up()
    torch.testing.assert_close(out1, train_out["out1"][0, p - 1], atol=1e-5, rtol=1e-4)
    out2 = drafter._serial_level(ids[0, p + 1 : p + 2], out1[None],
                                 torch.zeros(1, 0, dtype=torch.bool))[0][0]
    torch.testing.assert_close(out2, train_out["out2"][0, p - 1], atol=1e-5, rtol=1e-4)


def test_reduced_vocabulary_training_decodes_like_plain(tiny, tiny_target_dir, tiny_data_dir,
                                                         tmp_path):
    args = train_args((tiny_target_dir, tiny_data_dir), tmp_path, "--draft-vocab", "300")
    assert main(args) == 0
    state = load_file(str(tmp_path / "model.safetensors"))
    assert state["d2t"].shape == (300,) and int(state["t2d"].sum()) == 300
    logged = [json.loads(line) for line in (tmp_path / "train_log.jsonl").open()]
    assert all(0 <= row["acc_serial1"] <= 1 for row in logged)
    # the gradient's norm before clipping, on every logged step
    assert all(0 < row["grad_norm"] < float("inf") for row in logged)
    prompt = tiny.chat_ids("Tell me about the sea.")
    config = GenerateConfig(max_new_tokens=24)
    drafter = load_drafter("gumiho", tiny, str(tmp_path), tree=TreeConfig(total_tokens=32))
    assert run(tiny, drafter, prompt, config).token_ids == \
        run(tiny, PlainDrafter(), prompt, config).token_ids


def test_a_kill_inside_the_save_resumes_exactly(tiny_target_dir, tiny_data_dir, tmp_path,
                                                 monkeypatch):
    from pathlib import Path

    data = (tiny_target_dir, tiny_data_dir)
    assert main(train_args(data, tmp_path / "whole")) == 0
    assert main(train_args(data, tmp_path / "cut", "--stop-after-steps", "2")) == 0
    # the next save dies between its two renames: state is gone, state.old remains
    real_rename = Path.rename
    calls = []

    def dying_rename(self, target):
        calls.append(self.name)
        if self.name == "state.tmp":
            raise KeyboardInterrupt
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", dying_rename)
    assert main(train_args(data, tmp_path / "cut", "--stop-after-steps", "3")) == 130  # Ctrl-C
    monkeypatch.undo()
    assert not (tmp_path / "cut" / "state").exists() and calls == ["state", "state.tmp"]
    assert main(train_args(data, tmp_path / "cut")) == 0  # resumes from state.old (step 2)
    whole = load_file(str(tmp_path / "whole" / "model.safetensors"))
    cut = load_file(str(tmp_path / "cut" / "model.safetensors"))
    for key in whole:
        torch.testing.assert_close(cut[key], whole[key], atol=0, rtol=0)


def test_periodic_saves_resume_mid_epoch_exactly(tiny_target_dir, tiny_data_dir, tmp_path,
                                                  monkeypatch):
    data = (tiny_target_dir, tiny_data_dir)
    assert main(train_args(data, tmp_path / "whole")) == 0
    real_save, saves = trainer.save, []

    def save_then_die(*args):  # saves: step 1 (mid-epoch), 2 (epoch end), 3 (mid-epoch)
        if len(saves) == 3:
            raise KeyboardInterrupt  # killed at step 4, before its save
        saves.append(args[3].step)
        return real_save(*args)

    monkeypatch.setattr(trainer, "save", save_then_die)
    assert main(train_args(data, tmp_path / "cut", "--save-every", "1")) == 130
    monkeypatch.undo()
    assert saves == [1, 2, 3]
    # step 4's log row was written before its save died; half a row after it
    with (tmp_path / "cut" / "train_log.jsonl").open("a") as f:
        f.write('{"step": 4, "epoch"')
    assert main(train_args(data, tmp_path / "cut", "--save-every", "1")) == 0  # from step 3
    whole = load_file(str(tmp_path / "whole" / "model.safetensors"))
    cut = load_file(str(tmp_path / "cut" / "model.safetensors"))
    for key in whole:
        torch.testing.assert_close(cut[key], whole[key], atol=0, rtol=0)
    # the log reads as one run: each step once, the same figures (wall-clock rates aside)
    logs = [[{k: v for k, v in json.loads(line).items() if k != "tokens_per_s"}
             for line in (tmp_path / run / "train_log.jsonl").read_text().splitlines()]
            for run in ("whole", "cut")]
    assert [row["step"] for row in logs[1]] == [1, 2, 3, 4] and logs[1] == logs[0]


@pytest.mark.parametrize("change, named", [(["--lr", "0.5"], "lr"),
                                           (["--method", "eagle2"], "method"),
                                           (["--batch-size", "1"], "batch_size"),
                                           (["--precision", "bf16"], "precision"),
                                           (["--mlp-ploss-after-epochs", "0"],
                                            "mlp_ploss_after_epochs"),
                                           (["--mlp-detach"], "mlp_detach"),
                                           (["--heads-only"], "heads_only"),
                                           (["--serial2-weight", "0.5"], "serial2_weight")])
def test_resume_with_other_settings_is_refused(tiny_target_dir, tiny_data_dir, tmp_path,
                                               capsys, change, named):
    data = (tiny_target_dir, tiny_data_dir)
    assert main(train_args(data, tmp_path, "--stop-after-steps", "1")) == 0
    before = (tmp_path / "model.safetensors").read_bytes()
    capsys.readouterr()
    args = train_args(data, tmp_path)
    flag = args.index(change[0]) if change[0] in args else None
    if flag is not None:
        args[flag : flag + 2] = change
    else:
        args += change
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and f"{named}=" in err[0]
    assert (tmp_path / "model.safetensors").read_bytes() == before


@pytest.mark.parametrize("bad", [["--max-steps", "0"], ["--max-steps", "-1"],
                                 ["--batch-size", "0"], ["--grad-accum", "0"],
                                 ["--ploss-fraction", "0"], ["--stop-after-steps", "0"],
                                 ["--mlp-ploss-after-epochs", "-1"],
                                 ["--mlp-ploss-weight", "-0.1"],
                                 ["--ploss-weight", "-1"], ["--serial2-weight", "-1"]])
def test_bad_training_settings_are_one_line(tiny_target_dir, tiny_data_dir, tmp_path, capsys,
                                            bad):
    args = train_args((tiny_target_dir, tiny_data_dir), tmp_path)
    if bad[0] in args:
        i = args.index(bad[0])
        args[i : i + 2] = bad
    else:
        args += bad
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and bad[0] in err[0]
    assert not (tmp_path / "model.safetensors").exists()


@pytest.mark.parametrize("method", ["eagle2", "medusa"])
def test_serial2_weight_is_refused_without_a_serial_step_2(method):
    """Only Gumiho's training pass runs serial step 2; elsewhere the flag would do nothing."""
    with pytest.raises(GumihoError, match="--serial2-weight"):
        TrainConfig(method=method, online=True, serial2_weight=1.0)
    assert TrainConfig(method="gumiho", online=True, serial2_weight=1.0).serial2_weight == 1.0


def test_eval_every_logs_curves_that_plot(tiny_target_dir, tiny_data_dir, tmp_path):
    from gumiho.train import plot

    args = train_args((tiny_target_dir, tiny_data_dir), tmp_path / "run", "--eval-data",
                      tiny_data_dir, "--eval-every", "2")
    assert main(args) == 0
    rows = plot.eval_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [2, 4]
    assert {"acc_serial1", "acc_serial2", "acc_mlp1"} <= set(rows[0]["eval"])
    assert plot.main([str(tmp_path / "run"), "--out", str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").stat().st_size > 1000


@pytest.mark.host
def test_chained_runs_plot_as_one_curve(tmp_path):
    """`--chain`: runs that continued one another (`--init-from`) on one axis, each run's
    steps after the last step the one before it logged; a log file works as a run."""
    from gumiho.train import plot

    def log(path: Path, last: int, evals: dict[int, float]) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        rows = [{"step": s, "loss": 1.0} for s in range(1, last + 1)]
        rows += [{"step": s, "eval": {"acc_serial1": a, "acc_serial2": a / 2}}
                 for s, a in evals.items()]
        path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
        return path

    first = log(tmp_path / "stage1" / "train_log.jsonl", 10, {5: 0.1, 10: 0.2}).parent
    second = log(tmp_path / "pass2.jsonl", 7, {})  # no evaluation: only its steps count
    third = log(tmp_path / "pass3.jsonl", 4, {2: 0.3, 4: 0.35})
    chain = plot.chained([first, second, third])
    assert [(c.name, c.offset) for c in chain] == [("stage1", 0), ("pass2", 10), ("pass3", 17)]
    assert [s for c in chain for s in c.steps] == [5, 10, 19, 21]
    assert chain[2].series["serial1"] == [0.3, 0.35]
    out = tmp_path / "chain.png"
    assert plot.main([str(first), str(second), str(third), "--chain", "--out", str(out),
                      "--names", "CPU,GPU 1,GPU 2"]) == 0
    assert out.stat().st_size > 1000
    assert [c.name for c in plot.chained([first, second], ["a", "b"])] == ["a", "b"]
    with pytest.raises(GumihoError, match="2 names for 3 runs"):
        plot.chained([first, second, third], ["a", "b"])
    with pytest.raises(GumihoError, match="no evaluation rows"):
        plot.eval_rows(second)  # alone, a run without evaluations is still an error


@pytest.mark.host
def test_a_log_cut_off_mid_line_is_named(tmp_path):
    """A training log whose last line was cut off (a killed run) is refused in one line
    naming it, not read as a bug."""
    from gumiho.train import plot

    (tmp_path / "train_log.jsonl").write_text('{"step": 5, "acc_mlp1": 0.4}\n{"step": 10, "ac')
    with pytest.raises(GumihoError, match="line 2 is not JSON"):
        plot.log_rows(tmp_path)


def test_accuracy_tool_matches_trainings_evaluation(tiny_target_dir, tiny_data_dir, tmp_path,
                                                    capsys):
    from gumiho.train import accuracy

    data = (tiny_target_dir, tiny_data_dir)
    assert main(train_args(data, tmp_path, "--eval-data", tiny_data_dir,
                           "--export-dtype", "float32")) == 0
    logged = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["held_out_accuracy"]
    assert accuracy.main(["--draft", str(tmp_path), "--data", tiny_data_dir,
                          "--target", tiny_target_dir, "--batch-size", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["samples"] > 0
    assert report["measure"] == "mean over batches of 2 samples, token-weighted within each"
    for key, value in logged.items():
        assert report[key] == pytest.approx(value, abs=1e-3)


def test_accuracy_tool_refuses_another_targets_data(tiny_target_dir, tiny_data_dir, tmp_path,
                                                    capsys):
    """Data made for a target of another width is one line, as training says it (the tool
    had raised IndexError from inside the drafter)."""
    import shutil

    from gumiho.train import accuracy

    other = tmp_path / "other_width"
    shutil.copytree(tiny_data_dir, other)
    manifest = json.loads((other / "manifest.json").read_text())
    (other / "manifest.json").write_text(json.dumps({**manifest, "hidden_size": 640}))
    assert accuracy.main(["--draft", "random", "--method", "gumiho", "--data", str(other),
                          "--target", tiny_target_dir]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        f"error: {other} holds features of width 640, but the target has")


def test_the_dry_run_refuses_what_the_run_would(tiny_target_dir, tiny_data_dir, tmp_path,
                                               capsys):
    """--dry-run (scripts/train.sh's first step) reads the target's config, so data of
    another width and a --draft-vocab past the vocabulary stop there, not after loading."""
    import shutil

    other = tmp_path / "other_width"
    shutil.copytree(tiny_data_dir, other)
    manifest = json.loads((other / "manifest.json").read_text())
    (other / "manifest.json").write_text(json.dumps({**manifest, "hidden_size": 640}))
    common = ["--target", tiny_target_dir, "--output-dir", str(tmp_path / "run"), "--dry-run"]
    assert main([*common, "--data", str(other)]) == 2
    assert "holds features of width 640, but the target has" in capsys.readouterr().err
    vocab = json.loads((Path(tiny_target_dir) / "config.json").read_text())["vocab_size"]
    assert main([*common, "--online", "--draft-vocab", str(vocab + 1)]) == 2
    assert f"--draft-vocab {vocab + 1} is larger than the target's vocabulary ({vocab}" in \
        capsys.readouterr().err
    assert main([*common, "--data", tiny_data_dir, "--draft-vocab", str(vocab)]) == 0
    assert capsys.readouterr().out.startswith("ok: gumiho drafter")


def test_the_dry_run_reads_an_init_checkpoints_method_and_completeness(tmp_path, capsys):
    """--init-from of another method, or with its weights cut short, stops at the dry run
    (each read from the config and the safetensors header, not the weights)."""
    import os
    import shutil

    shipped = Path(__file__).parents[1] / "gumiho" / "assets" / "smollm2"
    cut = tmp_path / "cut"
    shutil.copytree(shipped / "gumiho", cut)
    os.truncate(cut / "model.safetensors", (cut / "model.safetensors").stat().st_size // 2)
    common = ["--online", "--output-dir", str(tmp_path / "run"), "--dry-run", "--init-from"]
    assert main([*common, str(shipped / "eagle2")]) == 2
    assert capsys.readouterr().err.strip() == "error: checkpoint is a eagle2 drafter, not gumiho"
    assert main([*common, str(cut)]) == 2
    assert "model.safetensors: SafetensorError (is it complete?)" in capsys.readouterr().err
    assert main([*common, str(shipped / "gumiho")]) == 0


def test_accuracy_tool_compares_two_drafters_sample_by_sample(smollm2, tmp_path, capsys):
    """--against: each drafter's mean over samples, and per position the mean of the
    per-sample differences with its 95% interval. The shipped Gumiho against itself differs
    by exactly 0; against a copy whose fusion layer is zeroed it is ahead at every serial
    position, beyond the interval; against a drafter of another method, one error line."""
    import shutil

    from safetensors.torch import save_file

    from gumiho.ge_data import allocation
    from gumiho.train import accuracy

    data = tmp_path / "data"
    assert allocation.main(["--outdir", str(data), "--split", "held_out", "--end", "6",
                            "--shard-size", "6", "--max-len", "160"]) == 0
    assets = Path("gumiho/assets/smollm2")
    shipped = assets / "gumiho"
    broken = tmp_path / "broken"
    shutil.copytree(shipped, broken)
    weights = load_file(str(broken / "model.safetensors"))
    weights["fc.weight"] = torch.zeros_like(weights["fc.weight"])
    save_file(weights, str(broken / "model.safetensors"))
    capsys.readouterr()

    def compare(first, second):
        code = accuracy.main(["--draft", str(first), "--against", str(second),
                              "--data", str(data)])
        out, err = capsys.readouterr()
        return code, (json.loads(out) if code == 0 else err.strip().splitlines())

    _, same = compare(shipped, shipped)
    assert same["measure"] == "mean over samples"  # not the plain report's batch mean
    assert same["draft_acc"] == same["against_acc"] and same["draft_acc"]["acc_serial1"] > 0.3
    assert all(v == [0.0, 0.0, 0.0] for v in same["difference"].values())
    _, report = compare(shipped, broken)
    for key, (mean, low, high) in report["difference"].items():
        assert low <= mean <= high
        assert mean == pytest.approx(report["draft_acc"][key] - report["against_acc"][key],
                                     abs=2e-4)
    assert all(report["difference"][k][1] > 0 for k in ("acc_serial1", "acc_serial2"))
    code, err = compare(shipped, assets / "eagle2")
    assert code == 2 and len(err) == 1 and err[0].startswith("error:") and "eagle2" in err[0]


def test_paired_difference_is_the_mean_and_a_normal_interval():
    from gumiho.train.accuracy import paired_difference

    first = [{"acc_x": 1.0, "acc_y": 0.5}, {"acc_x": 0.5}, {"acc_x": 0.0, "acc_y": 0.5}]
    second = [{"acc_x": 0.5, "acc_y": 0.5}, {"acc_x": 0.5}, {"acc_x": 0.5, "acc_y": 0.25}]
    half = round(1.96 * 0.5 / 3 ** 0.5, 4)  # differences 0.5, 0, -0.5: sd 0.5
    found = paired_difference(first, second)
    assert found["acc_x"] == [0.0, -half, half]
    assert found["acc_y"] == [0.125, round(0.125 - 1.96 * 0.125 * 2 ** 0.5 / 2 ** 0.5, 4),
                              round(0.125 + 1.96 * 0.125 * 2 ** 0.5 / 2 ** 0.5, 4)]


def test_online_training_takes_a_template_for_a_base_model(smollm2, tmp_path):
    """A tokenizer without a chat template (a base model) is refused with a pointer to
    --template; with --template the online samples mask the assistant turns."""
    import copy
    from dataclasses import replace

    from gumiho.errors import GumihoError
    from gumiho.train.__main__ import build_parser, train_config
    from gumiho.train.dataset import online_samples

    tokenizer = copy.deepcopy(smollm2.tokenizer)
    tokenizer.chat_template = None
    base = replace(smollm2, tokenizer=tokenizer, runners={})
    with pytest.raises(GumihoError, match="--template"):
        online_samples(base, "sharegpt", 2, 256)
    samples = online_samples(base, "sharegpt", 2, 256, "vicuna")
    assert samples and all(s["loss_mask"].any() for s in samples)
    args = build_parser().parse_args(["--online", "--output-dir", str(tmp_path),
                                      "--template", "vicuna"])
    assert train_config(args).template == "vicuna"


def test_a_warm_start_begins_at_the_checkpoint_and_keeps_its_vocabulary(
        tiny, tiny_target_dir, tiny_data_dir, tmp_path):
    """--init-from: training starts from the checkpoint's weights (not the seed's fresh
    ones), keeps its draft vocabulary without --draft-vocab, and trains on from there."""
    data = (tiny_target_dir, tiny_data_dir)
    assert main(train_args(data, tmp_path / "first", "--draft-vocab", "300")) == 0
    first = load_file(str(tmp_path / "first" / "model.safetensors"))
    config = TrainConfig(method="gumiho", target=tiny_target_dir, data=(tiny_data_dir,),
                         init_from=str(tmp_path / "first"))
    start = to_official(new_model(tiny, config))
    fresh = to_official(new_model(tiny, TrainConfig(method="gumiho", target=tiny_target_dir,
                                                    data=(tiny_data_dir,))))
    for key, value in first.items():
        torch.testing.assert_close(start[key], value.to(start[key].dtype), atol=0, rtol=0)
    assert any(not torch.equal(start[k], fresh[k]) for k in first if k in fresh
               and start[k].shape == fresh[k].shape)
    assert main(train_args(data, tmp_path / "second", "--init-from",
                           str(tmp_path / "first"))) == 0
    second = load_file(str(tmp_path / "second" / "model.safetensors"))
    assert torch.equal(second["d2t"], first["d2t"]) and torch.equal(second["t2d"], first["t2d"])
    assert any(not torch.equal(second[k], first[k]) for k in first)  # it trained on
    saved = json.loads((tmp_path / "second" / "config.json").read_text())
    assert saved["training"]["init_from"] == str(tmp_path / "first")


def test_a_warm_start_can_take_another_vocabulary(tiny, tiny_target_dir, tiny_data_dir,
                                                  tmp_path):
    """--init-from with another --draft-vocab: the checkpoint's weights, and a vocabulary of
    the new size chosen from the data as a fresh drafter's is (so over the same data a
    larger one holds every token of the smaller), or the whole vocabulary; it trains on."""
    from gumiho.modeling.vocab import draft_ids_of

    data = (tiny_target_dir, tiny_data_dir)
    assert main(train_args(data, tmp_path / "first", "--draft-vocab", "300")) == 0
    first = load_file(str(tmp_path / "first" / "model.safetensors"))
    _, samples = load_samples(tiny_data_dir)
    vocab = tiny.lm_head.weight.shape[0]
    old = set((first["d2t"] + torch.arange(300, device=first["d2t"].device)).tolist())
    for size, want in ((400, 400), (200, 200), (vocab, None)):
        config = TrainConfig(method="gumiho", target=tiny_target_dir, data=(tiny_data_dir,),
                             init_from=str(tmp_path / "first"), draft_vocab=size)
        model = new_model(tiny, config, samples)
        ids = draft_ids_of(model)
        if want is None:
            assert ids is None and model.config.draft_vocab_size == 0
            assert DraftHead.for_model(tiny, model).size == vocab
        else:
            assert ids.shape == (want,) and model.config.draft_vocab_size == want
            new = set(ids.tolist())
            assert new > old if want > 300 else new < old
        start = to_official(model)
        for key, value in first.items():
            if key not in ("d2t", "t2d"):
                torch.testing.assert_close(start[key], value.to(start[key].dtype), atol=0, rtol=0)
    assert main(train_args(data, tmp_path / "second", "--init-from", str(tmp_path / "first"),
                           "--draft-vocab", "400")) == 0
    second = load_file(str(tmp_path / "second" / "model.safetensors"))
    assert second["d2t"].shape == (400,)
    saved = json.loads((tmp_path / "second" / "config.json").read_text())
    assert saved["draft_vocab_size"] == 400


@pytest.mark.parametrize("case", ["missing", "vocab", "method"])
def test_a_bad_warm_start_is_one_line(tiny_target_dir, tiny_data_dir, tmp_path, capsys, case):
    data = (tiny_target_dir, tiny_data_dir)
    source = tmp_path / "first"
    if case != "missing":
        assert main(train_args(data, source, "--draft-vocab", "300")) == 0
        capsys.readouterr()
    extra = {"missing": [], "vocab": ["--draft-vocab", "10000000"],
             "method": ["--method", "medusa"]}[case]
    args = train_args(data, tmp_path / "second", "--init-from", str(source), *extra)
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:")
    assert {"missing": "not a directory", "vocab": "larger than the target's vocabulary",
            "method": "medusa"}[case] in err[0]
    assert not (tmp_path / "second" / "model.safetensors").exists()


def test_accuracy_tool_reads_a_drafter_over_another_vocabulary(
        tiny, tiny_target_dir, tiny_data_dir, tmp_path, capsys, monkeypatch):
    """`--draft-vocab N`: the drafter read over the N most frequent training tokens (0: all
    of them), with the share of held-out target tokens that vocabulary cannot draft."""
    from gumiho.train import accuracy

    monkeypatch.setenv("GUMIHO_CACHE", str(tmp_path / "cache"))
    data = (tiny_target_dir, tiny_data_dir)
    assert main(train_args(data, tmp_path / "d", "--draft-vocab", "300")) == 0
    capsys.readouterr()
    reports = {}
    for size in (None, "2", "0"):
        extra = [] if size is None else ["--draft-vocab", size, "--num-conversations", "12",
                                         "--max-len", "96"]
        assert accuracy.main(["--draft", str(tmp_path / "d"), "--data", tiny_data_dir,
                              "--target", tiny_target_dir, *extra]) == 0
        reports[size] = json.loads(capsys.readouterr().out)
    vocab = tiny.lm_head.weight.shape[0]
    assert [reports[k]["draft_vocab"] for k in (None, "2", "0")] == [300, 2, vocab]
    assert reports["0"]["outside_vocab"] == 0
    assert reports[None]["outside_vocab"] <= reports["2"]["outside_vocab"]
    assert reports["2"]["outside_vocab"] > 0.5  # a stop token and one other


def test_skipped_conversations_continue_the_training_split(smollm2):
    from gumiho.errors import GumihoError
    from gumiho.train.dataset import online_samples

    three = online_samples(smollm2, "sharegpt", 3, 128)
    later = online_samples(smollm2, "sharegpt", 2, 128, skip=1)
    assert [s["input_ids"].tolist() for s in later] == \
        [s["input_ids"].tolist() for s in three[1:]]
    with pytest.raises(GumihoError, match="--skip-conversations"):
        online_samples(smollm2, "sharegpt", 2, 128, skip=10**7)


def test_more_conversations_than_the_split_has_is_said(smollm2, tmp_path, capsys):
    """--num-conversations beyond the split takes what there is and says so (README's
    17671 against a 16,982-conversation training split)."""
    import json

    from gumiho.train.dataset import online_samples

    chat = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello there"}]
    path = tmp_path / "two.json"  # ids "a" and "b": both in the training split
    path.write_text(json.dumps([{"id": i, "conversations": chat} for i in "ab"]))
    samples = online_samples(smollm2, str(path), 5, 64, skip=1, progress=True, cache=False)
    assert len(samples) == 1
    assert (f"note: the training split of {str(path)!r} has 2 conversations: using 1..1 (1, "
            "not --num-conversations 5)") in capsys.readouterr().err


def test_online_samples_are_cached_for_the_same_request_only(smollm2, tmp_path, monkeypatch):
    """A repeated or resumed run reads its tokenised samples back instead of tokenising
    the split again; other arguments, a damaged file or cache=False tokenise anew."""
    from gumiho.train import dataset

    monkeypatch.setenv("GUMIHO_CACHE", str(tmp_path))
    made = dataset.online_samples(smollm2, "sharegpt", 3, 128)
    kept = list((tmp_path / "samples").glob("*.pt"))
    assert len(kept) == 1 and not list((tmp_path / "samples").glob("*.tmp*"))

    real = dataset.tokenize_conversation
    calls = []

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(dataset, "tokenize_conversation", counting)
    again = dataset.online_samples(smollm2, "sharegpt", 3, 128)
    assert calls == []
    assert [(s["input_ids"].tolist(), s["loss_mask"].tolist()) for s in again] == \
        [(s["input_ids"].tolist(), s["loss_mask"].tolist()) for s in made]
    assert all(s["input_ids"].dtype == torch.int32 and s["loss_mask"].dtype == torch.uint8
               for s in again)

    dataset.online_samples(smollm2, "sharegpt", 3, 96)       # another max_len: tokenised
    assert len(calls) == 3
    dataset.online_samples(smollm2, "sharegpt", 2, 128, skip=1)   # another slice: tokenised
    assert len(calls) == 5
    kept[0].write_bytes(b"not a torch file")                   # damaged: tokenised, rewritten
    assert [s["input_ids"].tolist() for s in dataset.online_samples(
        smollm2, "sharegpt", 3, 128)] == [s["input_ids"].tolist() for s in made]
    assert len(calls) == 8
    dataset.online_samples(smollm2, "sharegpt", 3, 128)
    assert len(calls) == 8
    dataset.online_samples(smollm2, "sharegpt", 3, 128, cache=False)
    assert len(calls) == 11


def test_tokenizing_on_threads_gives_one_threads_samples(smollm2):
    from gumiho.train.dataset import online_samples

    one = online_samples(smollm2, "sharegpt", 12, 160, cache=False, threads=1)
    three = online_samples(smollm2, "sharegpt", 12, 160, cache=False, threads=3)
    assert len(one) == len(three) > 8
    assert [(s["input_ids"].tolist(), s["loss_mask"].tolist()) for s in three] == \
        [(s["input_ids"].tolist(), s["loss_mask"].tolist()) for s in one]


def test_tokenizing_online_samples_shows_progress(smollm2, capsys):
    """Tokenising the split precedes the first step by minutes: the run says so."""
    from gumiho.train.dataset import online_samples

    quiet = online_samples(smollm2, "sharegpt", 2, 128, cache=False)
    assert "tokenize" not in capsys.readouterr().err
    shown = online_samples(smollm2, "sharegpt", 2, 128, progress=True, cache=False)
    err = capsys.readouterr().err
    assert "tokenize" in err and "2/2" in err
    assert [s["input_ids"].tolist() for s in shown] == [s["input_ids"].tolist() for s in quiet]


def test_input_noise_is_drawn_where_its_generator_lives(tiny, tiny_data_dir):
    """--noise-on device: the noise comes from a generator on the drafter's device (no
    host draw, no copy), the same for the same seed; on a CPU that is the host's own draw,
    so a CPU run reads the same noise either way (on a GPU the two streams differ).
    Through batch_loss, each setting repeats its loss for the same seed."""
    from gumiho.train.dataset import add_noise

    features = torch.zeros(2, 5, 8, device=DEVICE)
    valid = torch.ones(2, 5, dtype=torch.bool, device=DEVICE)
    on_device = [add_noise(features, valid, 0.2,
                           torch.Generator(device=DEVICE).manual_seed(7)) for _ in range(2)]
    assert on_device[0].device.type == DEVICE.type and torch.equal(*on_device)
    assert on_device[0].abs().max() <= 0.1 * 512 / 5 and on_device[0].std() > 0
    on_host = add_noise(features, valid, 0.2, torch.Generator().manual_seed(7))
    assert torch.equal(on_host, on_device[0]) == (DEVICE.type == "cpu")
    # each sample's scale is 512 / its own length, as the released per-sample transform's
    valid[1, 2:] = False  # sample 1: 2 tokens, padded to 5
    noised = add_noise(features, valid, 0.2, torch.Generator(device=DEVICE).manual_seed(7))
    assert noised[1, 2:].abs().max() == 0
    assert 0.1 * 512 / 5 < noised[1, :2].abs().max() <= 0.1 * 512 / 2
    # through batch_loss: a training step with each setting runs, same seed same loss
    _, samples = load_samples(tiny_data_dir)
    batch = collate(samples[:2])
    model = new_model(tiny, TrainConfig(method="gumiho", online=True), seed=0)
    head = DraftHead.for_model(tiny, model)
    with torch.no_grad():
        losses = {where: [float(batch_loss(model, tiny, head, batch, "gumiho", 3, 0.2, seed=5,
                                           noise_on=where)[0]) for _ in range(2)]
                  for where in ("cpu", "device")}
    assert losses["cpu"][0] == losses["cpu"][1] and losses["device"][0] == losses["device"][1]


@pytest.mark.parametrize(("asked", "device", "drawn"),
                         [(None, "cpu", "cpu"), (None, "cuda", "device"),
                          ("cpu", "cuda", "cpu"), ("device", "cpu", "device")])
def test_noise_is_drawn_on_the_gpu_by_default(asked, device, drawn):
    config = TrainConfig(method="gumiho", online=True, noise_on=asked)
    assert noise_device(config, torch.device(device)) == drawn


def test_a_bad_noise_place_is_one_line(tiny_target_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:  # argparse's choices
        main(["--target", tiny_target_dir, "--online", "--output-dir", str(tmp_path / "r"),
              "--noise-on", "gpu", "--dry-run"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--noise-on" in err[0] and "gpu" in err[0]
    with pytest.raises(GumihoError, match="--noise-on tpu: use cpu or device"):
        TrainConfig(method="gumiho", online=True, noise_on="tpu")


@pytest.mark.slow
def test_profile_train_step_times_the_trainers_phases(tmp_path):
    """scripts/profile_train_step.py runs the trainer's own step (its wrappers reach
    batch_loss's target features, noise, drafter forward and losses) and reports each
    phase, the step and its kernels (operators on a CPU)."""
    import subprocess
    import sys

    from conftest import child_env

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "step.json"
    proc = subprocess.run([sys.executable, "scripts/profile_train_step.py", "--device", "cpu",
                           "--batch-size", "1", "--max-len", "64", "--conversations", "8",
                           "--warmup", "1", "--steps", "1", "--draft-vocab", "2048",
                           "--top", "5", "--json", str(out)],
                          cwd=root, env=child_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert set(report["phases_s"]) >= {"target features", "input noise", "drafter forward",
                                       "losses", "backward", "clip + optimizer"}
    assert all(v > 0 for k, v in report["phases_s"].items() if k != "batch to device")
    assert report["tokens_per_step"] > 0 and report["step_s"] > 0
    assert len(report["kernels"]["top"]) == 5 and report["kernels"]["busy_s"] > 0
    assert "tokens/s" in proc.stdout and "by phase" in proc.stdout


@pytest.mark.host
@pytest.mark.parametrize("field, flag, value", [
    ("lr", "--lr", -1.0), ("grad_clip", "--grad-clip", 0.0),
    ("noise", "--noise", float("nan")), ("serial2_weight", "--serial2-weight", -0.5),
    ("skip_conversations", "--skip-conversations", -2)])
def test_a_bad_training_number_names_its_flag(field, flag, value):
    """One line naming the flag at fault (it had listed every constraint at once)."""
    with pytest.raises(GumihoError, match=f"^{flag} must be (positive|at least 0) "):
        TrainConfig(online=True, **{field: value})


def test_a_run_writes_only_into_a_new_empty_or_own_folder(tiny_target_dir, tiny_data_dir,
                                                         tmp_path, capsys):
    """A folder holding anything but a run (a model dir, an exported drafter) is refused at
    the dry run and left as it was; an empty folder, one with only the log written before
    a first save, and one with a state (here one cut off mid-save) are a run's own."""
    common = ["--target", tiny_target_dir, "--data", tiny_data_dir, "--dry-run",
              "--output-dir"]
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"weights")
    assert main([*common, str(model)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: --output-dir {model} holds files but no training run (config.json, "
        "model.safetensors): give a new or empty folder")
    assert (model / "model.safetensors").read_bytes() == b"weights"
    for name, own in (("empty", ()), ("logged", ("train_log.jsonl",)),
                      ("mid-save", ("state.tmp/progress.json", "config.json",
                                    "model.safetensors"))):
        folder = tmp_path / name
        folder.mkdir()
        for file in own:
            (folder / file).parent.mkdir(exist_ok=True)
            (folder / file).write_text("{}")
        assert main([*common, str(folder)]) == 0, capsys.readouterr().err
    assert main([*common, str(tmp_path / "new")]) == 0


def test_ctrl_c_in_training_says_how_to_resume(monkeypatch, capsys):
    from gumiho.train import __main__ as trainer

    def interrupted(*_):
        raise KeyboardInterrupt
    monkeypatch.setattr(trainer, "train_config", interrupted)
    assert main(["--online", "--output-dir", "x"]) == 130
    assert capsys.readouterr().err.strip() == (
        "interrupted: the run keeps its last save (each epoch's end, or every --save-every "
        "steps); rerun the same command to resume from it")


def test_data_made_for_another_target_is_refused_or_noted(tiny_target_dir, tiny_data_dir,
                                                          tmp_path, capsys):
    """Another vocabulary (the manifest records it since 2026-11-30) is refused before any
    weights load; another target name of the same shape is a note, since a copy of the
    same model elsewhere is fine."""
    import shutil

    vocab = json.loads((Path(tiny_target_dir) / "config.json").read_text())["vocab_size"]
    assert json.loads((Path(tiny_data_dir) / "manifest.json").read_text())[
        "vocab_size"] == vocab
    other = tmp_path / "other"
    shutil.copytree(tiny_data_dir, other)
    manifest = json.loads((other / "manifest.json").read_text())
    common = ["--target", tiny_target_dir, "--output-dir", str(tmp_path / "run"), "--dry-run",
              "--data", str(other)]
    (other / "manifest.json").write_text(json.dumps({**manifest, "target": "/models/x",
                                                     "vocab_size": vocab + 2}))
    assert main(common) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {other} was made with target '/models/x' (vocabulary {vocab + 2}), but "
        f"{tiny_target_dir!r} has {vocab}: make data for this target")
    del manifest["vocab_size"]  # made before the manifest recorded it
    (other / "manifest.json").write_text(json.dumps({**manifest, "target": "/models/x"}))
    assert main(common) == 0
    assert capsys.readouterr().err.strip() == (
        f"note: {other} was made with target '/models/x', not {tiny_target_dir!r}: the shapes "
        "agree, so training goes on (make data for this target if it is another model)")
    assert main([*common[:-1], tiny_data_dir]) == 0
    assert "note:" not in capsys.readouterr().err


def test_resume_takes_the_same_target_named_relatively(tiny_target_dir, tiny_data_dir,
                                                       tmp_path, capsys, monkeypatch):
    data = (tiny_target_dir, tiny_data_dir)
    assert main(train_args(data, tmp_path, "--stop-after-steps", "1")) == 0
    capsys.readouterr()
    monkeypatch.chdir(Path(tiny_target_dir).parent)
    args = train_args(data, tmp_path, "--stop-after-steps", "2")
    args[args.index("--target") + 1] = Path(tiny_target_dir).name
    assert main(args) == 0, capsys.readouterr().err
    assert "resuming from step 1" in capsys.readouterr().out


def test_the_dry_run_refuses_a_resume_with_other_settings(tiny_target_dir, tiny_data_dir,
                                                          tmp_path, capsys):
    data = (tiny_target_dir, tiny_data_dir)
    assert main(train_args(data, tmp_path, "--stop-after-steps", "1")) == 0
    capsys.readouterr()
    args = train_args(data, tmp_path, "--dry-run")
    assert main(args) == 0
    assert main([*args, "--lr", "0.5"]) == 2
    assert "holds a run made with lr=" in capsys.readouterr().err


def test_a_resume_on_data_made_again_differently_is_refused(tiny_target_dir, tiny_data_dir,
                                                            tmp_path, capsys):
    """The run records a digest of each --data dir's manifest.json: the same path made again
    with other data (delete, make anew) is refused by the dry run and the resume, where it
    used to train on the new data; a run saved before the digest resumes."""
    data_dir = tmp_path / "data"
    shutil.copytree(tiny_data_dir, data_dir)
    data, out = (tiny_target_dir, str(data_dir)), tmp_path / "run"
    assert main(train_args(data, out, "--stop-after-steps", "1")) == 0
    manifest = data_dir / "manifest.json"
    kept = manifest.read_text()
    manifest.write_text(json.dumps({**json.loads(kept), "start": 1}))  # another slice
    capsys.readouterr()
    for extra in (["--dry-run"], []):
        assert main(train_args(data, out, *extra)) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"error: {out} holds a run on other data: a --data dir's manifest.json "
                       "changed since it began (made again?): resume with the data it began "
                       "on, or give another --output-dir"]
    manifest.write_text(kept)
    progress = out / "state" / "progress.json"
    saved = json.loads(progress.read_text())
    assert saved["settings"]["data_digests"] and saved["settings"]["data"] == [str(data_dir)]
    del saved["settings"]["data_digests"]  # as saved before the digests were recorded
    progress.write_text(json.dumps(saved))
    assert main(train_args(data, out, "--stop-after-steps", "2")) == 0
    assert "resuming from step 1" in capsys.readouterr().out


def test_online_training_refuses_a_template_that_writes_no_messages(tiny_target_dir,
                                                                   tmp_path, capsys):
    """`--online --template nosuch` (neither a known name nor Jinja) is one line naming the
    flag before any sample is made; it used to give no sample and blame --max-len."""
    code = main(["--target", tiny_target_dir, "--online", "--num-conversations", "4",
                 "--max-len", "64", "--output-dir", str(tmp_path / "r"),
                 "--template", "nosuch"])
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --template 'nosuch' is not a template: use one of vicuna, or give a Jinja "
        "chat template string"]
