"""Drafting only where it pays (gate.py): the decision follows the drafter's running tokens
per cycle, skipped cycles are plain steps, and the output stays exactly the target's."""

import pytest
import torch

from gumiho.config import TreeConfig
from gumiho.drafters import PlainDrafter, load_drafter
from gumiho.engine import GenerateConfig, run
from gumiho.errors import GumihoError
from gumiho.gate import GatedDrafter
from gumiho.lookup import LookupDrafter

from conftest import tiny_llama
from drafters_for_tests import RandomDrafter
from test_sampling import assert_samples_match_target


def emit(drafter, n: int) -> None:
    """The loop committed n tokens."""
    tokens = list(range(1, n + 1))
    drafter.observe(torch.zeros(n, 8), torch.tensor(tokens), tokens)


@pytest.mark.host
def test_the_gate_drafts_while_the_running_mean_pays_and_probes_otherwise():
    inner = RandomDrafter(64, size=4, seed=0)
    gate = GatedDrafter(inner, break_even=1.5, prior=2.0, weight=0.5, probe=3)
    gate.begin(tiny_llama(), 64)
    emit(gate, 5)  # the prompt: not a drafter cycle, the mean stays at the prior
    assert gate.rate == 2.0
    assert gate.propose().size == 4  # 2.0 >= 1.5: the drafter's tree
    emit(gate, 1)  # it emitted 1: mean 1.5, still drafting
    assert gate.rate == 1.5 and gate.propose().size == 4
    emit(gate, 1)  # mean 1.25 < 1.5
    sizes = []
    for _ in range(4):  # three plain steps, then a probe
        sizes.append(gate.propose().size)
        emit(gate, 1 if sizes[-1] == 1 else 3)  # the probe emits 3: mean 2.125
    assert sizes == [1, 1, 1, 4]
    assert gate.rate == 2.125 and gate.propose().size == 4  # it pays again
    assert gate.counts == {"drafted": 4, "plain": 3}
    tree = GatedDrafter(inner, 1.5)
    tree.begin(tiny_llama(), 64)
    assert tree.rate == 1.75  # default prior: a quarter token above the break-even


@pytest.mark.host
def test_cycles_that_lookup_verifies_do_not_count_as_the_drafters():
    gate = GatedDrafter(RandomDrafter(64, size=4, seed=0), break_even=1.5, prior=2.0)
    drafter = LookupDrafter(gate, tokens=5, first=True)
    drafter.begin(tiny_llama(), 64)
    emit(drafter, 4)
    drafter.propose()  # nothing recurs: the gate drafts
    emit(drafter, 1)
    assert gate.rate == pytest.approx(1.9)
    drafter.observe(torch.zeros(2, 8), torch.tensor([3, 4]), [3, 4])  # (3, 4) recurs
    assert drafter.propose().size == 3  # the chain alone
    emit(drafter, 3)
    assert gate.rate == pytest.approx(1.9)  # the chain's tokens are not the drafter's


@pytest.mark.parametrize("method", ["gumiho", "eagle2", "medusa"])
def test_gated_drafting_equals_plain(smollm2, method):
    """A random drafter never pays, so most cycles become plain steps with probes between:
    the drafter catches up on every skipped token and the output is the target's."""
    ids = smollm2.chat_ids("List the numbers from one to twenty in words.")
    config = GenerateConfig(max_new_tokens=40)
    plain = run(smollm2, PlainDrafter(), ids, config)
    tree = TreeConfig.for_method(method, total_tokens=8, draft_gate=2.5)
    # the gate acts on the eager engine only (a GPU's default is graphs)
    drafter = load_drafter(method, smollm2, "random", tree=tree, engine="eager")
    assert isinstance(drafter, GatedDrafter)
    out = run(smollm2, drafter, ids, config)
    assert out.token_ids == plain.token_ids
    assert drafter.counts["plain"] > drafter.counts["drafted"] > 0, drafter.counts


def test_gated_sampling_matches_target():
    vocab = 16
    target = tiny_llama(vocab_size=vocab, seed=1, logit_scale=25.0)
    # break-even 1.6 with prior 1.65: whether a cycle drafts depends on the earlier ones
    drafter = GatedDrafter(RandomDrafter(vocab, size=4, seed=0), 1.6, prior=1.65,
                           weight=0.5, probe=1)
    assert_samples_match_target(target, drafter, [3, 9, 1, 12, 5], vocab)


@pytest.mark.host
def test_captured_engines_and_a_zero_gate_always_draft(tiny_target_dir):
    from gumiho.target import load_target

    target = load_target(tiny_target_dir)
    gated = TreeConfig.for_method("gumiho", total_tokens=8, draft_gate=1.3)
    assert not isinstance(load_drafter("gumiho", target, "random", tree=gated,
                                       engine="compile"), GatedDrafter)
    assert not isinstance(load_drafter("gumiho", target, "random",
                                       tree=TreeConfig.for_method("gumiho")), GatedDrafter)


@pytest.mark.host
@pytest.mark.parametrize("bad", [-1, True, "auto", float("nan")])
def test_a_bad_gate_is_one_line(bad):
    """Out of range: GumihoError naming the flag; of another type (the API): TypeError."""
    wrong_type = isinstance(bad, bool | str)
    with pytest.raises(TypeError if wrong_type else GumihoError,
                       match="draft_gate must be a number" if wrong_type else
                       "--draft-gate must be a number"):
        TreeConfig.for_method("gumiho", draft_gate=bad)
