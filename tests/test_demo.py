"""`gumiho demo` runs the embedded default with the shipped drafter, losslessly."""

import os

import pytest
import torch

from gumiho import demo
from gumiho.graphs import resolve_engine

from conftest import DEVICE


@pytest.mark.parametrize("method", ["gumiho", "eagle2", "medusa"])
def test_shipped_drafters_load_and_decode_like_plain(smollm2, method, capsys):
    code = demo.main(["--method", method, "--max-new-tokens", "24", "--total-tokens", "16",
                      "--rounds", "2"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "outputs identical" in out and "speedup" in out
    assert "lower middle of 2 alternated rounds" in out  # timed side by side
    assert "prompt-lookup chain of up to 10" in out  # the demo's default beside the drafter
    # its confidence floor, for the methods that take one, where it applies: the eager
    # engine (captured steps keep one tree shape, so a GPU's default graphs ignore floors)
    # (float32 only: on a CPU with AMX the demo runs exact bf16, where they cost speed,
    # unless $GUMIHO_DTYPE, which the suite sets, says otherwise)
    dtype = os.environ.get("GUMIHO_DTYPE") or (
        "bfloat16" if demo.exact_bf16_here(DEVICE) else "float32")
    floors = method != "medusa" and resolve_engine(None, DEVICE) == "eager" \
        and dtype == "float32"
    assert ("path probability >= 0.1" in out) == floors
    assert ("deeper levels below >= 0.4" in out) == floors


def test_demo_runs_the_drafter_alone_with_lookup_0(smollm2, capsys):
    code = demo.main(["--max-new-tokens", "24", "--total-tokens", "8", "--lookup", "0",
                      "--rounds", "1"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "outputs identical" in out and "prompt-lookup" not in out
    assert "1 round ..." in out and "median" not in out


def test_demo_floor_can_be_turned_off(smollm2, capsys):
    code = demo.main(["--max-new-tokens", "16", "--total-tokens", "8", "--min-confidence", "0",
                      "--extend-confidence", "0", "--rounds", "1"])
    out = capsys.readouterr().out
    assert code == 0 and "outputs identical" in out and "path probability" not in out
    assert "deeper levels" not in out


def test_demo_in_bf16_drafts_without_the_float32_floors(capsys):
    """The floors were measured in float32; in bf16 (a near-flat verify on an AMX CPU, and a
    GPU's captured steps) the demo leaves them off unless asked. bf16 output may part from
    plain decoding's at a near-tie, which the demo says rather than failing."""
    code = demo.main(["--max-new-tokens", "16", "--total-tokens", "8", "--dtype", "bfloat16",
                      "--device", str(DEVICE), "--rounds", "1"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "speedup" in out and "path probability" not in out and "deeper levels" not in out
    assert "outputs identical" in out or "near-tie" in out


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the choice is for CPUs")
@pytest.mark.parametrize("amx", [True, False])
def test_demo_runs_exact_bf16_on_an_amx_cpu(smollm2, capsys, monkeypatch, amx):
    """With AMX (and bf16 products that keep rows independent, which this machine's probe
    decides) the demo's default is bf16 with the row-invariant attention, and its output is
    still plain decoding's bit for bit; otherwise float32. An explicit --dtype wins."""
    monkeypatch.setattr(demo, "amx_cpu", lambda: amx)
    monkeypatch.delenv("GUMIHO_DTYPE")  # (the suite's default dtype: a user's would win)
    code = demo.main(["--max-new-tokens", "8", "--total-tokens", "4", "--rounds", "1"])
    out = capsys.readouterr().out
    assert code == 0 and "outputs identical" in out, out
    bf16 = demo.exact_bf16_here(torch.device("cpu"))  # amx as patched, and the probes
    assert ("in bfloat16:" in out) == bf16 and ("in float32:" in out) != bf16
    assert ("row-invariant attention" in out) == bf16
    assert demo.main(["--max-new-tokens", "4", "--total-tokens", "4", "--dtype", "float32",
                      "--rounds", "1"]) == 0
    assert "in float32:" in capsys.readouterr().out
    # so does $GUMIHO_DTYPE, the default dtype's other spelling (gumiho env says the same)
    import argparse

    monkeypatch.setenv("GUMIHO_DTYPE", "float32")
    args = argparse.Namespace(device=None, dtype=None, attention=None)
    assert not demo.exact_bf16_default(args) and args.dtype is None


def test_demo_names_the_tree_auto_chose(smollm2, capsys, monkeypatch):
    """auto races the model's best few shapes and keeps the fastest by whole cycles; the demo
    describes that one (it once printed the model's best, which the race had passed over)."""
    from gumiho import generate

    rows = {"8/2": {"total_tokens": 8, "depth": 2, "chain": False, "accept": 2.0,
                    "tokens_per_s": 80.0, "speedup": 1.2, "measured_tokens_per_s": 70.0},
            "4/1": {"total_tokens": 4, "depth": 1, "chain": False, "accept": 1.6,
                    "tokens_per_s": 75.0, "speedup": 1.1, "measured_tokens_per_s": 85.0}}
    report = {"tree": {"total_tokens": 4, "depth": 1, "top_k": 14, "mlp_topk": 35,
                       "pruning": 35, "fta": "off"}, "break_even": 1.25, "chosen": "4/1",
              "shapes": rows}
    monkeypatch.setattr(generate, "choose_tree", lambda *args, **kwargs: report)
    assert demo.main(["--max-new-tokens", "8", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "4 tokens down to depth 1; expected 1.60 tokens per cycle, 1.28x plain" in out, out
    assert "4-token tree of depth 1" in out


@pytest.mark.host
def test_rounds_alternate_which_decode_goes_first(monkeypatch):
    """Round 1 decodes speculatively first, round 2 plainly first, and so on, each pair
    kept together and the pairs sorted by their speedup (the median is the figure)."""
    from types import SimpleNamespace

    from gumiho.drafters import PlainDrafter
    from gumiho.engine import GenerateConfig

    order = []

    def fake_run(target, drafter, ids, config):
        kind = "plain" if isinstance(drafter, PlainDrafter) else "spec"
        order.append(kind)
        turn = sum(k == kind for k in order)  # this kind's n-th decode (1: the warm-up)
        return SimpleNamespace(kind=kind, turn=turn,
                               tokens_per_s=10.0 if kind == "plain" else 10.0 + 7 * turn % 5)

    monkeypatch.setattr(demo, "run", fake_run)
    pairs = demo.alternated_rounds(None, "drafter", [1], GenerateConfig(), 4)
    assert order == ["plain", "spec", "plain", "plain", "spec", "spec", "plain", "plain", "spec"]
    assert all(fast.kind == "spec" and plain.kind == "plain" for fast, plain in pairs)
    assert sorted((fast.turn, plain.turn) for fast, plain in pairs) == \
        [(1, 2), (2, 3), (3, 4), (4, 5)]  # each round's own two decodes
    ratios = [fast.tokens_per_s / plain.tokens_per_s for fast, plain in pairs]
    assert ratios == sorted(ratios)
    # the figure: the median, of an even number the lower middle (not the better of two)
    assert demo.middle_round(pairs) is pairs[1]
    assert demo.middle_round(pairs[:2]) is pairs[0] and demo.middle_round(pairs[:3]) is pairs[1]
