"""Every method's greedy output equals plain decoding on the real target, whether the
drafter is random (little is accepted) or an oracle (almost everything is)."""

import json
import subprocess
import sys

import pytest
import torch

from gumiho.config import TreeConfig
from gumiho.drafters import load_drafter
from gumiho.engine import GenerateConfig, run

from conftest import REFERENCE_PROMPT as PROMPT
from conftest import REFERENCE_TOKENS as N
from drafters_for_tests import oracle_drafter


@pytest.mark.parametrize("method, fta", [("gumiho", "off"), ("gumiho", "exact"),
                                         ("eagle2", "off"), ("medusa", "off")])
def test_random_drafter_equals_plain(smollm2, reference, method, fta):
    ids, plain = reference
    tree = TreeConfig.for_method(method, fta=fta, total_tokens=24)
    out = run(smollm2, load_drafter(method, smollm2, "random", tree=tree), ids,
              GenerateConfig(max_new_tokens=N))
    assert out.token_ids == plain.token_ids


@pytest.mark.parametrize("method, fta", [("gumiho", "off"), ("gumiho", "exact"),
                                         ("eagle2", "off")])
def test_oracle_drafter_equals_plain_and_accepts_a_lot(smollm2, reference, method, fta):
    ids, plain = reference
    full = ids + plain.token_ids
    tree = TreeConfig.for_method(method, fta=fta)
    out = run(smollm2, oracle_drafter(method, smollm2, full, tree), ids,
              GenerateConfig(max_new_tokens=N))
    assert out.token_ids == plain.token_ids
    per_cycle = 8 if method == "gumiho" else 7  # all drafts + the bonus token
    assert max(out.accept_lengths) == per_cycle and out.tau > 4


def test_cli_gumiho_random_json(smollm2, reference):
    ids, plain = reference
    out = subprocess.run(
        [sys.executable, "-m", "gumiho.generate", "--method", "gumiho", "--draft", "random",
         "--prompt", PROMPT, "--max-new-tokens", str(N), "--total-tokens", "16", "--json"],
        capture_output=True, text=True, check=True)
    assert json.loads(out.stdout)["token_ids"] == plain.token_ids


@pytest.mark.host
def test_tree_flags_each_method_reads_are_accepted():
    """--depth for Gumiho (fewer MLP levels) and --lookup for every drafting method are
    honoured, so they must pass the flag check; flags a method ignores are refused."""
    from gumiho.config import check_tree_options
    from gumiho.errors import GumihoError

    for method in ("gumiho", "eagle2", "medusa"):
        check_tree_options(method, {"depth": 4, "lookup": 6})
    check_tree_options("lookup", {"lookup": 6})
    with pytest.raises(GumihoError, match="does not apply"):
        check_tree_options("ar", {"lookup": 6})
    with pytest.raises(GumihoError, match="does not apply"):
        check_tree_options("medusa", {"top_k": 4})


@pytest.mark.host
def test_the_demo_preset_fills_what_is_unset():
    """`--preset demo` (what `gumiho demo` runs): an auto-sized tree, a lookup chain of 10
    tried first, and the confidence floors for the methods that take them, in float32
    only; a flag given wins, and --lookup 0 leaves no lookup-first behind."""
    from gumiho.config import preset_options
    from gumiho.errors import GumihoError

    unset = {"total_tokens": None, "lookup": None, "lookup_first": None,
             "min_confidence": None, "extend_confidence": None}
    demo = preset_options("demo", "gumiho", True, unset)
    assert demo == {"total_tokens": "auto", "lookup": 10, "lookup_first": True,
                    "min_confidence": 0.1, "extend_confidence": 0.4}
    assert preset_options("demo", "eagle2", True, unset) == demo
    for method, float32 in (("gumiho", False), ("medusa", True)):  # no floors
        assert preset_options("demo", method, float32, unset) == {
            **unset, "total_tokens": "auto", "lookup": 10, "lookup_first": True}
    given = {**unset, "total_tokens": 8, "lookup": 0, "min_confidence": 0.0}
    assert preset_options("demo", "gumiho", True, given) == {
        **given, "extend_confidence": 0.4}  # lookup_first stays unset: no chain
    assert preset_options("reference", "gumiho", True, unset) == unset
    assert preset_options(None, "gumiho", True, unset) == unset
    with pytest.raises(GumihoError, match="has none"):
        preset_options("demo", "ar", True, unset)
    with pytest.raises(GumihoError, match="unknown preset"):
        preset_options("fast", "gumiho", True, unset)


def test_a_generator_loaded_with_the_demo_preset_runs_the_demos_tree(smollm2, reference):
    """The API's preset builds the demo's drafter (here with a fixed size: `auto` times the
    machine), and its output is still plain decoding's."""
    from gumiho import SpeculativeGenerator

    gen = SpeculativeGenerator.load(smollm2, "gumiho", "gumiho/assets/smollm2/gumiho",
                                    preset="demo", total_tokens=8)
    tree = gen.drafter.tree
    assert (tree.total_tokens, tree.lookup, tree.lookup_first) == (8, 10, True)
    floors = smollm2.dtype == torch.float32
    assert (tree.min_confidence, tree.extend_confidence) == ((0.1, 0.4) if floors else (0, 0))
    ids, plain = reference
    assert gen.generate(ids, len(plain.token_ids)).token_ids == plain.token_ids


def test_sampling_from_the_top_1_is_greedy_decoding(smollm2, reference):
    """At T > 0 with top_k 1, or a nucleus too small for a second token, every draw is the
    target's argmax: the shipped Gumiho drafter's sampled answer is plain greedy decoding's
    for any seed, drafts taken on the way; without the cut the same seed samples another."""
    from gumiho import SpeculativeGenerator

    gen = SpeculativeGenerator.load(smollm2, "gumiho", "gumiho/assets/smollm2/gumiho",
                                    total_tokens=8)
    ids, plain = reference
    n = len(plain.token_ids)
    for seed, cut in [(0, {"top_k": 1}), (1, {"top_p": 1e-6}), (2, {"top_k": 40, "top_p": 1e-6})]:
        out = gen.generate(ids, n, temperature=1.0, seed=seed, **cut)
        assert out.token_ids == plain.token_ids, cut
        assert out.tau > 1.2, cut
    assert gen.generate(ids, n, temperature=1.0, seed=0).token_ids != plain.token_ids


def test_a_medusa_drafter_with_more_heads_drafts_at_every_depth(smollm2):
    """A Medusa checkpoint of 7 heads at depth 7 (the released tree's accuracies stop at 5
    heads: the last is repeated, where it raised IndexError), and its answer is plain
    decoding's."""
    from gumiho.checkpoint import drafter_network
    from gumiho.config import DrafterConfig
    from gumiho.drafters import MedusaDrafter, PlainDrafter

    config = DrafterConfig.for_target(smollm2.config, "medusa", num_mlp_heads=7)
    torch.manual_seed(0)
    drafter = MedusaDrafter(drafter_network(config, smollm2),
                            TreeConfig.for_method("medusa", depth=7, total_tokens=300))
    assert drafter.draft_depth == 7 and drafter.max_nodes == 300
    ids = smollm2.chat_ids(PROMPT)
    out = run(smollm2, drafter, ids, GenerateConfig(max_new_tokens=12))
    assert out.token_ids == run(smollm2, PlainDrafter(), ids,
                                GenerateConfig(max_new_tokens=12)).token_ids
