"""Drafters at their edges: a target vocabulary smaller than the tree's widths, a drafter
moved to another target (its recorded steps made anew, acceptance a fresh drafter's), a
random draft vocabulary as large as the target's or larger."""

import pytest

from gumiho.config import TreeConfig
from gumiho.drafters import PlainDrafter, load_drafter
from gumiho.engine import GenerateConfig, run
from gumiho.errors import GumihoError

from conftest import tiny_llama

PROMPT = [3, 9, 1, 12]


@pytest.mark.parametrize("method", ["gumiho", "eagle2", "medusa"])
def test_a_vocabulary_smaller_than_the_tree_widths_drafts_what_it_has(method):
    """A target of 8 tokens (Medusa: 4) under the method's reference tree (top_k 14 or 10,
    mlp_topk 35, Medusa's ranks 0..9): every level takes at most the vocabulary, as it
    does for a reduced draft vocabulary. It was `RuntimeError: selected index k out of
    range` from topk."""
    target = tiny_llama(vocab_size=4 if method == "medusa" else 8, seed=1, logit_scale=2.0)
    prompt = [3, 1, 2, 0]
    plain = run(target, PlainDrafter(), prompt, GenerateConfig(max_new_tokens=12))
    drafter = load_drafter(method, target, "random", engine="eager")
    out = run(target, drafter, prompt, GenerateConfig(max_new_tokens=12))
    assert out.token_ids == plain.token_ids


@pytest.mark.parametrize("method", ["gumiho", "medusa"])
def test_a_drafter_moved_to_another_target_records_its_steps_anew(method, monkeypatch):
    """A drafter that begins on a second target of the same shape drafts with that
    target's lm_head. On a captured engine it kept replaying the steps it recorded against
    the first target's head (a GPU drafts from stale, possibly freed, memory); the
    `static` engine, which checks what a capture would freeze, raised on it. (The 16-bit
    drafting copy of the head is a C call the check cannot see: off here.)"""
    monkeypatch.setenv("GUMIHO_DRAFT_HEAD16", "0")
    first = tiny_llama(vocab_size=97, seed=1, logit_scale=2.0)
    second = tiny_llama(vocab_size=97, seed=2, logit_scale=2.0)
    tree = TreeConfig.for_method(method, total_tokens=10)
    drafter = load_drafter(method, first, "random", tree=tree, engine="static")
    config = GenerateConfig(max_new_tokens=12, engine="static")
    run(first, drafter, PROMPT, config)
    out = run(second, drafter, PROMPT, config)
    assert out.token_ids == run(second, PlainDrafter(), PROMPT, config).token_ids
    fresh = load_drafter(method, second, "random", tree=tree, engine="static")
    assert out.accept_lengths == run(second, fresh, PROMPT, config).accept_lengths


def test_a_random_draft_vocabulary_past_the_targets_is_one_line():
    """`random_vocab` (timing's --draft-vocab) of the whole vocabulary is the full one; a
    larger one is a one-line error (they were an AttributeError and a ValueError)."""
    target = tiny_llama(vocab_size=97)
    full = load_drafter("gumiho", target, "random", random_vocab=97)
    assert full.model.d2t is None
    with pytest.raises(GumihoError, match="--draft-vocab"):
        load_drafter("gumiho", target, "random", random_vocab=98)
