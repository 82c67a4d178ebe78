"""sdpa with grouped KV heads under a mask (attention.py) equals transformers' sdpa."""

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from gumiho.attention import SDPA_GQA, grouped_sdpa_forward

from conftest import DEVICE, tiny_llama


class Module(torch.nn.Module):
    num_key_value_groups = 3
    is_causal = True


def attention_case(batch: int, rows: int, seed: int, hidden: float | None = None):
    """(batch, 6 heads, rows queries) over (batch, 2 kv heads, 40 keys) with a ragged mask,
    made on the CPU: bool, or additive with `hidden` where a key is masked."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(shape, generator=g, device="cpu") for shape in
               ((batch, 6, rows, 16), (batch, 2, 40, 16), (batch, 2, 40, 16)))
    mask = torch.rand(batch, 1, rows, 40, generator=g, device="cpu") < 0.6
    mask[..., 0] = True  # every query sees something
    if hidden is not None:
        mask = torch.zeros(mask.shape, device="cpu").masked_fill(~mask, hidden)
    return q, k, v, mask


@pytest.mark.host
@pytest.mark.parametrize("additive", [False, True])
def test_grouped_sdpa_equals_repeated_heads(additive):
    """(1, 6 heads, 5 queries) over (1, 2 kv heads, 40 keys) with a ragged mask."""
    q, k, v, mask = attention_case(1, 5, 0, torch.finfo(torch.float32).min if additive
                                   else None)
    want, _ = sdpa_attention_forward(Module(), q, k, v, mask, scaling=0.25)
    got, _ = grouped_sdpa_forward(Module(), q, k, v, mask, scaling=0.25)
    assert got.shape == want.shape == (1, 5, 6, 16)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


@pytest.mark.parametrize("batch, rows", [(1, 1), (1, 5), (2, 5)])
@pytest.mark.parametrize("additive", [False, True])
@pytest.mark.parametrize("rows_major", [False, True])
def test_folded_sdpa_equals_repeated_heads(batch, rows, additive, rows_major, monkeypatch):
    """The CUDA path: each KV head's query heads folded into its query rows (no copy of the
    keys) gives transformers' repeated heads' values; a decode step (one row) too. On the
    suite's device (the CPU in CI, `GUMIHO_TEST_DEVICE=cuda` on a GPU). rows_major: sdpa
    hands back its (B, heads, Q, D) output laid out as (B, Q, heads, D), as CUDA's fused
    kernels do (the seventh lease: a `.view` of it failed in every folding target)."""
    from gumiho.attention import folded_sdpa

    if rows_major:
        sdpa = torch.nn.functional.scaled_dot_product_attention
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                            lambda *a, **k: sdpa(*a, **k).transpose(1, 2).contiguous()
                            .transpose(1, 2))
    q, k, v, mask = (x.to(DEVICE) for x in attention_case(
        batch, rows, rows, float("-inf") if additive else None))
    want, _ = sdpa_attention_forward(Module(), q, k, v, mask, scaling=0.25)
    got = folded_sdpa(q, k, v, mask, 0.25)
    assert got.shape == want.shape == (batch, rows, 6, 16)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_grouped_kv_sdpa_targets_switch_and_others_do_not():
    """A grouped-KV sdpa target runs the grouped function; eager targets keep theirs."""
    assert tiny_llama().config._attn_implementation == SDPA_GQA  # 4 heads, 2 KV heads
    from transformers import LlamaConfig, LlamaForCausalLM

    from gumiho.target import wrap_target

    config = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         attn_implementation="eager")
    assert wrap_target(LlamaForCausalLM(config)).config._attn_implementation == "eager"


def torch_kernel_only(monkeypatch):
    """`sdpa_invariant` through torch's kernel (rows' keys gathered into bucket-long
    buffers), as where rowattention.c does not build."""
    from gumiho import rowgemm

    monkeypatch.setattr(rowgemm, "attends", lambda *args: False)


@pytest.mark.host
@pytest.mark.parametrize("path", ["rowattention", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_invariant_sdpa_computes_each_tree_row_as_one_token_decoding_would(dtype, path,
                                                                             monkeypatch):
    """A tree over a 10-token prefix (cache slots 10..14, node parents -1, 0, -1, 2, 1):
    each node's row of one verify call is bit for bit the row that decoding the node alone
    gives, with its ancestors committed at slots 10, 11, ... in depth order (what sequential
    decoding's cache holds) and the rest of the cache anything, masked; and the call agrees
    with plain sdpa to float rounding. Both ways it can run: rowattention.c (reading the
    cache in place, any of these dtypes) and torch's kernel over gathered buffers."""
    from gumiho import rowgemm
    from gumiho.attention import invariant_here, invariant_sdpa_forward

    if path == "torch":
        torch_kernel_only(monkeypatch)
    elif rowgemm.kernel() is None:
        pytest.skip("rowattention.c does not build here")

    g = torch.Generator().manual_seed(0)
    prefix, capacity, parents = 10, 20, [-1, 0, -1, 2, 1]
    q, k, v = (torch.randn(shape, generator=g).to(dtype) for shape in
               ((1, 6, 5, 16), (1, 2, capacity, 16), (1, 2, capacity, 16)))
    mask = torch.zeros(1, 1, 5, capacity, dtype=torch.bool)
    mask[..., :prefix] = True
    chains = []
    for node, parent in enumerate(parents):
        chain = (chains[parent] if parent >= 0 else []) + [node]
        chains.append(chain)
        mask[0, 0, node, [prefix + n for n in chain]] = True
    tree, _ = invariant_sdpa_forward(Module(), q, k, v, mask, scaling=0.25)
    plain, _ = sdpa_attention_forward(Module(), q.float(), k.float(), v.float(), mask,
                                      scaling=0.25)
    torch.testing.assert_close(tree.float(), plain, atol=2e-2 if dtype != torch.float32
                               else 1e-6, rtol=0)
    # probed on the path under test (the cached answer is the library's own path's)
    if not invariant_here.__wrapped__(dtype):  # e.g. torch's float32 on an AVX2-only CPU
        pytest.skip(f"this CPU's {dtype} attention kernel rounds a row by its operands' layout")
    for node, chain in enumerate(chains):
        k1, v1 = (torch.randn((1, 2, capacity, 16), generator=g).to(dtype) for _ in range(2))
        k1[..., :prefix, :], v1[..., :prefix, :] = k[..., :prefix, :], v[..., :prefix, :]
        for depth, n in enumerate(chain):  # the path committed in depth order
            k1[..., prefix + depth, :], v1[..., prefix + depth, :] = \
                k[..., prefix + n, :], v[..., prefix + n, :]
        seen = prefix + len(chain)
        alone_mask = torch.zeros(1, 1, 1, capacity, dtype=torch.bool)
        alone_mask[..., :seen] = True
        alone, _ = invariant_sdpa_forward(Module(), q[:, :, node:node + 1], k1, v1,
                                          alone_mask, scaling=0.25)
        assert torch.equal(tree[0, node], alone[0, 0]), node
        # as a decode step gets it: the cache up to this token, all of it visible
        step, _ = invariant_sdpa_forward(Module(), q[:, :, node:node + 1], k1[..., :seen, :],
                                         v1[..., :seen, :], alone_mask[..., :seen],
                                         scaling=0.25)
        assert torch.equal(tree[0, node], step[0, 0]), node


@pytest.mark.host
def test_a_decode_steps_buffer_runs_on_into_the_cache_or_is_padded(monkeypatch):
    """Through torch's kernel, a decode step's keys are a view of a preallocated cache:
    its bucket-long buffer is the cache's own next slots (no copy; whatever they hold is
    masked and never counts), and a tensor without room behind it is padded with zeros;
    both give the same row."""
    from gumiho.attention import INVARIANT_BUCKET, _in_place, invariant_sdpa_forward

    torch_kernel_only(monkeypatch)

    g = torch.Generator().manual_seed(1)
    seen = 70
    cache_k, cache_v = (torch.randn(1, 2, 256, 16, generator=g).to(torch.bfloat16)
                        for _ in range(2))
    k, v = cache_k[:, :, :seen], cache_v[:, :, :seen]
    size = 2 * INVARIANT_BUCKET
    longer = _in_place(k, size)
    assert longer.shape[2] == size and longer.data_ptr() == k.data_ptr()
    assert torch.equal(longer[:, :, :seen], k) and torch.equal(longer, cache_k[:, :, :size])
    tight = _in_place(k.clone(), size)
    assert torch.equal(tight[:, :, :seen], k) and not tight[:, :, seen:].any()
    q = torch.randn(1, 6, 1, 16, generator=g).to(torch.bfloat16)
    mask = torch.ones(1, 1, 1, seen, dtype=torch.bool)
    in_cache, _ = invariant_sdpa_forward(Module(), q, k, v, mask, scaling=0.25)
    padded, _ = invariant_sdpa_forward(Module(), q, k.clone(), v.clone(), mask, scaling=0.25)
    assert torch.equal(in_cache, padded)


@pytest.mark.parametrize("engine", ["eager", "static"])
def test_a_folding_target_decodes_like_plain(reference, monkeypatch, engine):
    """The folded path (CUDA's) inside whole generations, the CPU made to fold: SmolLM2's
    plain answer (3 KV heads for 9 query heads) is the unfolded one's, and Gumiho's
    64-token tree verifies (the target's additive masks, many rows) give it too, eager and
    through the replay buffers (`static`: nothing read from the host). A target of its
    own: steps recorded while folding must not be replayed by the suite's shared one."""
    from gumiho import attention
    from gumiho.drafters import PlainDrafter, load_drafter
    from gumiho.engine import GenerateConfig, run
    from gumiho.target import load_target

    folded_sdpa, rows = attention.folded_sdpa, []

    def counted(query, *args):
        rows.append(query.shape[2])
        return folded_sdpa(query, *args)

    monkeypatch.setattr(attention, "folds", lambda query: True)
    monkeypatch.setattr(attention, "folded_sdpa", counted)
    monkeypatch.setenv("GUMIHO_ROWLAYER", "0")  # torch's attention, not rowattention.c's
    smollm2 = load_target("smollm2", device=str(DEVICE))
    ids, unfolded = reference
    config = GenerateConfig(max_new_tokens=len(unfolded.token_ids), engine=engine)
    plain = run(smollm2, PlainDrafter(), ids, config)
    assert plain.token_ids == unfolded.token_ids
    drafter = load_drafter("gumiho", smollm2, "gumiho/assets/smollm2/gumiho")
    assert run(smollm2, drafter, ids, config).token_ids == plain.token_ids
    assert 1 in rows and max(rows) >= 64  # decode steps and tree verifies both folded
