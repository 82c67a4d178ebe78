"""The training losses' arithmetic: the fused soft cross-entropy is the released recipe's
`-(p * log_softmax(z)).sum(-1).mean()` in value and gradient, in pieces of any size, by
torch's operators and, on a CPU, by softce.c; with the head's product inside it
(`head_soft_cross_entropy`), the same as the product followed by the loss."""

import pytest
import torch

from gumiho import softce
from gumiho.linear import LogitForm
from gumiho.modeling import DraftHead
from gumiho.train.loss import (
    head_rows,
    head_soft_cross_entropy,
    soft_cross_entropy,
    soft_rows,
    top1,
)

from conftest import DEVICE

BUILT = DEVICE.type == "cpu" and softce.kernel() is not None


def randn(g: torch.Generator, *shape: int) -> torch.Tensor:
    """Seeded normal draws, made on the CPU where `g` lives (under GUMIHO_TEST_DEVICE=cuda
    the suite's default device is the GPU, where a CPU generator cannot draw)."""
    return torch.randn(*shape, generator=g, device="cpu")


def randperm(g: torch.Generator, n: int) -> torch.Tensor:
    return torch.randperm(n, generator=g, device="cpu")


@pytest.fixture(params=["kernel", "torch"])
def path(request, monkeypatch):
    """A test twice: as it runs here (softce.c on a CPU where it builds) and with torch's
    operators only."""
    if request.param == "kernel" and not BUILT:
        pytest.skip("softce.c does not run here")
    if request.param == "torch":
        monkeypatch.setattr(softce, "kernel", lambda: None)
    return request.param


def unfused(logits, probs, index):
    rows = probs if index is None else probs[index]
    return -(rows * torch.log_softmax(logits, -1, dtype=torch.float32)).sum(-1).mean()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 7, 64, None])
@pytest.mark.parametrize("indexed", [False, True])
def test_soft_cross_entropy_is_the_unfused_form(dtype, rows, indexed, path):
    g = torch.Generator().manual_seed(rows or 0)
    m, d = 37, 1000
    logits = (randn(g, m, d) * 3).to(DEVICE, dtype)
    # rows of a distribution, more of them than logits when indexed (as `feature_losses`)
    probs = torch.softmax(randn(g, m + 13 if indexed else m, d) * 2, -1
                          ).to(DEVICE)
    index = randperm(g, m + 13)[:m].sort().values.to(DEVICE) if indexed \
        else None
    expected_z = logits.clone().requires_grad_()
    expected = unfused(expected_z, probs, index)
    (expected * 2.5).backward()
    got_z = logits.clone().requires_grad_()
    got = soft_cross_entropy(got_z, probs, index, rows)
    (got * 2.5).backward()
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert got_z.grad.dtype == dtype
    # float32, else one rounding to the dtype
    tolerance = {torch.float32: 1e-7, torch.bfloat16: 2 ** -8 * 1e-2,
                 torch.float16: 2 ** -11 * 1e-2}[dtype]
    torch.testing.assert_close(got_z.grad.float(), expected_z.grad.float(), rtol=1e-2,
                               atol=tolerance)
    assert torch.equal(got_z.detach(), logits)  # the logits themselves untouched


def test_a_distribution_that_does_not_sum_to_one_keeps_its_weight(path):
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


def test_autocast_leaves_the_arithmetic_in_float32(path):
    """Under bf16 autocast (the trainer's --precision bf16) the value and gradient are those
    computed without it."""
    g = torch.Generator().manual_seed(5)
    logits = (randn(g, 20, 300) * 3).to(DEVICE, torch.bfloat16)
    probs = torch.softmax(randn(g, 20, 300), -1).to(DEVICE)
    plain_z, cast_z = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    plain = soft_cross_entropy(plain_z, probs, None, 3)
    plain.backward()
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        cast = soft_cross_entropy(cast_z, probs, None, 3)
    cast.backward()
    assert cast.dtype == torch.float32 and torch.equal(cast, plain)
    assert torch.equal(cast_z.grad, plain_z.grad)


@pytest.mark.host
def test_the_kernel_builds_on_an_x86_cpu_with_a_compiler():
    """Where it can build (x86 with AVX2, a C compiler, not switched off), it builds and
    passes its own check, so a broken kernel fails here rather than quietly giving way."""
    import os

    from gumiho import kernels

    if DEVICE.type != "cpu" or kernels.compiler() is None or not kernels.avx2_cpu() \
            or os.environ.get("GUMIHO_SOFTCE") == "0":
        pytest.skip("softce.c cannot build here")
    assert softce.kernel() is not None


@pytest.mark.host
def test_the_kernel_runs_on_a_cpu_where_it_builds(path):
    """Where softce.c builds, a CPU loss is its (so the tests above check it); with it off,
    torch's."""
    z, p = torch.randn(3, 16), torch.softmax(torch.randn(3, 16), -1)
    assert softce.takes(z, p, None) == (path == "kernel")
    assert softce.takes(z.bfloat16(), p, torch.tensor([0, 2, 1])) == (path == "kernel")
    assert not softce.takes(z, p.bfloat16(), None)  # distributions are float32


@pytest.mark.host
def test_logits_far_below_the_top_and_wide_rows(path):
    """A 32,768-token row (a draft vocabulary) with logits 1000 below its top: their exp
    is 0 to float32 (the kernel's ~1e-38), the gradient -p there."""
    g = torch.Generator().manual_seed(3)
    logits = randn(g, 4, 32768) * 4
    logits[:, ::7] -= 1000
    probs = torch.softmax(randn(g, 4, 32768) * 3, -1)
    got_z, expected_z = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    got, expected = soft_cross_entropy(got_z, probs), unfused(expected_z, probs, None)
    got.backward()
    expected.backward()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_z.grad, expected_z.grad, rtol=1e-4, atol=1e-9)


@pytest.mark.host
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_kernels_16_bit_gradient_is_its_float32_one_rounded_once(dtype):
    """softce.c widens 16-bit logits exactly and rounds the gradient once, to nearest: the
    float32 gradient of the same values, rounded, bit for bit (a 32,768-token row, ties
    included)."""
    if not BUILT:
        pytest.skip("softce.c does not run here")
    g = torch.Generator().manual_seed(6)
    logits = (randn(g, 5, 32768) * 4).to(dtype)
    probs = torch.softmax(randn(g, 5, 32768) * 3, -1)
    short, wide = torch.empty(5, 32768, dtype=dtype), torch.empty(5, 32768)
    softce.loss_and_grad(logits, probs, None, short)
    softce.loss_and_grad(logits.float(), probs, None, wide)
    assert torch.equal(short, wide.to(dtype))


@pytest.mark.host
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_backward_hands_on_its_gradient_once(path, dtype):
    """The backward scales the kept gradient in place (rounded once, as torch's
    `grad * factor`) and hands it on; a second backward says so rather than reuse it."""
    g = torch.Generator().manual_seed(4)
    logits = (randn(g, 7, 203) * 3).to(dtype).requires_grad_()
    probs = torch.softmax(randn(g, 7, 203), -1)
    with torch.no_grad():  # the kept gradient, unscaled: the weight 7 undoes the mean
        raw = logits.clone().requires_grad_()
    soft_cross_entropy(raw, probs).backward(torch.tensor(7.0))
    weight = torch.tensor(0.0871)
    loss = soft_cross_entropy(logits, probs) * weight
    loss.backward(retain_graph=True)
    assert torch.equal(logits.grad, raw.grad * (weight / 7))
    with pytest.raises(RuntimeError, match="second time"):
        loss.backward()


@pytest.mark.host
def test_an_index_outside_the_distributions_is_refused(path):
    """An index past the distributions' rows, or shorter than the logits, raises (softce.c
    would read past them). On the host only: on a GPU torch's own indexing stops such an
    index with a device-side assert, which no test can catch and which leaves every later
    CUDA call of the process failing (the GPU suite of 2026-11-30 lost a worker's 150 tests
    to it)."""
    logits = torch.randn(3, 16)
    probs = torch.softmax(torch.randn(4, 16), -1)
    with pytest.raises((IndexError, RuntimeError)):
        soft_cross_entropy(logits, probs, torch.tensor([0, 4, 1]))
    with pytest.raises((ValueError, RuntimeError)):  # fewer index rows than logits
        soft_cross_entropy(logits, probs, torch.tensor([0, 1]))


@pytest.mark.host
def test_the_kernel_refuses_a_gradient_it_cannot_write():
    """softce.loss_and_grad writes the gradient through a raw pointer: one of another shape,
    dtype or layout is refused before the C call."""
    if not BUILT:
        pytest.skip("softce.c does not run here")
    logits = torch.randn(4, 24)
    probs = torch.softmax(torch.randn(4, 24), -1)
    for wrong in (torch.empty(3, 24), torch.empty(4, 24, dtype=torch.bfloat16),
                  torch.empty(24, 4).T):
        with pytest.raises(ValueError, match="gradient"):
            softce.loss_and_grad(logits, probs, None, wrong)


@pytest.mark.host
def test_the_loss_ab_script_runs_its_loss_only_mode(capsys):
    """scripts/train_loss_ab.py --loss-only (how the forms are timed against each other)
    runs every form and prints the medians and the rounds' ratios."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    try:
        import train_loss_ab
    finally:
        sys.path.pop(0)
    forms = "head,kernel,torch,unfused" if BUILT else "head,torch,unfused"
    kernel = softce.kernel
    train_loss_ab.main(["--loss-only", "6", "--draft-vocab", "40", "--pairs", "2",
                        "--forms", forms, "--precision", "fp32"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 4 and lines[0].startswith("round 1:")
    assert "median ms a loss (6 x 40" in lines[2]
    assert lines[3].startswith("median of the rounds' ratios:")
    assert train_loss_ab.loss_module.soft_cross_entropy is soft_cross_entropy  # put back
    assert train_loss_ab.loss_module.head_soft_cross_entropy is head_soft_cross_entropy
    assert softce.kernel is kernel


def random_head(vocab: int, hidden: int, seed: int, form: LogitForm | None = None,
                bias: bool = False, dtype: torch.dtype = torch.float32) -> DraftHead:
    g = torch.Generator().manual_seed(seed)
    linear = torch.nn.Linear(hidden, vocab, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(randn(g, vocab, hidden) * hidden ** -0.5)
        if bias:
            linear.bias.copy_(randn(g, vocab))
    return DraftHead(linear.to(DEVICE, dtype), form=form)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 5, None])
@pytest.mark.parametrize("indexed", [False, True])
@pytest.mark.parametrize("form", [LogitForm(), LogitForm(cap=3.0), LogitForm(0.25, 3.0)],
                         ids=["plain", "softcap", "scale+softcap"])
def test_the_head_inside_the_loss_is_the_product_then_the_loss(precision, rows, indexed,
                                                               form, path):
    """head_soft_cross_entropy(h, head, ...) against soft_cross_entropy(head(h), ...) with the
    gradient through the product, in float32 and under bf16 autocast (the trainer's two
    precisions), in pieces of any size, with a softcap (Gemma's) and a scale before it
    (Granite's, Cohere's), and the logits' argmax."""
    g = torch.Generator().manual_seed(11 + (rows or 0))
    m, hidden, vocab = 23, 48, 700
    head = random_head(vocab, hidden, 2, form, bias=indexed)
    h = randn(g, m, hidden).to(DEVICE)
    probs = torch.softmax(randn(g, m + 9 if indexed else m, vocab) * 2, -1
                          ).to(DEVICE)
    index = randperm(g, m + 9)[:m].to(DEVICE) if indexed else None
    cast = torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=precision == "bf16")
    expected_h, got_h = h.clone().requires_grad_(), h.clone().requires_grad_()
    with cast:
        expected = soft_cross_entropy(head.logits(expected_h, packed=False), probs, index)
        got, top = head_soft_cross_entropy(got_h, head, probs, index, rows, want_top1=True)
    (expected * 1.7).backward()
    (got * 1.7).backward()
    assert got.dtype == torch.float32 and got_h.grad.dtype == h.dtype
    # bf16 products of a piece's rows and of all rows may round apart
    torch.testing.assert_close(got, expected, rtol=1e-6 if precision == "fp32" else 1e-4,
                               atol=1e-6)
    with cast, torch.no_grad():  # the argmax of the logits each piece made
        pieces = h.split(rows or head_rows(vocab))
        assert torch.equal(top, torch.cat([top1(head.logits(part, packed=False))
                                           for part in pieces]))
    # float32 to its rounding; under autocast the product of a bf16 gradient, rounded again
    tolerance = dict(rtol=1e-4, atol=1e-7) if precision == "fp32" else \
        dict(rtol=2e-2, atol=1e-4)
    torch.testing.assert_close(got_h.grad, expected_h.grad, **tolerance)
    assert got_h.grad.abs().sum() > 0


def test_the_head_inside_the_loss_hands_on_its_gradient_once(path):
    head = random_head(50, 8, 3)
    h = torch.randn(6, 8, device=DEVICE, requires_grad=True)
    probs = torch.softmax(torch.randn(6, 50, device=DEVICE), -1)
    loss, top = head_soft_cross_entropy(h, head, probs, rows=4)
    assert top is None
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second time"):
        loss.backward()


def test_the_head_inside_the_loss_without_a_gradient(path):
    """With no gradient to make (evaluation, a frozen input), the value and argmax alone."""
    head = random_head(64, 8, 4)
    h = torch.randn(9, 8, device=DEVICE)
    probs = torch.softmax(torch.randn(9, 64, device=DEVICE), -1)
    loss, top = head_soft_cross_entropy(h, head, probs, rows=2, want_top1=True)
    torch.testing.assert_close(loss, soft_cross_entropy(head.logits(h, packed=False), probs))
    assert torch.equal(top, top1(head.logits(h, packed=False)))


@pytest.mark.host
def test_the_head_pieces_are_bounded():
    """At most 2^27 logits a piece (each piece reads the head's weight again, so as few as
    that bound allows): a (M, D) tensor is never made for a large batch."""
    assert head_rows(32768) == 4096
    assert head_rows(128_256) == 1046
    assert head_rows(2 ** 30) == 1


@pytest.mark.host
def test_the_ab_scripts_memory_peak_sees_a_step_sized_tensor():
    """train_loss_ab.py --peak-memory's sampler: a 256 MiB tensor held for a moment shows
    in its peak above the starting level. In a fresh process, as the script runs: in a
    test worker, memory an earlier test freed can stay resident and be handed out again,
    so the tensor need not raise the resident size at all (seen in CI)."""
    import subprocess
    import sys
    from pathlib import Path

    if not Path("/proc/self/statm").exists():
        pytest.skip("the sampler reads Linux's /proc")
    code = """
import sys, time
import torch
sys.path.insert(0, sys.argv[1])
import train_loss_ab
peak = train_loss_ab.ResidentPeak()
held = torch.ones(2 ** 26)  # 256 MiB, every page written
# Two more readings mean one began and ended while the tensor was held, however loaded
# the machine is.
seen, deadline = peak.samples, time.monotonic() + 60
while peak.samples < seen + 2 and time.monotonic() < deadline:
    time.sleep(0.002)
del held
print(peak.stop())
"""
    scripts = str(Path(__file__).resolve().parents[1] / "scripts")
    proc = subprocess.run([sys.executable, "-c", code, scripts], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert 200 * 2 ** 20 < int(proc.stdout.split()[-1]) < 2 ** 31
