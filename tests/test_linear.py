"""Vocabulary-sized projections: oneDNN where MKL is slow, the same product either way, and
the loop's wide verifies going through it while output stays plain decoding's."""

import pytest
import torch

from gumiho import linear
from gumiho.drafters import PlainDrafter, load_drafter
from gumiho.engine import GenerateConfig, run
from gumiho.linear import MIN_OUTPUTS, uses_onednn, vocab_linear

from conftest import DEVICE

needs_onednn = pytest.mark.skipif(linear.ONEDNN_LINEAR is None, reason="torch without oneDNN")


@needs_onednn
@pytest.mark.host
@pytest.mark.parametrize("rows", [1, 3, 4, 11, 16, 40])
def test_vocab_linear_is_the_same_product(rows):
    torch.manual_seed(0)
    weight, bias = torch.randn(MIN_OUTPUTS, 64), torch.randn(MIN_OUTPUTS)
    hidden = torch.randn(1, rows, 64)  # a batch dim, as the target's features have none
    with torch.no_grad():
        for b in (None, bias):
            expected = torch.nn.functional.linear(hidden, weight, b)
            got = vocab_linear(hidden, weight, b)
            assert got.shape == expected.shape
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
            assert got[0].argmax(-1).tolist() == expected[0].argmax(-1).tolist()


@needs_onednn
@pytest.mark.host
def test_only_wide_float32_cpu_products_of_a_large_weight_use_onednn():
    big, small = torch.randn(MIN_OUTPUTS, 8), torch.randn(MIN_OUTPUTS - 1, 8)
    with torch.no_grad():
        assert uses_onednn(torch.randn(4, 8), big)
        assert uses_onednn(torch.randn(1, 4, 8), big)
        assert not uses_onednn(torch.randn(3, 8), big)  # MKL is fast for 1-3 rows
        assert not uses_onednn(torch.randn(4, 8), small)  # and for smaller weights
        assert not uses_onednn(torch.randn(4, 8).bfloat16(), big.bfloat16())
    assert not uses_onednn(torch.randn(4, 8, requires_grad=True), big)  # autograd: torch's


@needs_onednn
@pytest.mark.host
def test_vocab_linear_compiles():
    """Under torch.compile (`--engine compile` on a CPU) a wide product is inductor's to
    lower: handing it the oneDNN op failed in lowering (a verify of 8 tokens)."""
    torch.manual_seed(0)
    weight, hidden = torch.randn(MIN_OUTPUTS, 16), torch.randn(1, 8, 16)
    with torch.no_grad():
        got = torch.compile(vocab_linear, dynamic=False)(hidden, weight)
    torch.testing.assert_close(got, torch.nn.functional.linear(hidden, weight),
                               rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(DEVICE.type != "cpu" or linear.ONEDNN_LINEAR is None,
                    reason="the oneDNN path is the CPU's")
def test_wide_verifies_use_onednn_and_equal_plain(smollm2, monkeypatch):
    """A prompt-lookup chain makes verifies of up to 11 rows: their logits come from oneDNN,
    plain decoding's single rows from torch's default, and the tokens are the same."""
    calls = []
    onednn = linear.ONEDNN_LINEAR

    def counting(hidden, *args):
        calls.append(hidden.numel() // hidden.shape[-1])
        return onednn(hidden, *args)

    monkeypatch.setattr(linear, "ONEDNN_LINEAR", counting)
    ids = smollm2.chat_ids("Repeat this sentence exactly three times: the quick brown fox "
                           "jumps over the lazy dog near the river bank.")
    config = GenerateConfig(max_new_tokens=48)
    plain = run(smollm2, PlainDrafter(), ids, config)
    assert calls == []  # one row per step (the prompt's logits are its last token's)
    out = run(smollm2, load_drafter("lookup", smollm2, tree=None), ids, config)
    assert out.token_ids == plain.token_ids
    assert max(out.accept_lengths) >= 4 and any(4 <= rows < 16 for rows in calls), calls
