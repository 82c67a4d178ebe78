"""Review of the auto tree's cache key and the generate API's stop strings (session 66)."""

import copy

import pytest
import torch

from gumiho import budget
from gumiho.config import TreeConfig
from gumiho.target import Target, load_target

from conftest import REFERENCE_PROMPT, REFERENCE_TOKENS


def test_a_stream_given_its_stops_as_a_one_shot_iterable_still_holds_them_back(smollm2,
                                                                            reference):
    """`stop` read once: a generator of stop strings used to reach the engine (which
    stopped at the string) and leave the stream's hold-back none, so the stream showed the
    stop string its answer's text ends before."""
    from gumiho.drafters import PlainDrafter
    from gumiho.generate import SpeculativeGenerator

    gen = SpeculativeGenerator(smollm2, PlainDrafter())
    listed = "".join(gen.stream(REFERENCE_PROMPT, max_new_tokens=REFERENCE_TOKENS,
                                stop=["perwe"]))
    assert gen.last_result.stopped_by == "stop_string" and "perwe" not in listed
    for once in (iter(["perwe"]), (s for s in ["perwe"])):
        pieces = "".join(gen.stream(REFERENCE_PROMPT, max_new_tokens=REFERENCE_TOKENS,
                                    stop=once))
        assert pieces == gen.last_result.text == listed
        assert gen.last_result.stopped_by == "stop_string"


class OnMps(Target):
    """A target that says it is on an Apple GPU (no model moves: only the key is asked)."""

    @property
    def device(self) -> torch.device:
        return torch.device("mps")


@pytest.mark.host
def test_the_cached_choice_is_per_kind_of_device_and_cpu_model(tiny_target_dir, tmp_path,
                                                               monkeypatch):
    """An MPS (or XPU) target in the same dtype was keyed as "cpu", so it read the CPU's
    measured choice (and the CPU an MPS one); and a cache folder in a home shared by
    machines with other CPUs handed one CPU's choice to the next."""
    monkeypatch.setenv("GUMIHO_CACHE", str(tmp_path / "cache"))
    target = load_target(tiny_target_dir, device="cpu", dtype="bf16")
    tree = TreeConfig.for_method("gumiho", total_tokens=8)
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "model.safetensors").write_bytes(b"")
    path = budget._cache_file(target, "gumiho", str(draft), tree, "eager")
    mps = copy.copy(target)
    mps.__class__ = OnMps
    assert mps.device.type == "mps" and mps.dtype == target.dtype
    assert budget._cache_file(mps, "gumiho", str(draft), tree, "eager") != path
    from gumiho import env

    monkeypatch.setattr(env, "cpu_name", lambda: "Another CPU")
    assert budget._cache_file(target, "gumiho", str(draft), tree, "eager") != path


@pytest.mark.host
def test_an_int_temperature_reads_the_same_cached_choice_as_its_float(tiny_target_dir,
                                                                      tmp_path, monkeypatch):
    """temperature=1 (an int, as the API takes it) and 1.0 (the CLI's) are one setting: they
    were keyed "1" and "1.0", so the same choice was measured (a minute) twice."""
    monkeypatch.setenv("GUMIHO_CACHE", str(tmp_path / "cache"))
    target = load_target(tiny_target_dir)
    tree = TreeConfig.for_method("gumiho", total_tokens=8)
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "model.safetensors").write_bytes(b"")
    assert budget._cache_file(target, "gumiho", str(draft), tree, "eager", temperature=1) == \
        budget._cache_file(target, "gumiho", str(draft), tree, "eager", temperature=1.0)
    assert isinstance(budget.temperature_key(1), float)


@pytest.mark.host
def test_the_cached_choice_knows_a_local_target_by_its_place_and_files(tiny_target_dir,
                                                                       tmp_path, monkeypatch):
    """A target named by a relative folder ("./model") was keyed by that name alone, so the
    same name in another folder, or a model replaced in place, read a stale choice."""
    import os
    import shutil

    monkeypatch.setenv("GUMIHO_CACHE", str(tmp_path / "cache"))
    target = copy.copy(load_target(tiny_target_dir))  # (its name is changed below)
    tree = TreeConfig.for_method("gumiho", total_tokens=8)
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "model.safetensors").write_bytes(b"")
    for side in ("a", "b"):
        shutil.copytree(tiny_target_dir, tmp_path / side / "model")
    paths = []
    for side in ("a", "b"):
        monkeypatch.chdir(tmp_path / side)
        target.name = "./model"
        paths.append(budget._cache_file(target, "gumiho", str(draft), tree, "eager"))
    assert paths[0] != paths[1]  # the same name, two models
    weights = tmp_path / "b" / "model" / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    assert budget._cache_file(target, "gumiho", str(draft), tree, "eager") != paths[1]
    assert budget.target_key("smollm2") == ["smollm2"]  # an embedded model's: a name
