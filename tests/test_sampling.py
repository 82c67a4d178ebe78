"""Speculative sampling preserves the target's distribution (chi-square, fixed seeds)."""

import math

import pytest
import torch

from gumiho.engine import GenerateConfig, run
from gumiho.sampling import accept_sampling, cut, draw, truncated
from gumiho.tree import DraftTree

from conftest import tiny_llama
from drafters_for_tests import RandomDrafter


def chi_square_rejects(counts: torch.Tensor, probs: torch.Tensor, z: float = 3.09) -> bool:
    """True when counts are implausible under probs at level ~0.001 (Wilson-Hilferty)."""
    n = counts.sum()
    keep = probs * n >= 1e-9
    expected = probs[keep] * n
    stat = float(((counts[keep] - expected) ** 2 / expected).sum())
    df = int(keep.sum()) - 1
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat > critical


@pytest.mark.host
def test_a_draw_per_row_follows_each_rows_distribution():
    """`draw` (one uniform number a row, against cumulative sums) samples as multinomial
    would: each row its own distribution, never a token of probability 0 (the first, the
    last and some between here), and the test has the power to tell a near one."""
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(3, 40, generator=g) * 2, -1)
    probs[:, [0, 7, 8, 39]] = 0
    probs[1] = torch.roll(probs[1], 5)  # the rows differ: zeros elsewhere in row 1
    probs /= probs.sum(-1, keepdim=True)
    counts = torch.zeros(3, 40)
    for _ in range(400):
        picks = draw(probs.repeat(50, 1), g).view(50, 3)
        for row in range(3):
            counts[row] += torch.bincount(picks[:, row], minlength=40)
    for row in range(3):
        assert counts[row][probs[row] == 0].sum() == 0
        assert not chi_square_rejects(counts[row], probs[row])
    assert chi_square_rejects(counts[0], torch.softmax(probs[0].log().clamp(min=-50) * 0.9, -1))


def small_tree():
    # root -> {1: token 2, 2: token 0, 3: token 4}; node 1 -> {4: token 1, 5: token 3}
    tokens = torch.tensor([5, 2, 0, 4, 1, 3])
    parents = torch.tensor([-1, 0, 0, 0, 1, 1])
    return DraftTree.from_parents(tokens, parents)


@pytest.mark.host
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_accept_sampling_emits_target_distribution(temperature):
    tree = small_tree()
    logits = torch.randn(6, 6, generator=torch.Generator().manual_seed(3), device="cpu") * 1.5
    p = torch.softmax(logits / temperature, -1)
    gen = torch.Generator().manual_seed(0)
    first = torch.zeros(6)
    second_after_2 = torch.zeros(6)  # the token after token 2, i.e. after node 1 was taken
    for _ in range(12000):
        accepted, bonus = accept_sampling(tree, logits, temperature, gen)
        emitted = tree.tokens[accepted[1:]].tolist() + [int(bonus)]
        first[emitted[0]] += 1
        if emitted[0] == 2:
            second_after_2[emitted[1]] += 1
    assert not chi_square_rejects(first, p[0])
    assert not chi_square_rejects(second_after_2, p[1])
    # The statistic has power: a mildly different distribution is rejected.
    assert chi_square_rejects(first, torch.softmax(logits[0] / (temperature * 1.15), -1))


def cut_by_sorting(probs: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0
                   ) -> torch.Tensor:
    """The top-k / top-p / min-p cut by a full sort, token by token, normalised: the
    reference."""
    out = torch.zeros_like(probs)
    for row, p in enumerate(probs):
        values, order = p.double().sort(descending=True)
        keep = len(values) if top_k == 0 else top_k
        while keep < len(values) and values[keep] == values[keep - 1]:
            keep += 1  # a tie with the last kept token stays
        values, order = values[:keep], order[:keep]
        mass, need = values.sum(), 0
        while need < keep and values[:need].sum() < top_p * mass:
            need += 1
        while need < keep and values[need] == values[need - 1]:
            need += 1
        while need > 1 and p[order[need - 1]] < min_p * p.max():  # in probs' dtype, as HF
            need -= 1
        out[row, order[:need]] = p[order[:need]]
    return out / out.sum(-1, keepdim=True)


@pytest.mark.host
@pytest.mark.parametrize("top_k, top_p, min_p", [
    (0, 0.9, 0.0), (20, 1.0, 0.0), (20, 0.7, 0.0), (0, 0.3, 0.0), (0, 1e-6, 0.0),
    (1, 1.0, 0.0), (500, 0.95, 0.0), (0, 1.0, 0.05), (0, 1.0, 0.3), (20, 0.9, 0.1),
    (0, 1.0, 1.0)])
def test_the_cut_keeps_what_transformers_warpers_keep(top_k, top_p, min_p):
    """`truncated` keeps, row by row, the tokens transformers' TopK, TopP and MinP warpers
    keep (in that order, after the temperature), with their probabilities renormalised,
    and the tokens a full sort keeps."""
    from transformers import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    g = torch.Generator().manual_seed(top_k + int(top_p * 100))
    logits = torch.randn(6, 300, generator=g) * torch.tensor([0.3, 1, 2, 4, 8, 16])[:, None]
    want = logits / 0.8
    if top_k:
        want = TopKLogitsWarper(top_k)(None, want)
    if top_p < 1:
        want = TopPLogitsWarper(top_p)(None, want)
    if min_p:
        want = MinPLogitsWarper(min_p)(None, want)
    want = torch.softmax(want, -1)
    got = truncated(torch.softmax(logits / 0.8, -1), top_k, top_p, min_p)
    got = got / got.sum(-1, keepdim=True)
    assert torch.equal(got > 0, want > 0)
    torch.testing.assert_close(got, want)
    reference = cut_by_sorting(torch.softmax(logits / 0.8, -1), top_k, top_p, min_p)
    assert torch.equal(got > 0, reference > 0)
    if min_p:  # the floor cuts here, and a row keeps more than its top token somewhere
        assert (got > 0).sum() < (truncated(torch.softmax(logits / 0.8, -1), top_k, top_p)
                                  > 0).sum()
        assert min_p == 1.0 or ((got > 0).sum(-1) > 1).any()


@pytest.mark.host
def test_a_wide_nucleus_is_found_past_the_first_rounds_and_ties_stay_together():
    """On the CPU the nucleus is sought among the 64, then 512 likeliest, then all: rows
    whose nucleus needs ~40, ~300 and ~3,000 of 5,000 tokens get what a full sort gives, and
    a row of equal probabilities keeps all of them or none."""
    g = torch.Generator().manual_seed(0)
    # geometric rows (a nucleus of 0.9 holds about ln(10) / rate tokens), shuffled
    rows = [-torch.arange(5000.0)[torch.randperm(5000, generator=g)] * rate
            for rate in (math.log(10) / 40, math.log(10) / 300, 5e-4)]
    tied = torch.zeros(2, 5000)
    tied[0, :10] = 12.0  # ten equally likely tokens holding 99.7%, nothing else close
    tied[1, 4900:] = 12.0  # a hundred, past the first window of 64
    probs = torch.softmax(torch.cat([torch.stack(rows), tied]), -1)
    for top_k, top_p in [(0, 0.9), (0, 0.5), (2000, 0.95), (3, 1.0), (0, 0.35), (63, 1.0)]:
        got = truncated(probs, top_k, top_p)
        want = cut_by_sorting(probs, top_k, top_p)
        assert torch.equal(got > 0, want > 0), (top_k, top_p)
        assert torch.equal(got[got > 0], probs[got > 0])  # cut, never reweighted
        # the ties: all of them, whatever k or p (at k = 63 row 3's edge lies among its
        # 4,990 equal small tokens: all of those stay too, as transformers' TopK keeps them)
        assert (got[3] > 0).sum() == (5000 if top_k == 63 else 10)
        assert (got[4] > 0).sum() == 100
    sizes = (truncated(probs, 0, 0.9) > 0).sum(-1).tolist()
    assert sizes[0] < 64 < sizes[1] < 512 < sizes[2], sizes  # each round was needed
    floor = truncated(probs[:3], 0, 1.0, 0.01)  # min-p alone: ~80, ~600 and ~4,600 tokens
    assert torch.equal(floor > 0, cut_by_sorting(probs[:3], 0, 1.0, 0.01) > 0)
    sizes = (floor > 0).sum(-1).tolist()
    assert sizes[0] > 64 and sizes[1] > 512, sizes


def exact_marginals(target, prompt, temperature, vocab, top_k=0, top_p=1.0, min_p=0.0,
                    penalty=1.0, presence=0.0, frequency=0.0):
    """P(t2) and P(t3) of ancestral sampling from the target, by enumeration (a repetition
    penalty as transformers' processor applies it to each whole sequence, then presence
    and frequency penalties over each sequence's answer, as vLLM applies them)."""
    from transformers import RepetitionPenaltyLogitsProcessor

    with torch.inference_mode():
        def probs(seqs):
            answers = [seq[len(prompt):] for seq in seqs]
            seqs = torch.tensor(seqs)
            logits = target.model(seqs).logits[:, -1].float()
            if penalty != 1.0:
                logits = RepetitionPenaltyLogitsProcessor(penalty)(seqs, logits)
            for row, answer in enumerate(answers):
                for token in set(answer):
                    logits[row, token] -= presence + frequency * answer.count(token)
            p = torch.softmax(logits / temperature, -1)
            p = truncated(p, top_k, top_p, min_p)
            return p / p.sum(-1, keepdim=True)

        p1 = probs([prompt])[0]  # (V,)
        p2 = probs([prompt + [a] for a in range(vocab)])  # (V, V): [t1, t2]
        p3 = probs([prompt + [a, b] for a in range(vocab) for b in range(vocab)]).view(
            vocab, vocab, vocab)
    joint12 = p1[:, None] * p2
    return joint12.sum(0), (joint12[:, :, None] * p3).sum((0, 1))


def assert_samples_match_target(target, drafter, prompt, vocab, temperature=1.0,
                                runs=1500, top_k=0, top_p=1.0, min_p=0.0, penalty=1.0,
                                presence=0.0, frequency=0.0) -> int:
    """Sample 3 tokens `runs` times through the loop with `drafter`; the 2nd and 3rd
    tokens' counts must fit the target's exact marginals (none where they are 0). Returns
    the drafts accepted in the first cycles (a test where none are accepted checks
    nothing)."""
    want2, want3 = exact_marginals(target, prompt, temperature, vocab, top_k, top_p, min_p,
                                   penalty, presence, frequency)
    got2, got3 = torch.zeros(vocab), torch.zeros(vocab)
    drafted = 0
    for seed in range(runs):
        config = GenerateConfig(max_new_tokens=3, temperature=temperature, top_k=top_k,
                                top_p=top_p, min_p=min_p, repetition_penalty=penalty,
                                presence_penalty=presence, frequency_penalty=frequency,
                                seed=seed)
        out = run(target, drafter, prompt, config)
        got2[out.token_ids[1]] += 1
        got3[out.token_ids[2]] += 1
        drafted += out.accept_lengths[1] - 1
    assert not chi_square_rejects(got2, want2)
    assert not chi_square_rejects(got3, want3)
    assert got2[want2 == 0].sum() == 0 and got3[want3 == 0].sum() == 0
    return drafted


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_speculative_sampling_end_to_end_matches_target(temperature):
    vocab = 16
    target = tiny_llama(vocab_size=vocab, seed=1, logit_scale=25.0)
    drafted = assert_samples_match_target(target, RandomDrafter(vocab, size=24, seed=0),
                                          [3, 9, 1, 12], vocab, temperature)
    assert drafted > 200, "too few accepted drafts for the test to mean anything"


def test_speculative_sampling_with_top_k_and_top_p_matches_the_cut_target():
    """With the target's distribution cut (top-k 6, then the 0.8 nucleus) the loop emits
    the cut distribution: the acceptance rule draws every node's token from it."""
    vocab = 16
    target = tiny_llama(vocab_size=vocab, seed=1, logit_scale=25.0)
    want2, want3 = exact_marginals(target, [3, 9, 1, 12], 1.0, vocab, 6, 0.8)
    assert (want2 == 0).sum() >= 4 and (want3 == 0).sum() >= 4  # the cut cuts
    drafted = assert_samples_match_target(target, RandomDrafter(vocab, size=24, seed=0),
                                          [3, 9, 1, 12], vocab, 1.0, top_k=6, top_p=0.8)
    assert drafted > 200, "too few accepted drafts for the test to mean anything"


def test_speculative_sampling_with_min_p_and_a_repetition_penalty_matches_the_target():
    """With a min-p floor and a repetition penalty (each tree node's logits penalised over
    its own sequence) the loop emits what sampling the penalised, cut target token by token
    emits; the penalty moves the marginals (the test can tell), and so does min-p."""
    vocab = 16
    target = tiny_llama(vocab_size=vocab, seed=1, logit_scale=25.0)
    prompt = [3, 9, 1, 12]
    plain2, plain3 = exact_marginals(target, prompt, 1.0, vocab)
    want2, want3 = exact_marginals(target, prompt, 1.0, vocab, min_p=0.05, penalty=3.0)
    assert (want2 - plain2).abs().sum() > 0.2 and (want3 - plain3).abs().sum() > 0.2
    assert (want2 == 0).sum() > (plain2 == 0).sum()
    drafted = assert_samples_match_target(target, RandomDrafter(vocab, size=24, seed=0),
                                          prompt, vocab, 1.0, min_p=0.05, penalty=3.0)
    assert drafted > 200, "too few accepted drafts for the test to mean anything"


def test_speculative_sampling_with_presence_and_frequency_penalties_matches_the_target():
    """With presence and frequency penalties (over each node's own answer: the tokens so
    far and its path below the root) the loop emits what sampling the penalised target
    token by token emits; the penalties move the third token's marginal (the test can
    tell)."""
    vocab = 16
    target = tiny_llama(vocab_size=vocab, seed=1, logit_scale=25.0)
    prompt = [3, 9, 1, 12]
    _, plain3 = exact_marginals(target, prompt, 1.0, vocab)
    _, want3 = exact_marginals(target, prompt, 1.0, vocab, presence=1.5, frequency=2.0)
    assert (want3 - plain3).abs().sum() > 0.2
    drafted = assert_samples_match_target(target, RandomDrafter(vocab, size=24, seed=0),
                                          prompt, vocab, 1.0, presence=1.5, frequency=2.0)
    assert drafted > 200, "too few accepted drafts for the test to mean anything"


@pytest.mark.host
def test_equal_sibling_tokens_do_not_bias_sampling():
    # root -> {1: token 2, 2: token 2}; node 1 -> {3: token 1}, node 2 -> {4: token 3}.
    # Nodes 1 and 2 share their context, so the target's logits there are equal; taking
    # whichever branch matches deeper would over-emit token 3 after token 2.
    tree = DraftTree.from_parents(torch.tensor([5, 2, 2, 1, 3]),
                                  torch.tensor([-1, 0, 0, 1, 2]))
    logits = torch.randn(5, 6, generator=torch.Generator().manual_seed(4), device="cpu")
    logits[0, 2] += 3.0  # token 2 comes first most of the time
    logits[2] = logits[1]
    gen = torch.Generator().manual_seed(1)
    second = torch.zeros(6)
    for _ in range(8000):
        accepted, bonus = accept_sampling(tree, logits, 1.0, gen)
        emitted = tree.tokens[accepted[1:]].tolist() + [int(bonus)]
        if emitted[0] == 2:
            second[emitted[1]] += 1
    assert not chi_square_rejects(second, torch.softmax(logits[1], -1))


@pytest.mark.host
def test_a_top_k_larger_than_the_tokens_left_above_zero_keeps_a_small_window():
    """At a low temperature a peaked row leaves fewer than k tokens of probability above 0
    (float32 softmax underflows), so the top-k edge is 0. The CPU's window stops growing
    once it ends in a 0 (every drawable token is in it): it grew to the whole 49,152-token
    vocabulary (5 rounds, the last a full sort: 10x a cycle's cut) before. What it keeps
    is still what a full sort keeps."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 49152, generator=g) * 2
    logits[:, :10] += 15.0  # ten likely tokens; the rest underflow at T = 0.1
    probs = torch.softmax(logits / 0.1, -1)
    assert ((probs > 0).sum(-1) < 50).all()
    for top_k, top_p, min_p in [(50, 1.0, 0.0), (50, 0.9, 0.0), (50, 1.0, 0.01)]:
        values, _ = cut(probs, top_k, top_p, min_p)
        assert values.shape[1] < 49152, (top_k, top_p, min_p)
        got = truncated(probs, top_k, top_p, min_p)
        # top-k alone keeps every token above 0 (fewer than k); the reference's nucleus
        # loop drops float64-negligible ones even at top_p 1.0, so it checks the others
        want = probs > 0 if top_p == 1.0 and not min_p else \
            cut_by_sorting(probs, top_k, top_p, min_p) > 0
        assert torch.equal(got > 0, want)
        assert torch.equal(got[got > 0], probs[got > 0])
