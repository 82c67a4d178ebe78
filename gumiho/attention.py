"""sdpa that keeps grouped KV heads grouped under a mask, for CPU targets.

transformers' sdpa attention repeats each KV head `num_key_value_groups` times before
calling torch (a copy of the whole cache per layer per step) unless the mask is None, and
every step of ours passes a mask (the tree mask, or the committed prefix of a preallocated
cache). torch's CPU kernel takes `enable_gqa=True` together with a mask, so on the CPU we
pass the grouped keys as they are: same values (tests/test_attention.py), no copy. On CUDA
the fused kernels that take a mask do not take grouped heads, so there the query heads that
share a KV head are folded into its query rows instead (`folded_sdpa`): the keys and
values stay as the cache holds them (the repeat copied the whole preallocated cache, twice
per layer per step), the mask's rows are repeated per folded head.

`use_grouped_sdpa(model)` switches a loaded sdpa model to this function by name
(`SDPA_GQA`); masks are built as for sdpa.

`sdpa_invariant` (`SDPA_INVARIANT`, chosen with `load_target(...,
attn_implementation="sdpa_invariant")` or `--attention`) computes every row of a call as
one-token decoding would (see `invariant_sdpa_forward`): with row-independent products
(`linear.rows_independent`: bf16 on an AMX CPU, rowamx.c's up to 80 rows, float32 where
rowgemm.c builds) a tree
verify then gives exactly plain decoding's tokens, where torch's own attention kernel gives
a row the same bits wherever its operands lie (`invariant_here` probes it;
tests/test_attention.py held in both dtypes on the AMX dev machine, and in bf16 only on an
AVX2-only AMD EPYC, whose float32 attention rounds by operand layout). On an x86 CPU where
rowgemm.py builds its kernels, rowattention.c computes each row alone by construction
instead, in float32 and on a bfloat16 or float16 cache alike (read in place, no per-row
copy of the keys), which holds on that EPYC too and, at a long context, costs a verify
much less than gathering each row's keys for torch's kernel (bf16 on the AMX dev machine,
2026-11-28, a 22-token verify over 1,024 cached tokens: 98 ms against 356).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from gumiho import rowgemm
from gumiho.config import SDPA_GQA, SDPA_INVARIANT
from gumiho.tree import walk_ancestors


def grouped_sdpa_forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                         attention_mask: Tensor | None, dropout: float = 0.0,
                         scaling: float | None = None, **kwargs) -> tuple[Tensor, None]:
    """query (B, heads, Q, D), key/value (B, kv_heads, K, D), attention_mask (B|1, 1, Q, K)
    bool or additive -> (B, Q, heads, D), as transformers' attention functions return."""
    groups = getattr(module, "num_key_value_groups", 1)
    if (attention_mask is None or groups == 1 or dropout
            or kwargs.get("position_bias") is not None or kwargs.get("output_attentions")
            or (folds(query) and attention_mask.shape[1] != 1)):
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    if folds(query):
        return folded_sdpa(query, key, value, attention_mask, scaling), None
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def folds(query: Tensor) -> bool:
    """Whether grouped heads go through `folded_sdpa`: wherever torch's masked kernels do
    not take grouped heads, i.e. off the CPU (a test folds on the CPU too)."""
    return query.device.type != "cpu"


def folded_sdpa(query: Tensor, key: Tensor, value: Tensor, mask: Tensor,
                scale: float | None) -> Tensor:
    """Grouped-KV attention under a mask with plain sdpa and no copy of the keys: query
    (B, heads, Q, D) as (B, kv heads, groups * Q, D), query head j * groups + i's rows the
    i-th block of KV head j's (transformers' repeat gives head j * groups + i KV head j),
    mask (B|1, 1, Q, K) repeated to match -> (B, Q, heads, D). Each row is still one
    query attending over its keys, so the values are the repeated heads' (tested)."""
    batch, heads, rows, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    folded = query.reshape(batch, kv_heads, groups * rows, dim)
    mask = mask[:, :, None].expand(-1, -1, groups, -1, -1).reshape(
        mask.shape[0], 1, groups * rows, mask.shape[-1])
    out = torch.nn.functional.scaled_dot_product_attention(folded, key, value, attn_mask=mask,
                                                           scale=scale)
    # (B, kv, groups * Q, D) -> (B, Q, kv * groups, D) in one copy at most, whatever the
    # layout sdpa hands back (CUDA's fused kernels give (B, Q, heads, D) memory)
    return out.unflatten(2, (groups, rows)).permute(0, 3, 1, 2, 4).reshape(
        batch, rows, heads, dim).contiguous()


AttentionInterface.register(SDPA_GQA, grouped_sdpa_forward)
ALL_MASK_ATTENTION_FUNCTIONS.register(SDPA_GQA, sdpa_mask)


def use_grouped_sdpa(model: torch.nn.Module) -> None:
    """Switch an sdpa model with grouped KV heads to `grouped_sdpa_forward` (in place)."""
    config = model.config.get_text_config(decoder=True)
    heads = config.num_attention_heads
    if (model.config._attn_implementation == "sdpa"
            and (getattr(config, "num_key_value_heads", None) or heads) < heads):
        model.set_attn_implementation(SDPA_GQA)


INVARIANT_MAX_QUERIES = 96  # longer calls (a prompt's prefill) take the grouped sdpa
INVARIANT_BUCKET = 64  # a row attends over its visible keys padded to a multiple of this


def invariant_sdpa_forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                           attention_mask: Tensor | None, dropout: float = 0.0,
                           scaling: float | None = None, **kwargs) -> tuple[Tensor, None]:
    """Attention whose every query row is computed as it would be alone, in one-token
    decoding: the row's visible keys, in cache order, at the front of a buffer whose length
    depends only on how many they are (rounded up to `INVARIANT_BUCKET`, the rest masked),
    each row its own batch element, the query heads that share a KV head as that element's
    query rows. torch's kernel rounds differently for other buffer lengths (masked keys or
    not), so this is what makes a tree node's row see exactly what the same token sees
    decoded alone; with row-independent products a verify then gives its tokens bit for bit
    the hidden states sequential decoding would. A decode step's keys are already in place
    (the cache's own slots past them fill the buffer, masked); a tree row's are gathered.
    CPU only: the row counts are read on the host, which is free there. Where
    rowattention.c builds (rowgemm.py) it computes each row alone by construction instead
    (float32, bfloat16 or float16)."""
    if (attention_mask is None or attention_mask.dtype != torch.bool or query.shape[0] != 1
            or query.device.type != "cpu" or query.shape[2] > INVARIANT_MAX_QUERIES or dropout
            or key.shape[1] == 0 or query.shape[1] % key.shape[1]
            or kwargs.get("position_bias") is not None or kwargs.get("output_attentions")):
        return grouped_sdpa_forward(module, query, key, value, attention_mask,
                                    dropout=dropout, scaling=scaling, **kwargs)
    if rowgemm.attends(query, key, value, attention_mask) and not kwargs.get("softcap"):
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return rowgemm.attention(query, key, value, attention_mask, scale), None
    rows, heads, dim = query.shape[2], query.shape[1], query.shape[3]
    kv_heads = key.shape[1]
    # (Q, kv heads, heads per KV head, D): one element per row, a KV head's query heads
    # as its query rows (one kernel unit per KV head instead of one per query head)
    queries = query[0].transpose(0, 1).reshape(rows, kv_heads, heads // kv_heads, dim)
    out = None
    for picked, take, front in _invariant_plan(attention_mask, rows, key.shape[2]):
        if take is None:  # a decode step: the cache as it is, in a bucket-long buffer
            keys, values = (_in_place(t, front.shape[1]) for t in (key, value))
        else:
            keys, values = (t[0].index_select(1, take.flatten())
                            .view(kv_heads, *take.shape, dim).transpose(0, 1)
                            for t in (key, value))
        got = torch.nn.functional.scaled_dot_product_attention(
            queries if picked is None else queries[picked], keys, values,
            attn_mask=front[:, None, None], scale=scaling)  # (R, kv heads, per KV, D)
        if picked is None:
            out = got
        else:
            if out is None:
                out = got.new_empty(queries.shape)
            out[picked] = got
    return out.reshape(1, rows, heads, dim), None


@functools.cache
def invariant_here(dtype: torch.dtype) -> bool:
    """Whether `invariant_sdpa_forward` in `dtype` gives a tree's rows, here, the bits each
    gets as a decode step (its keys in place in the cache, the tree's gathered): a probe on
    a small random tree (three query heads per KV head, 40 cached keys, two chains), on the
    CPU whatever default device the caller set."""
    with torch.device("cpu"):
        return _invariant_here(dtype)


def _invariant_here(dtype: torch.dtype) -> bool:
    g = torch.Generator().manual_seed(0)  # the caller's random state stays as it was
    prefix, capacity, parents = 40, 64, torch.tensor([-1, 0, 1, -1, 3])
    nodes = len(parents)
    q, k, v = (torch.randn(shape, generator=g).to(dtype) for shape in
               ((1, 6, nodes, 64), (1, 2, capacity, 64), (1, 2, capacity, 64)))
    ancestors = walk_ancestors(parents, None)  # (nodes, nodes): a node and its ancestors
    mask = torch.zeros(1, 1, nodes, capacity, dtype=torch.bool)
    mask[..., :prefix] = True
    mask[0, 0, :, prefix:prefix + nodes] = ancestors
    module = torch.nn.Module()
    tree, _ = invariant_sdpa_forward(module, q, k, v, mask, scaling=0.125)
    for node in range(nodes):
        chain = ancestors[node].nonzero().flatten().tolist()  # root first (parents[i] < i)
        k1, v1 = k.clone(), v.clone()
        for depth, n in enumerate(chain):  # the path committed in depth order
            k1[..., prefix + depth, :], v1[..., prefix + depth, :] = \
                k[..., prefix + n, :], v[..., prefix + n, :]
        step_mask = torch.zeros(1, 1, 1, capacity, dtype=torch.bool)
        step_mask[..., :prefix + len(chain)] = True
        step, _ = invariant_sdpa_forward(module, q[:, :, node:node + 1], k1, v1, step_mask,
                                         scaling=0.125)
        if not torch.equal(tree[0, node], step[0, 0]):
            return False
    return True


def _in_place(t: Tensor, size: int) -> Tensor:
    """(1, kv heads, K, D) cache keys seen as `size` slots: the cache's own slots past K
    (whatever they hold, masked: finite values never count) where its storage has them,
    else zeros padded on."""
    missing = size - t.shape[2]
    if missing <= 0:
        return t
    last = t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
    if t.stride(2) > 0 and (last + missing * t.stride(2) + 1) * t.element_size() \
            <= t.untyped_storage().nbytes():
        return t.as_strided((*t.shape[:2], size, t.shape[3]), t.stride(), t.storage_offset())
    return torch.nn.functional.pad(t, (0, 0, 0, missing))


# (the mask itself, its version, rows, length; its plan): the layers of a step share one
# mask; holding it keeps its memory from being reused by another mask
_plan_memo: list = [None, None]


def _invariant_plan(attention_mask: Tensor, rows: int, length: int) -> list:
    """Per group of rows with one buffer length: (rows or None for all, the key slots to
    gather (R, n) or None for the cache as it is, the buffer's mask (R, n))."""
    # under torch.compile a traced call would replay another mask's plan: no memo there
    # (a compiled step gave nonsense text with sdpa_invariant, plain decoding too)
    compiling = torch.compiler.is_compiling()
    identity = (attention_mask, attention_mask._version, rows, length)
    seen = _plan_memo[0]
    if not compiling and seen is not None and seen[0] is attention_mask and \
            seen[1:] == identity[1:]:
        return _plan_memo[1]
    mask = attention_mask[0, 0].expand(rows, length)  # (Q, K)
    slots = torch.arange(length, device=mask.device)

    def front(visible: Tensor) -> Tensor:  # visible keys first, in a bucket-long buffer
        size = -(-int(visible.max()) // INVARIANT_BUCKET) * INVARIANT_BUCKET
        return torch.arange(size, device=mask.device) < visible[:, None]

    if rows == 1 and bool(mask.all()):  # a decode step: the cache is already in order
        plan = [(None, None, front(torch.full((1,), length, device=mask.device)))]
    else:
        order = torch.where(mask, slots, slots + length).sort(dim=-1).indices  # visible first
        visible = mask.sum(-1)  # (Q,)
        buckets = -(-visible // INVARIANT_BUCKET)
        groups = buckets.unique().tolist()
        plan = []
        for bucket in groups:  # rows of one buffer length: one call
            picked = (buckets == bucket).nonzero().flatten()
            size = bucket * INVARIANT_BUCKET
            # (R, n): past the cache's length the last slot again (masked, never counts)
            take = order[picked][:, torch.arange(size, device=mask.device).clamp(max=length - 1)]
            plan.append((None if len(groups) == 1 else picked, take, front(visible[picked])))
    if not compiling:
        _plan_memo[:] = [identity, plan]
    return plan


AttentionInterface.register(SDPA_INVARIANT, invariant_sdpa_forward)
ALL_MASK_ATTENTION_FUNCTIONS.register(SDPA_INVARIANT, sdpa_mask)
