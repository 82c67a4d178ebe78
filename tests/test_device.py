"""Device discipline and host synchronisations of the loop, checked on the CPU.

* Every tensor the loop makes lands on the target's device: run under `torch.device("meta")`
  as the default device, a tensor created without an explicit device goes to `meta` and
  any use of it beside the target's tensors fails.
* A greedy cycle syncs the host once (accept length and tokens in one transfer), counted
  by `HostSyncCounter`, which sees what CUDA's sync debug mode reports on a GPU.
"""

import subprocess
import sys

import numpy as np
import pytest
import torch

from gumiho.config import TreeConfig
from gumiho.demo import shipped_drafter
from gumiho.drafters import PlainDrafter, load_drafter
from gumiho.engine import GenerateConfig, run
from gumiho.evaluation.profiling import launches_per_cycle
from gumiho.hostsync import HostSyncCounter, LaunchCounter, upload

CASES = [("ar", "off"), ("lookup", "off"), ("gumiho", "off"), ("gumiho", "exact"),
         ("gumiho", "official"), ("eagle2", "off"), ("medusa", "off")]


def small_tree(method, fta):
    if method in ("ar", "lookup"):
        return None
    return TreeConfig.for_method(method, total_tokens=12, top_k=3, mlp_topk=3, pruning=3,
                                 depth=4, fta=fta, lookup=4 if method == "gumiho" else 0)


@pytest.mark.parametrize("method,fta", CASES)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_no_tensor_is_made_off_the_target_device(tiny_target, method, fta, temperature):
    drafter = load_drafter(method, tiny_target, None if method in ("ar", "lookup") else "random",
                           tree=small_tree(method, fta))
    config = GenerateConfig(max_new_tokens=10, temperature=temperature)
    want = run(tiny_target, drafter, [3, 1, 4, 1, 5], config)
    with torch.device("meta"):  # tensors made without a device land here and fail
        got = run(tiny_target, drafter, [3, 1, 4, 1, 5], config)
    assert got.token_ids == want.token_ids


@pytest.mark.parametrize("method,fta", [c for c in CASES if c[1] == "off"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_one_host_sync_per_cycle(smollm2, method, fta, temperature):
    drafter = load_drafter(method, smollm2, None if method in ("ar", "lookup") else "random",
                           tree=small_tree(method, fta), engine="static")
    ids = smollm2.chat_ids("Name three colours.")
    config = GenerateConfig(max_new_tokens=16, temperature=temperature, engine="static")
    run(smollm2, drafter, ids, config)  # first use: captures, one-off tree shapes
    with HostSyncCounter() as syncs:
        result = run(smollm2, drafter, ids, config)
    # per generation: the prompt's ids go to the device, the prefill's token comes back
    per_cycle = (syncs.total - 2) / (result.cycles - 1)
    assert per_cycle <= 1.0, syncs.sites.most_common(5)


# Kernels a greedy cycle launches outside recorded steps, at most (graphs.py copies inputs
# and outputs of the recorded steps; the rest is the loop's own bookkeeping). Before the
# drafting was one recorded step and acceptance part of the verify step: Gumiho 102 a cycle
# (SmolLM2, the reference tree), a lookup chain 165, Medusa 16.
LAUNCH_BUDGET = {"ar": 10, "lookup": 22, "gumiho": 22, "eagle2": 22, "medusa": 14,
                 "gumiho+lookup": 36}


@pytest.mark.parametrize("method", list(LAUNCH_BUDGET))
def test_a_greedy_cycle_launches_few_kernels_outside_recorded_steps(tiny_target, method):
    """On a GPU every kernel launched outside a recorded step costs the host a few
    microseconds on the cycle's critical path (the 8B-shape cycle spent 3.4 ms beside its
    verify this way). `static` runs the steps a captured engine records and counts the
    rest as CUDA would launch them, so the budget holds on the CPU too."""
    name, lookup = method.split("+")[0], 10 if method.endswith("lookup") else 0
    tree = None if name in ("ar", "lookup") else TreeConfig.for_method(name, lookup=lookup)
    drafter = load_drafter(name, tiny_target, None if tree is None else "random", tree=tree,
                           engine="static")
    per_module, _ = launches_per_cycle(tiny_target, drafter, [5, 17, 3, 42, 8, 9, 11, 5, 17],
                                       "static", 24)
    assert sum(per_module.values()) <= LAUNCH_BUDGET[method], per_module


# Kernels a greedy cycle runs inside recorded steps, SmolLM2 and the shipped drafters at
# their reference trees: plain decoding's step (30 layers; 1,290 before the write slots and
# the additive mask were made once a step, not in every layer), and what each method's
# cycle adds to it (its drafting). Measured 1,143, +327, +392, +12 (2026-11-27). A
# prompt-lookup chain of 10 (the demo's) adds its merge to Gumiho's cycle: 158 kernels
# when it walked the chain a slot at a time, 52 since it is merged at once (2026-11-30).
LOOKUP_IN_STEP_BUDGET = 60
IN_STEP_BUDGET = {"ar": 1160, "gumiho": 340, "eagle2": 410, "medusa": 20,
                  "gumiho+lookup": 340 + LOOKUP_IN_STEP_BUDGET}


def test_recorded_steps_run_few_kernels(smollm2):
    """Inside a recorded step a small model's GPU time is about what its kernels number
    (SmolLM2's plain step ran ~4.5 ms on an H100, ~1,300 operators of a few microseconds):
    each step is held to its count, so work repeated per layer, or drafting grown by a
    kernel per tree level, shows here on the CPU."""
    if smollm2.device.type != "cpu":  # the budgets are the CPU's operator counts
        pytest.skip("counted as the CPU's operators (a GPU's products and norms differ)")
    ids = smollm2.chat_ids("List three uses of a paperclip.")
    counts = {}
    for method in IN_STEP_BUDGET:
        name, lookup = method.split("+")[0], 10 if "+lookup" in method else 0
        drafter = PlainDrafter() if method == "ar" else load_drafter(
            name, smollm2, str(shipped_drafter(name)),
            tree=TreeConfig.for_method(name, lookup=lookup), engine="static")
        counts[method] = launches_per_cycle(smollm2, drafter, ids, "static", 10)[1]
    plain = counts.pop("ar")
    assert plain <= IN_STEP_BUDGET["ar"], plain
    for method, count in counts.items():
        assert count - plain <= IN_STEP_BUDGET[method], (method, count - plain)
    chain = counts["gumiho+lookup"] - counts["gumiho"]
    assert chain <= LOOKUP_IN_STEP_BUDGET, chain


@pytest.mark.host
def test_sync_counter_sees_what_cuda_would_sync_on():
    x = torch.zeros(6, dtype=torch.bool)
    idx = torch.arange(3)
    with HostSyncCounter() as syncs:
        x[idx] = True  # the scalar is copied to the device first
        x.nonzero()
        idx.tolist()
        int(idx[0])
        torch.tensor([1, 2])
        idx[x[:3]]
    assert syncs.total == 6, syncs.by_kind
    with HostSyncCounter() as none:
        x[:2] = True
        torch.where(x, 1, 0)
        idx + 1
        x.scatter_(0, idx, True)
        idx[idx]
        upload(np.arange(4), torch.device("cpu"))  # pinned, non-blocking on a GPU
    assert none.total == 0, none.sites


def test_an_upload_counts_one_launch_on_every_device():
    """On CUDA an upload runs two host operators (is_pinned, _pin_memory) and one transfer;
    on a CPU none: counted as one launch on both, so a CPU count is a GPU count (the
    seventh lease's GPU counted two more per upload than the CPU)."""
    device = torch.zeros(1).device  # the test device (a tensor made here lands there)
    with LaunchCounter() as launches:
        values = upload(np.arange(4), device)
        values + 1
    assert dict(launches.by_module) == {"?": 2}  # called from outside the library
    assert values.tolist() == [0, 1, 2, 3]  # (a bare arange would land on the test device)


@pytest.mark.host
def test_code_version_outside_a_checkout(tmp_path):
    import shutil

    import gumiho

    shutil.copytree(gumiho.__path__[0], tmp_path / "gumiho",
                    ignore=shutil.ignore_patterns("assets", "__pycache__"))
    out = subprocess.run([sys.executable, "-c", "from gumiho.version import code_version; "
                          "print(code_version())"], cwd=tmp_path, capture_output=True,
                         text=True, check=True, env={"PATH": "/usr/bin:/bin"})
    assert out.stdout.startswith("gumiho ")


@pytest.mark.parametrize("method", ["gumiho", "eagle2", "medusa"])
def test_loading_a_drafter_and_sizing_a_tree_make_no_tensor_off_the_target_device(
        tiny_target, tmp_path, method):
    """A drafter read from a checkpoint is built on the target's device (not first on the
    caller's default one), and auto's timed pieces (a verify of a width, a proposal at a
    shape) make their tensors there too: under `meta` as the default, one made without a
    device fails."""
    from gumiho import budget
    from gumiho.checkpoint import save_drafter

    tree = TreeConfig.for_method(method, total_tokens=12, top_k=3, mlp_topk=3, pruning=3,
                                 depth=4)
    saved = load_drafter(method, tiny_target, "random", tree=tree)
    save_drafter(saved.model, tmp_path / "drafter")
    config = GenerateConfig(max_new_tokens=10)
    want = run(tiny_target, load_drafter(method, tiny_target, str(tmp_path / "drafter"),
                                         tree=tree), [3, 1, 4, 1, 5], config)
    with torch.device("meta"):
        drafter = load_drafter(method, tiny_target, str(tmp_path / "drafter"), tree=tree)
        got = run(tiny_target, drafter, [3, 1, 4, 1, 5], config)
        budget.verify_step(tiny_target, 6, 16)()
        budget.draft_step(tiny_target, drafter.model, method, tree, "eager", [3, 1, 4, 1, 5])()
    assert next(drafter.model.parameters()).device == tiny_target.device
    assert got.token_ids == want.token_ids


@pytest.mark.parametrize("method", ["gumiho", "eagle2", "medusa"])
def test_a_training_step_makes_no_tensor_off_the_drafters_device(tiny_target, method):
    """Training's draws (batch order, feature noise, the ploss sample) come from CPU
    generators, on the CPU by name, and batches are assembled on the host: a default device
    (a notebook's `with torch.device("cuda")`, this suite's on a GPU) neither breaks nor
    changes them. Under `meta` as the default, a tensor made without a device fails."""
    from gumiho.config import TrainConfig
    from gumiho.modeling import DraftHead
    from gumiho.train.dataset import collate, epoch_batches
    from gumiho.train.start import new_model
    from gumiho.train.step import batch_loss

    g = torch.Generator().manual_seed(0)
    samples = [{"input_ids": torch.randint(97, (n,), generator=g, device="cpu"),
                "hidden_state": torch.randn(n, 32, generator=g, device="cpu"),
                "loss_mask": torch.ones(n, dtype=torch.uint8, device="cpu")} for n in (9, 12, 7)]
    model = new_model(tiny_target, TrainConfig(method=method, online=True), seed=0)
    head = DraftHead.for_model(tiny_target, model)

    def step():
        loss, _ = batch_loss(model, tiny_target, head, collate(samples), method, epoch=3,
                             noise=0.2, p_fraction=0.5, seed=1)
        return epoch_batches([9, 12, 7], 2, seed=0, epoch=1), float(loss.detach())

    want = step()
    with torch.device("meta"):
        assert step() == want


@pytest.mark.host
def test_the_default_device_and_dtype_follow_the_environment(monkeypatch):
    """GUMIHO_DEVICE and GUMIHO_DTYPE stand for unset --device and --dtype (subprocesses,
    the suite on a GPU); explicit arguments win, and a bad value is one line."""
    from gumiho.errors import GumihoError
    from gumiho.target import choose_device_dtype

    monkeypatch.setenv("GUMIHO_DEVICE", "cpu")
    monkeypatch.setenv("GUMIHO_DTYPE", "bfloat16")
    assert choose_device_dtype() == (torch.device("cpu"), torch.bfloat16)
    assert choose_device_dtype(None, "float32")[1] == torch.float32
    monkeypatch.delenv("GUMIHO_DTYPE")
    assert choose_device_dtype() == (torch.device("cpu"), torch.float32)
    monkeypatch.setenv("GUMIHO_DTYPE", "float8")
    with pytest.raises(GumihoError, match="unknown dtype 'float8'"):
        choose_device_dtype()


@pytest.mark.host
def test_a_gpu_left_unusable_is_named(monkeypatch):
    """The suite's probe after a failed GPU test (conftest.cuda_unusable): an error from the
    device names why the worker ends; a device that answers keeps it."""
    from conftest import cuda_unusable

    def asserted():
        raise RuntimeError("CUDA error: device-side assert triggered\nCUDA kernel errors ...")

    for name, value in [("synchronize", lambda: None), ("get_rng_state", lambda: None),
                        ("set_rng_state", lambda state: None)]:
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(torch, "rand", lambda *shape, device: None)
    assert cuda_unusable() is None
    monkeypatch.setattr(torch.cuda, "synchronize", asserted)
    assert cuda_unusable() == "RuntimeError: CUDA error: device-side assert triggered"

    def captured(*shape, device):
        raise RuntimeError("Offset increment outside graph capture encountered unexpectedly.")

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch, "rand", captured)
    assert cuda_unusable() == ("RuntimeError: Offset increment outside graph capture "
                               "encountered unexpectedly.")
