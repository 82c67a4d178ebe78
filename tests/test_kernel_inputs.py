"""The C kernels' wrappers refuse (or read right) inputs whose layout the kernels would
misread: a mask of another length than the keys, fewer distributions than logits, a
permuted view of the hidden states."""

import pytest
import torch

from gumiho import rowgemm, rowlayer, softce
from gumiho.kv_cache import KVCache
from gumiho.train.loss import soft_cross_entropy

from conftest import DEVICE

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="the CPU's kernels")


@pytest.mark.skipif(rowgemm.kernel() is None, reason="rowattention.c does not run here")
def test_rowattention_refuses_shapes_it_would_misread():
    """rowattention.c reads the mask as (rows, keys) bytes and one head size for q, k and
    v: a longer mask shifted every row's columns (wrong outputs), a shorter one was read
    past its end, a value head size unlike the query's read past the values."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 3, 16, generator=g)
    k, v = (torch.randn(1, 2, 10, 16, generator=g) for _ in range(2))
    mask = torch.rand(1, 1, 3, 10, generator=g) < 0.6
    mask[..., 0] = True
    assert rowgemm.attends(q, k, v, mask)
    assert rowgemm.attends(q, k, v, mask[:, :, :1])  # one row for all
    longer = torch.cat([mask, torch.ones(1, 1, 3, 6, dtype=torch.bool)], -1)
    assert not rowgemm.attends(q, k, v, longer)
    assert not rowgemm.attends(q, k, v, mask[..., :4])
    assert not rowgemm.attends(q, k, v[..., :8], mask)  # sdpa's Ev != E
    assert not rowgemm.attends(q, k[..., :8], v[..., :8], mask)
    assert not rowgemm.attends(q, k, v[:, :, :9], mask)
    assert not rowgemm.attends(q, k, v, mask[:, :, :2])


@pytest.mark.skipif(softce.kernel() is None, reason="softce.c does not run here")
def test_soft_cross_entropy_refuses_fewer_distributions_than_logits():
    """Without an index row m's distribution is probs[m]: softce.c read past probs (a
    garbage loss) where there were fewer rows of them."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(6, 37, generator=g)
    p = torch.softmax(torch.randn(2, 37, generator=g), -1)
    with pytest.raises(ValueError, match="no index"):
        soft_cross_entropy(z, p)
    more = torch.softmax(torch.randn(8, 37, generator=g), -1)  # the first 6 rows count
    expected = -(more[:6] * torch.log_softmax(z, -1)).sum(-1).mean()
    torch.testing.assert_close(soft_cross_entropy(z, more), expected)


@pytest.mark.skipif(not rowlayer.enabled(), reason="rowlayer.c does not run here")
def test_rowlayer_reads_a_permuted_view_of_the_hidden_states_row_major():
    """A dense but permuted h (1, T, H): its clone kept the permuted strides, which
    rowlayer.c read as rows."""
    from test_rowlayer import tiny

    target = tiny(attn_implementation="sdpa")
    fused = target._fused
    h = target.model.get_input_embeddings()(torch.tensor([[3, 4, 5]]))
    permuted = torch.empty(1, h.shape[2], 3).transpose(1, 2)
    permuted.copy_(h)
    assert not permuted.is_contiguous()

    def step(hidden):
        cache = KVCache.for_model(target.model, 16)
        fused.layers.reserve(cache.capacity, hidden)
        seen = torch.ones(1, 1, 3, cache.visible, dtype=torch.bool)
        with torch.no_grad():
            return fused.rows(hidden, torch.tensor([[0, 1, 2]]), cache.hf, seen)

    assert torch.equal(step(permuted), step(h))


@pytest.mark.skipif(rowgemm.kernel() is None, reason="rowgemm.c does not run here")
def test_identity_names_the_loaded_build_whatever_the_environment_says_since(monkeypatch):
    """identity() recomputed the build's path from $GUMIHO_ROWGEMM / $GUMIHO_ROWAMX and the
    sources as they are now: a TypeError once the variable was 0, though the loaded kernels
    kept running."""
    from gumiho import rowamx

    before = rowgemm.identity(), rowamx.identity()
    monkeypatch.setenv("GUMIHO_ROWGEMM", "0")
    monkeypatch.setenv("GUMIHO_ROWAMX", "0")
    assert (rowgemm.identity(), rowamx.identity()) == before
    assert before[0].startswith("rowgemm-")
