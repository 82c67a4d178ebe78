"""The training losses' arithmetic: the fused soft cross-entropy is the released recipe's
`-(p * log_softmax(z)).sum(-1).mean()` in value and gradient, in pieces of any size."""

import pytest
import torch

from gumiho.train.loss import soft_cross_entropy, soft_rows

from conftest import DEVICE


def unfused(logits, probs, index):
    rows = probs if index is None else probs[index]
    return -(rows * torch.log_softmax(logits, -1, dtype=torch.float32)).sum(-1).mean()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64, None])
@pytest.mark.parametrize("indexed", [False, True])
def test_soft_cross_entropy_is_the_unfused_form(dtype, rows, indexed):
    g = torch.Generator().manual_seed(rows or 0)
    m, d = 37, 1000
    logits = (torch.randn(m, d, generator=g) * 3).to(DEVICE, dtype)
    # rows of a distribution, more of them than logits when indexed (as `feature_losses`)
    probs = torch.softmax(torch.randn(m + 13 if indexed else m, d, generator=g) * 2, -1
                          ).to(DEVICE)
    index = torch.randperm(m + 13, generator=g)[:m].sort().values.to(DEVICE) if indexed \
        else None
    expected_z = logits.clone().requires_grad_()
    expected = unfused(expected_z, probs, index)
    (expected * 2.5).backward()
    got_z = logits.clone().requires_grad_()
    got = soft_cross_entropy(got_z, probs, index, rows)
    (got * 2.5).backward()
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert got_z.grad.dtype == dtype
    tolerance = 1e-7 if dtype == torch.float32 else 2 ** -8 * 1e-2  # one bf16 rounding
    torch.testing.assert_close(got_z.grad.float(), expected_z.grad.float(), rtol=1e-2,
                               atol=tolerance)
    assert torch.equal(got_z.detach(), logits)  # the logits themselves untouched


def test_a_distribution_that_does_not_sum_to_one_keeps_its_weight():
    """-sum p log q for any weights p: the gradient is softmax(z) sum(p) - p, not softmax - p."""
    logits = torch.randn(5, 40, device=DEVICE, requires_grad=True)
    probs = torch.rand(5, 40, device=DEVICE) * 0.1
    soft_cross_entropy(logits, probs, None, 2).backward()
    z = logits.detach().clone().requires_grad_()
    unfused(z, probs, None).backward()
    torch.testing.assert_close(logits.grad, z.grad)


@pytest.mark.host
def test_pieces_stay_small_on_a_cpu():
    """About 1 MB of float32 a piece on a CPU (at least one row), bigger on a GPU."""
    assert soft_rows(8192, torch.device("cpu")) == 32
    assert soft_rows(32768, torch.device("cpu")) == 8
    assert soft_rows(262_144 * 4, torch.device("cpu")) == 1
    assert soft_rows(32768, torch.device("meta")) == 4096


def test_autocast_leaves_the_arithmetic_in_float32():
    """Under bf16 autocast (the trainer's --precision bf16) the value and gradient are those
    computed without it."""
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(20, 300, generator=g) * 3).to(DEVICE, torch.bfloat16)
    probs = torch.softmax(torch.randn(20, 300, generator=g), -1).to(DEVICE)
    plain_z, cast_z = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    plain = soft_cross_entropy(plain_z, probs, None, 3)
    plain.backward()
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        cast = soft_cross_entropy(cast_z, probs, None, 3)
    cast.backward()
    assert cast.dtype == torch.float32 and torch.equal(cast, plain)
    assert torch.equal(cast_z.grad, plain_z.grad)
