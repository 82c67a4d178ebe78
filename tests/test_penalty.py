"""The repetition penalty: each tree row penalised as transformers penalises its sequence,
and greedy decoding with it equal to transformers' `generate(repetition_penalty=...)`
for plain decoding and every drafter."""

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from gumiho.config import TreeConfig
from gumiho.drafters import load_drafter
from gumiho.engine import GenerateConfig, run
from gumiho.penalty import RepetitionPenalty, penalize
from gumiho.tree import DraftTree

from conftest import REFERENCE_PROMPT as PROMPT
from conftest import REFERENCE_TOKENS as N
from drafters_for_tests import oracle_drafter

# strong enough that a verify row which skipped its own drafted path would pick a token
# transformers does not (tried: 1.3 did not show it on this prompt, 2 does)
PENALTY = 2.0


@pytest.mark.host
@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_penalize_is_transformers_processor(penalty):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g) * 4
    ids = torch.randint(0, 50, (3, 30), generator=g)  # repeats within a row, some negative
    seen = torch.zeros(3, 50, dtype=torch.bool).scatter_(1, ids, True)
    want = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits.clone())
    got = penalize(logits, seen, penalty)
    assert torch.equal(got, want)
    assert not torch.equal(got, logits)


@pytest.mark.host
@pytest.mark.parametrize("by_columns", [True, False])
def test_each_tree_row_is_penalised_over_its_own_sequence(by_columns):
    """Row i of a verify is penalised over the prompt, the generated tokens and the tree
    tokens its row of the verify mask sees (its ancestors and itself), bit for bit as
    transformers penalises that whole sequence; tokens in other branches are not. Both
    ways of computing it (the CPU's by columns, other devices' by a whole mask)."""
    # root 7 -> {1: 3, 2: 5}; 1 -> {3: 9, 4: 7}; 3 -> {5: 3}; 2 -> {6: 11}
    tokens = torch.tensor([7, 3, 5, 9, 7, 3, 11])
    tree = DraftTree.from_parents(tokens, torch.tensor([-1, 0, 0, 1, 1, 3, 2]))
    prompt, generated = torch.tensor([1, 2, 2, 4]), torch.tensor([6, 7])
    penalty = RepetitionPenalty(1.5, 16, prompt)
    penalty.by_columns = by_columns
    penalty.add(generated)
    logits = torch.randn(7, 16, generator=torch.Generator().manual_seed(1)) * 3
    got = penalty.rows(logits, tree.tokens, tree.verify_mask)
    parents = tree.parents.tolist()
    for i in range(7):
        path, node = [], i
        while node > 0:  # the root's token is the last generated one, already in the text
            path.insert(0, tokens[node].item())
            node = parents[node]
        sequence = torch.cat([prompt, generated, torch.tensor(path, dtype=torch.long)])
        want = RepetitionPenaltyLogitsProcessor(1.5)(sequence[None], logits[i:i + 1].clone())
        assert torch.equal(got[i], want[0]), i
    # a token on another branch only: 11 (node 6) is not penalised at node 3's row
    assert got[3, 11] == logits[3, 11] and got[6, 11] != logits[6, 11]
    assert torch.equal(penalty.last(logits[:1]), penalize(logits[:1], penalty.seen, 1.5))


@pytest.fixture(scope="module")
def penalised(smollm2):
    """transformers' greedy answer to the reference prompt with repetition_penalty PENALTY,
    which differs from the answer without it."""
    ids = smollm2.chat_ids(PROMPT)
    with torch.inference_mode():
        out = smollm2.model.generate(torch.tensor([ids], device=smollm2.device),
                                     max_new_tokens=N, do_sample=False,
                                     repetition_penalty=PENALTY)
    return ids, out[0, len(ids):].tolist()


def test_greedy_with_a_penalty_is_transformers_generate(smollm2, reference, penalised):
    """Plain decoding, prompt lookup, the shipped Gumiho drafter and an oracle drafter that
    proposes the whole answer (so every accepted row's penalty covers its own drafted
    path) all give transformers' penalised greedy answer."""
    from gumiho import SpeculativeGenerator

    ids, want = penalised
    assert want != reference[1].token_ids[:len(want)]  # the penalty changes the answer
    config = GenerateConfig(max_new_tokens=N, repetition_penalty=PENALTY)
    plain = SpeculativeGenerator.load(smollm2, "ar")
    assert plain.generate(ids, N, repetition_penalty=PENALTY).token_ids == want
    lookup = SpeculativeGenerator.load(smollm2, "lookup")
    assert lookup.generate(ids, N, repetition_penalty=PENALTY).token_ids == want
    gumiho = SpeculativeGenerator.load(smollm2, "gumiho", "gumiho/assets/smollm2/gumiho",
                                       total_tokens=8)
    out = gumiho.generate(ids, N, repetition_penalty=PENALTY)
    assert out.token_ids == want and out.tau > 1.1, out.tau
    oracle = oracle_drafter("gumiho", smollm2, ids + want, TreeConfig.for_method("gumiho"))
    out = run(smollm2, oracle, ids, config)
    assert out.token_ids == want and out.tau > 4


def test_sampling_from_the_top_1_with_a_penalty_is_penalised_greedy(smollm2, penalised):
    """The sampling branch penalises too: at T > 0 with top_k 1 the shipped Medusa heads'
    answer is transformers' penalised greedy one, drafts taken on the way."""
    ids, want = penalised
    medusa = load_drafter("medusa", smollm2, "gumiho/assets/smollm2/medusa",
                          tree=TreeConfig.for_method("medusa", total_tokens=16))
    config = GenerateConfig(max_new_tokens=N, temperature=0.8, seed=3, top_k=1,
                            repetition_penalty=PENALTY)
    out = run(smollm2, medusa, ids, config)
    assert out.token_ids == want and out.tau > 1.1, out.tau


@pytest.mark.host
@pytest.mark.parametrize("by_columns", [True, False])
def test_a_drafter_penalises_its_own_vocabulary_over_the_sequence(by_columns):
    """`drafted`: a drafter's logits over a draft vocabulary (target ids `ids`) penalised
    where the target id is in the sequence so far, in place; refreshed as tokens join."""
    ids = torch.tensor([9, 2, 14, 4, 0, 11, 7, 3, 15, 6])  # draft id -> target id
    penalty = RepetitionPenalty(1.4, 16, torch.tensor([2, 4, 4, 13]))
    penalty.by_columns = by_columns
    logits = torch.randn(2, 3, 10, generator=torch.Generator().manual_seed(2)) * 3
    for joined in ([], [7, 9]):
        penalty.add(torch.tensor(joined, dtype=torch.long))
        got = penalty.drafted(logits.clone(), ids)
        assert torch.equal(got, penalize(logits, penalty.seen[ids], 1.4))
        assert (got != logits).any(-1).any(-1).tolist() == [True, True]
        assert torch.equal(got[..., 6] != logits[..., 6], torch.full((2, 3), bool(joined)))
    full = penalty.drafted(torch.randn(16), None)  # a drafter over the whole vocabulary
    assert full.shape == (16,)


def test_the_shipped_drafter_drafts_with_the_penalty(smollm2, monkeypatch):
    """The shipped Gumiho drafter, told the penalty, proposes what the penalised target
    picks more often than without it (SmolLM2, a penalty of 1.3, same answer either way)."""
    from gumiho import SpeculativeGenerator, engine

    gen = SpeculativeGenerator.load(smollm2, "gumiho", "gumiho/assets/smollm2/gumiho",
                                    total_tokens=8)
    prompt = "Write a short poem about the sea."
    told = gen.generate(prompt, 64, repetition_penalty=1.3)
    share = engine.share_penalty
    monkeypatch.setattr(engine, "share_penalty", lambda drafter, penalty: share(drafter, None))
    untold = gen.generate(prompt, 64, repetition_penalty=1.3)
    assert told.token_ids == untold.token_ids
    assert told.tau > untold.tau + 0.2, (told.tau, untold.tau)
