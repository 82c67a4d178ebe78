"""Speculative sampling preserves the target's distribution (chi-square, fixed seeds)."""

import math

import pytest
import torch

from gumiho.engine import GenerateConfig, run
from gumiho.sampling import accept_sampling, draw
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


def exact_marginals(target, prompt, temperature, vocab):
    """P(t2) and P(t3) of ancestral sampling from the target, by enumeration."""
    with torch.inference_mode():
        def probs(seqs):
            return torch.softmax(target.model(torch.tensor(seqs)).logits[:, -1] / temperature, -1)

        p1 = probs([prompt])[0]  # (V,)
        p2 = probs([prompt + [a] for a in range(vocab)])  # (V, V): [t1, t2]
        p3 = probs([prompt + [a, b] for a in range(vocab) for b in range(vocab)]).view(
            vocab, vocab, vocab)
    joint12 = p1[:, None] * p2
    return joint12.sum(0), (joint12[:, :, None] * p3).sum((0, 1))


def assert_samples_match_target(target, drafter, prompt, vocab, temperature=1.0,
                                runs=1500) -> int:
    """Sample 3 tokens `runs` times through the loop with `drafter`; the 2nd and 3rd
    tokens' counts must fit the target's exact marginals. Returns the drafts accepted in
    the first cycles (a test where none are accepted checks nothing)."""
    want2, want3 = exact_marginals(target, prompt, temperature, vocab)
    got2, got3 = torch.zeros(vocab), torch.zeros(vocab)
    drafted = 0
    for seed in range(runs):
        out = run(target, drafter, prompt, GenerateConfig(max_new_tokens=3,
                                                          temperature=temperature, seed=seed))
        got2[out.token_ids[1]] += 1
        got3[out.token_ids[2]] += 1
        drafted += out.accept_lengths[1] - 1
    assert not chi_square_rejects(got2, want2)
    assert not chi_square_rejects(got3, want3)
    return drafted


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_speculative_sampling_end_to_end_matches_target(temperature):
    vocab = 16
    target = tiny_llama(vocab_size=vocab, seed=1, logit_scale=25.0)
    drafted = assert_samples_match_target(target, RandomDrafter(vocab, size=24, seed=0),
                                          [3, 9, 1, 12], vocab, temperature)
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
