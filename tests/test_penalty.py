"""The penalties: each tree row penalised as transformers (repetition) and vLLM (presence,
frequency) penalise its sequence, and greedy decoding with them equal to transformers'
`generate(repetition_penalty=...)`, and to plain decoding's, for every drafter."""

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from gumiho.config import TreeConfig
from gumiho.drafters import load_drafter
from gumiho.engine import GenerateConfig, run
from gumiho.penalty import AnswerPenalty, RepetitionPenalty, penalize, penalties
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


def answer_penalised(logits, answer, presence, frequency):
    """vLLM's presence and frequency penalties over one sequence's answer, written out
    (in float32, in the order penalty.subtracted rounds them)."""
    logits = logits.clone()
    for token in set(answer):
        count = torch.tensor(float(answer.count(token)))
        logits[token] = logits[token] - (frequency * count + presence * torch.tensor(1.0))
    return logits


@pytest.mark.host
@pytest.mark.parametrize("by_columns", [True, False])
def test_each_tree_row_gets_presence_and_frequency_over_its_own_answer(by_columns):
    """Row i's presence and frequency penalties count the answer so far and the tree
    tokens below the root on its own path (a token twice on a path counts twice; the
    root's token, the answer's last, once), bit for bit as written out per sequence; after
    a repetition penalty too (`penalties`, vLLM's order)."""
    # root 7 -> {1: 3, 2: 5}; 1 -> {3: 7, 4: 3}; 3 -> {5: 3}; 2 -> {6: 11}
    tokens = torch.tensor([7, 3, 5, 7, 3, 3, 11])
    tree = DraftTree.from_parents(tokens, torch.tensor([-1, 0, 0, 1, 1, 3, 2]))
    prompt, generated = torch.tensor([1, 2, 2, 4, 11]), [6, 3, 6, 7]  # ends with the root
    logits = torch.randn(7, 16, generator=torch.Generator().manual_seed(1)) * 3
    answer_only = AnswerPenalty(0.4, 0.7, 16, torch.device("cpu"))
    both = penalties(1.5, 0.4, 0.7, 16, prompt)
    for penalty in (answer_only, *both.parts):
        penalty.by_columns = by_columns
    for penalty in (answer_only, both):
        penalty.add(torch.tensor(generated))
    got, got_both = (p.rows(logits, tree.tokens, tree.verify_mask)
                     for p in (answer_only, both))
    parents = tree.parents.tolist()
    for i in range(7):
        path, node = [], i
        while node > 0:
            path.insert(0, tokens[node].item())
            node = parents[node]
        answer = generated + path
        assert torch.equal(got[i], answer_penalised(logits[i], answer, 0.4, 0.7)), i
        sequence = torch.cat([prompt, torch.tensor(answer)])
        repeated = RepetitionPenaltyLogitsProcessor(1.5)(sequence[None], logits[i:i + 1])[0]
        assert torch.equal(got_both[i], answer_penalised(repeated, answer, 0.4, 0.7)), i
    assert got[5, 3] == answer_penalised(logits[5], [3] * 3, 0.4, 0.7)[3]  # once + twice on path
    assert got[0, 11] == logits[0, 11]  # in the prompt only
    assert torch.equal(answer_only.last(logits[:1]), got[:1])


@pytest.mark.host
@pytest.mark.parametrize("by_columns", [True, False])
def test_a_drafter_gets_presence_and_frequency_over_its_own_vocabulary(by_columns):
    ids = torch.tensor([9, 2, 14, 4, 0, 11, 7, 3, 15, 6])  # draft id -> target id
    penalty = AnswerPenalty(-0.5, 1.2, 16, torch.device("cpu"))
    penalty.by_columns = by_columns
    penalty.add(torch.tensor([2, 7, 7, 5]))
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(2)) * 3
    got = penalty.drafted(logits.clone(), ids)
    # target 2 once, 7 twice; 5 is not in the draft vocabulary
    want = answer_penalised(logits.T, [1, 6, 6], -0.5, 1.2).T
    assert torch.equal(got, want) and (got != logits).sum() == 4


@pytest.fixture(scope="module")
def answer_penalised_greedy(smollm2):
    """Plain greedy decoding's answer to the reference prompt with presence and frequency
    penalties of 0.6 and 0.8 (tried: 0.3 / 0.3 left the 24 tokens as they were)."""
    from gumiho import SpeculativeGenerator

    ids = smollm2.chat_ids(PROMPT)
    plain = SpeculativeGenerator.load(smollm2, "ar")
    return ids, plain.generate(ids, N, presence_penalty=0.6, frequency_penalty=0.8).token_ids


def test_greedy_with_presence_and_frequency_is_plain_decodings(smollm2, reference,
                                                               answer_penalised_greedy):
    """Prompt lookup, the shipped Gumiho drafter, an oracle drafter proposing the whole
    answer, and Medusa sampling from the top 1, with a repetition penalty as well: each
    gives plain decoding's answer under the same penalties."""
    from gumiho import SpeculativeGenerator

    ids, want = answer_penalised_greedy
    assert want != reference[1].token_ids[:len(want)]  # the penalties change the answer
    settings = {"presence_penalty": 0.6, "frequency_penalty": 0.8}
    lookup = SpeculativeGenerator.load(smollm2, "lookup")
    assert lookup.generate(ids, N, **settings).token_ids == want
    gumiho = SpeculativeGenerator.load(smollm2, "gumiho", "gumiho/assets/smollm2/gumiho",
                                       total_tokens=8)
    out = gumiho.generate(ids, N, **settings)
    assert out.token_ids == want and out.tau > 1.1, out.tau
    oracle = oracle_drafter("gumiho", smollm2, ids + want, TreeConfig.for_method("gumiho"))
    out = run(smollm2, oracle, ids, GenerateConfig(max_new_tokens=N, **settings))
    assert out.token_ids == want and out.tau > 4
    medusa = load_drafter("medusa", smollm2, "gumiho/assets/smollm2/medusa",
                          tree=TreeConfig.for_method("medusa", total_tokens=16))
    plain = SpeculativeGenerator.load(smollm2, "ar")
    with_all = {**settings, "repetition_penalty": 1.2}
    want_all = plain.generate(ids, N, **with_all).token_ids
    out = run(smollm2, medusa, ids, GenerateConfig(max_new_tokens=N, temperature=0.8, seed=3,
                                                   top_k=1, **with_all))
    assert out.token_ids == want_all
    assert gumiho.generate(ids, N, **with_all).token_ids == want_all


@pytest.mark.host
def test_a_logit_bias_reaches_every_row_and_a_drafters_vocabulary():
    """LogitBias adds each bias to its token's logit in every verify row and in a draft
    vocabulary's columns (target ids mapped to draft ids; ids it lacks left out)."""
    from gumiho.penalty import LogitBias

    bias = LogitBias({3: -100.0, 7: 2.5, 14: 1.0}, torch.device("cpu"))
    logits = torch.randn(4, 16, generator=torch.Generator().manual_seed(4))
    want = logits.clone()
    want[:, 3] -= 100
    want[:, 7] += 2.5
    want[:, 14] += 1.0
    assert torch.equal(bias.rows(logits, torch.zeros(4, dtype=torch.long),
                                 torch.ones(4, 4, dtype=torch.bool)), want)
    ids = torch.tensor([9, 7, 2, 3, 11])  # draft id -> target id: no 14 in it
    drafted = bias.drafted(logits[:, :5].clone(), ids)
    assert torch.equal(drafted[:, [0, 2, 4]], logits[:, [0, 2, 4]])
    assert torch.equal(drafted[:, 1], logits[:, 1] + 2.5)
    assert torch.equal(drafted[:, 3], logits[:, 3] - 100)


def test_greedy_with_a_logit_bias_is_transformers_generate(smollm2, reference):
    """transformers' `sequence_bias` over one-token sequences, with a repetition penalty
    after it, is what plain decoding, lookup, the shipped Gumiho drafter and an oracle
    drafter give with `logit_bias`."""
    from gumiho import SpeculativeGenerator

    ids, full = reference[0], reference[1].token_ids
    bias = {full[3]: -100.0, full[1]: -3.0, 11: 4.0}  # " paper" banned, "." lowered
    with torch.inference_mode():
        out = smollm2.model.generate(
            torch.tensor([ids], device=smollm2.device), max_new_tokens=N, do_sample=False,
            sequence_bias={(i,): b for i, b in bias.items()}, repetition_penalty=1.2)
    want = out[0, len(ids):].tolist()
    assert want[:4] != full[:4] and full[3] not in want
    settings = {"logit_bias": bias, "repetition_penalty": 1.2}
    for method, draft in (("ar", None), ("lookup", None),
                          ("gumiho", "gumiho/assets/smollm2/gumiho")):
        gen = SpeculativeGenerator.load(smollm2, method, draft,
                                        **({"total_tokens": 8} if draft else {}))
        assert gen.generate(ids, N, **settings).token_ids == want, method
    oracle = oracle_drafter("gumiho", smollm2, ids + want, TreeConfig.for_method("gumiho"))
    out = run(smollm2, oracle, ids, GenerateConfig(max_new_tokens=N, **settings))
    assert out.token_ids == want and out.tau > 4


@pytest.mark.host
@pytest.mark.parametrize("size", [1, 2, 3])
def test_each_tree_row_bans_repeated_ngrams_over_its_own_sequence(size):
    """NoRepeatNGram: row i's banned tokens are transformers' NoRepeatNGramLogitsProcessor's
    over the prompt, the generated tokens and the row's own path below the root, bit for
    bit; the next token's (`last`) over the committed sequence."""
    from transformers import NoRepeatNGramLogitsProcessor

    from gumiho.penalty import NoRepeatNGram

    # root 4 -> {1: 5, 2: 9}; 1 -> {3: 4, 4: 5}; 3 -> {5: 5}; 2 -> {6: 4}
    tokens = torch.tensor([4, 5, 9, 4, 5, 5, 4])
    tree = DraftTree.from_parents(tokens, torch.tensor([-1, 0, 0, 1, 1, 3, 2]))
    prompt, generated = torch.tensor([4, 5, 9, 4, 5, 7]), torch.tensor([5, 4])
    part = NoRepeatNGram(size, prompt)
    part.add(generated)
    logits = torch.randn(7, 12, generator=torch.Generator().manual_seed(5))
    got = part.rows(logits, tree.tokens, tree.verify_mask)
    parents = tree.parents.tolist()
    processor = NoRepeatNGramLogitsProcessor(size)
    banned_somewhere = False
    for i in range(7):
        path, node = [], i
        while node > 0:
            path.insert(0, tokens[node].item())
            node = parents[node]
        sequence = torch.cat([prompt, generated, torch.tensor(path, dtype=torch.long)])
        want = processor(sequence[None], logits[i:i + 1].clone())
        assert torch.equal(got[i], want[0]), i
        banned_somewhere |= bool(torch.isinf(want).any())
    assert banned_somewhere
    sequence = torch.cat([prompt, generated])
    assert torch.equal(part.last(logits[:1]), processor(sequence[None], logits[:1].clone()))


@pytest.mark.host
def test_banned_ngrams_after_a_sequence_shorter_than_n_are_transformers():
    """A committed sequence shorter than n - 1 (a short raw prompt) and a path below it:
    the tokens banned are transformers' over the whole sequence (a negative slice start
    once cut the sequence's front off, letting a repeated n-gram through a draft)."""
    from transformers import NoRepeatNGramLogitsProcessor

    from gumiho.penalty import NoRepeatNGram

    assert NoRepeatNGram(4, torch.tensor([0, 0])).banned([1, 1, 0, 0, 1]) == {1}
    rng = torch.Generator().manual_seed(3)
    checked = 0
    for _ in range(3000):
        size = int(torch.randint(2, 6, (1,), generator=rng))
        committed = torch.randint(3, (int(torch.randint(1, 4, (1,), generator=rng)),),
                                  generator=rng)
        path = torch.randint(3, (int(torch.randint(0, 7, (1,), generator=rng)),),
                             generator=rng).tolist()
        part = NoRepeatNGram(size, committed)
        sequence = torch.cat([committed, torch.tensor(path, dtype=torch.long)])
        want = NoRepeatNGramLogitsProcessor(size)(sequence[None], torch.zeros(1, 3))
        assert part.banned(path) == set(torch.isinf(want[0]).nonzero().flatten().tolist()), \
            (size, committed.tolist(), path)
        checked += bool(torch.isinf(want).any())
    assert checked > 300


def test_greedy_with_no_repeat_ngrams_is_transformers_generate(smollm2, reference):
    """transformers' greedy answer with no_repeat_ngram_size 3 (the reference answer repeats
    "A paperclip is used to"), token for token, for plain decoding, lookup, the shipped
    Gumiho drafter and an oracle drafter proposing it."""
    from gumiho import SpeculativeGenerator

    ids, full = reference[0], reference[1].token_ids
    with torch.inference_mode():
        out = smollm2.model.generate(torch.tensor([ids], device=smollm2.device),
                                     max_new_tokens=N, do_sample=False,
                                     no_repeat_ngram_size=3)
    want = out[0, len(ids):].tolist()
    assert want != full
    for method, draft in (("ar", None), ("lookup", None),
                          ("gumiho", "gumiho/assets/smollm2/gumiho")):
        gen = SpeculativeGenerator.load(smollm2, method, draft,
                                        **({"total_tokens": 8} if draft else {}))
        assert gen.generate(ids, N, no_repeat_ngram_size=3).token_ids == want, method
    oracle = oracle_drafter("gumiho", smollm2, ids + want, TreeConfig.for_method("gumiho"))
    out = run(smollm2, oracle, ids, GenerateConfig(max_new_tokens=N, no_repeat_ngram_size=3))
    assert out.token_ids == want and out.tau > 4


def test_sampling_from_the_top_1_with_every_setting_is_greedy(smollm2, reference):
    """The sampling branch applies a logit bias, no-repeat n-grams and min_tokens as the
    greedy one does: Medusa's heads sampling from the top 1 give plain greedy's answer."""
    from gumiho import SpeculativeGenerator

    ids, full = reference[0], reference[1].token_ids
    settings = {"logit_bias": {full[1]: -3.0}, "no_repeat_ngram_size": 3,
                "min_tokens": 8}
    want = SpeculativeGenerator.load(smollm2, "ar").generate(ids, N, **settings).token_ids
    assert want != full
    medusa = load_drafter("medusa", smollm2, "gumiho/assets/smollm2/medusa",
                          tree=TreeConfig.for_method("medusa", total_tokens=16))
    out = run(smollm2, medusa, ids, GenerateConfig(max_new_tokens=N, temperature=0.8,
                                                   seed=3, top_k=1, **settings))
    assert out.token_ids == want and out.tau > 1.1, out.tau
