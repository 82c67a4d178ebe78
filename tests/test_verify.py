"""Tree verification on the stock HF model equals sequential decoding; cache compaction
equals recomputation."""

import pytest
import torch

from gumiho.engine import prefill, verify_tree
from gumiho.kv_cache import KVCache

from drafters_for_tests import random_tree


def sequential_logits(target, tokens):
    """Plain full forward (no cache, no custom mask): logits (L, V)."""
    with torch.inference_mode():
        out = target.model(torch.tensor([tokens], device=target.device))
    return out.logits[0].float()


def check_tree_logits_match(target, prompt, tree_size, vocab, seed, atol, trim=False,
                            spare=4):
    rng = torch.Generator().manual_seed(seed)
    cache = KVCache.for_model(target.model, len(prompt) + tree_size + spare, trim)
    prefill(target, cache, torch.tensor([prompt]))
    tree = random_tree(torch.tensor([prompt[-1] % vocab]), tree_size, vocab, rng)
    _, logits = verify_tree(target, cache, tree)
    for path in tree.paths:
        nodes = path[path >= 0]
        ref = sequential_logits(target, prompt + tree.tokens[nodes].tolist())[len(prompt):]
        torch.testing.assert_close(logits[nodes], ref, atol=atol, rtol=0)


@pytest.mark.parametrize("trim", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_tree_verify_equals_sequential_tiny(tiny_target, seed, trim):
    """Whole-capacity and trimmed (eager) caches, with far more slots than in use."""
    check_tree_logits_match(tiny_target, [5, 17, 3, 42, 8], 24, 97, seed, atol=1e-5, trim=trim,
                            spare=200)


def test_tree_verify_equals_sequential_smollm2(smollm2):
    prompt = smollm2.chat_ids("Write a haiku about the sea.")
    check_tree_logits_match(smollm2, prompt, 16, 49152, seed=0, atol=2e-4, trim=True)


@pytest.mark.parametrize("trim", [False, True])
def test_second_tree_after_compaction_still_exact(tiny_target, trim):
    """Two cycles: compact one path, verify a new tree on top, compare with sequential."""
    prompt = [5, 17, 3, 42, 8]
    rng = torch.Generator().manual_seed(1)
    cache = KVCache.for_model(tiny_target.model, 64, trim)
    prefill(tiny_target, cache, torch.tensor([prompt]))
    tree = random_tree(torch.tensor([9]), 20, 97, rng)
    verify_tree(tiny_target, cache, tree)
    path = tree.paths[0][tree.paths[0] >= 0]
    cache.compact(path)
    committed = prompt + tree.tokens[path].tolist()
    tree2 = random_tree(torch.tensor([11]), 20, 97, rng)
    _, logits = verify_tree(tiny_target, cache, tree2)
    for p in tree2.paths:
        nodes = p[p >= 0]
        ref = sequential_logits(tiny_target, committed + tree2.tokens[nodes].tolist())
        torch.testing.assert_close(logits[nodes], ref[len(committed):], atol=1e-5, rtol=0)


@pytest.mark.parametrize("which", [0, -1])
def test_compaction_equals_recomputation(tiny_target, which):
    prompt = [1, 2, 3, 4, 5, 6]
    rng = torch.Generator().manual_seed(2)
    cache = KVCache.for_model(tiny_target.model, 64)
    prefill(tiny_target, cache, torch.tensor([prompt]))
    tree = random_tree(torch.tensor([7]), 25, 97, rng)
    verify_tree(tiny_target, cache, tree)
    path = tree.paths[which][tree.paths[which] >= 0]
    cache.compact(path)

    fresh = KVCache.for_model(tiny_target.model, 64)
    prefill(tiny_target, fresh, torch.tensor([prompt + tree.tokens[path].tolist()]))
    assert cache.length == fresh.length == len(prompt) + len(path)
    for layer in range(tiny_target.config.num_hidden_layers):
        for got, want in zip(cache.keys_values(layer), fresh.keys_values(layer), strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_cache_overflow_is_a_clear_error(tiny_target):
    from gumiho.errors import GumihoError

    cache = KVCache.for_model(tiny_target.model, 4)
    with pytest.raises(GumihoError, match="KV cache full"):
        prefill(tiny_target, cache, torch.tensor([[1, 2, 3, 4, 5]]))


def test_repeated_verify_without_commit_is_idempotent(tiny_target):
    """A step always writes at the committed length, whatever the last step left behind."""
    rng = torch.Generator().manual_seed(4)
    cache = KVCache.for_model(tiny_target.model, 64)
    prefill(tiny_target, cache, torch.tensor([[1, 2, 3]]))
    tree = random_tree(torch.tensor([4]), 12, 97, rng)
    _, first = verify_tree(tiny_target, cache, tree)
    _, second = verify_tree(tiny_target, cache, tree)
    torch.testing.assert_close(first, second, atol=0, rtol=0)


def test_padded_verify_equals_unpadded(tiny_target):
    """A fixed verify width (static shape) changes nothing for the real nodes."""
    rng = torch.Generator().manual_seed(6)
    tree = random_tree(torch.tensor([4]), 10, 97, rng)
    outs = []
    for width in (None, 16):
        cache = KVCache.for_model(tiny_target.model, 40)
        prefill(tiny_target, cache, torch.tensor([[1, 2, 3, 9]]))
        outs.append(verify_tree(tiny_target, cache, tree, width))
    for a, b in zip(outs[0], outs[1], strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_trimmed_step_attends_over_the_slots_in_use_only(tiny_target):
    """A trimmed cache hands attention length + U slots and masks that wide; the whole-
    capacity one hands it every slot. Their logits agree."""
    prompt, outs = [1, 2, 3, 9], []
    tree = random_tree(torch.tensor([4]), 10, 97, torch.Generator().manual_seed(8))
    for trim in (False, True):
        cache = KVCache.for_model(tiny_target.model, 300, trim)
        prefill(tiny_target, cache, torch.tensor([prompt]))
        cache.begin_step(tree.size)
        mask = cache.attention_mask(tree.verify_mask, cache.length + tree.depths)
        keys, _ = cache.hf.layers[0].update(torch.zeros(1, 2, tree.size, 8),
                                            torch.zeros(1, 2, tree.size, 8))
        width = len(prompt) + tree.size if trim else 300
        assert mask.shape[-1] == keys.shape[2] == width
        outs.append(verify_tree(tiny_target, cache, tree)[1])
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=0)


def test_sdpa_gets_the_mask_as_additive_floats_with_the_same_bits(smollm2, monkeypatch):
    """An sdpa target takes each step's mask as 0 / -inf floats made once (not a bool mask
    its kernels convert in every layer): the same features and logits bit for bit, for the
    prompt and for a tree."""
    from gumiho.target import Target
    from gumiho.tree import DraftTree

    def step():
        cache = KVCache.for_model(smollm2.model, 64)
        first = prefill(smollm2, cache, torch.tensor([[1, 510, 3375, 314, 253, 2365]]))
        tree = DraftTree.from_parents(torch.tensor([5, 6, 7, 8, 9], device=smollm2.device),
                                      torch.tensor([-1, 0, 0, 1, 2]))
        return (*first, *verify_tree(smollm2, cache, tree))

    assert smollm2.config._attn_implementation in ("sdpa", "sdpa_gqa")
    if smollm2._fused is not None:  # fused.py's calls (rowlayer.c's steps take bool masks)
        monkeypatch.setattr(smollm2._fused, "rows", None)
    additive = step()
    masks_seen = []
    original = Target._decoder_masks
    monkeypatch.setattr(Target, "_decoder_masks",
                        lambda self, m: masks_seen.append(original(self, m).dtype) or m)
    as_bool = step()
    assert masks_seen and all(dtype == smollm2.dtype for dtype in masks_seen)
    for x, y in zip(additive, as_bool, strict=True):
        assert torch.equal(x, y)
