"""Prompt-lookup candidates: the n-gram index, the chain merged into a tree, and output
that stays exactly the target's (greedy and sampled)."""

from dataclasses import replace

import pytest
import torch

from gumiho.config import TreeConfig
from gumiho.drafters import PlainDrafter, load_drafter
from gumiho.engine import GenerateConfig, run
from gumiho.lookup import LookupDrafter, NgramIndex, attach_chain
from gumiho.tree import DraftTree

from conftest import tiny_llama
from drafters_for_tests import RandomDrafter
from test_sampling import assert_samples_match_target


@pytest.mark.host
def test_ngram_index_continues_the_latest_earlier_occurrence():
    index = NgramIndex(max_n=3)
    index.extend([1, 2, 3, 4, 9, 2, 3, 5, 7, 1, 2, 3])
    # suffix (1, 2, 3) occurred at the start: what followed it then
    assert index.find(3) == (3, [4, 9, 2])
    index.extend([8])  # (3, 8), (8) never occurred before; ...
    assert index.find(4) == (0, [])
    index.extend([2])  # suffix (2) last occurred before at position 10 -> 3, 8, 2
    assert index.find(2) == (1, [3, 8])
    assert NgramIndex(min_n=2).find(5) == (0, [])


@pytest.mark.host
def test_chain_merges_into_the_tree():
    # root 7 -> a=1 -> b=2 ; root -> c=5
    tree = DraftTree.from_parents(torch.tensor([7, 1, 2, 5]), torch.tensor([-1, 0, 1, 0]))
    chain = torch.tensor([1, 2, 3, 4, 0])
    valid = torch.tensor([True, True, True, True, False])
    merged = attach_chain(tree, chain, valid)
    assert merged.size == 9
    assert merged.dead.tolist() == [False] * 4 + [True, True, False, False, True]
    assert merged.parents[6:8].tolist() == [2, 6]  # 3 under the existing 2, then 4
    assert merged.depths[6:8].tolist() == [3, 4]
    logits = torch.full((9, 10), -1.0)
    for node, nxt in [(0, 1), (1, 2), (2, 3), (6, 4), (7, 9)]:
        logits[node, nxt] = 1.0  # the target continues 7 1 2 3 4 9
    from gumiho.sampling import accept_greedy
    accepted, bonus = accept_greedy(merged, logits)
    assert accepted.tolist() == [0, 1, 2, 6, 7] and int(bonus) == 9


def walk_chain(tree: DraftTree, chain, valid, max_depth: int) -> DraftTree:
    """The chain attached a slot at a time, the way the merge is defined (attach_chain's
    first form; 14 kernels a slot): at each slot, still merging, a child of the current
    node with the slot's token makes the slot dead and becomes the current node."""
    k, length = tree.size, chain.shape[0]
    cur, merging = torch.tensor(0), torch.tensor(True)
    parents, dead = [], []
    for d in range(length):
        match = (tree.parents == cur) & (tree.tokens == chain[d])
        found = match.any() & merging & valid[d]
        parents.append(torch.where(merging, cur, k + d - 1))
        dead.append(found | ~valid[d])
        cur = torch.where(found, match.long().argmax(), cur)
        merging = merging & found
    tokens = torch.where(valid, chain, tree.tokens[0])
    merged = DraftTree.from_parents(torch.cat([tree.tokens, tokens]),
                                    torch.cat([tree.parents, torch.stack(parents)]), max_depth)
    old = tree.dead if tree.dead is not None else torch.zeros(k, dtype=torch.bool)
    return replace(merged, dead=torch.cat([old, torch.stack(dead)]))


@pytest.mark.host
@pytest.mark.parametrize("seed", range(40))
def test_chain_attached_at_once_equals_the_slot_by_slot_walk(seed):
    """Random trees (siblings' tokens distinct, as every drafter's), chains that follow one
    of their paths for a while and then leave it or end in padding, of every length."""
    g = torch.Generator().manual_seed(seed)
    size = int(torch.randint(1, 40, (), generator=g))
    parents, tokens, children = [-1], [7], {0: set()}
    for _ in range(1, size):
        parent = int(torch.randint(0, len(parents), (), generator=g))
        token = int(torch.randint(0, 6, (), generator=g))
        if token in children[parent]:
            continue
        children[parent].add(token)
        children[len(parents)] = set()
        parents.append(parent)
        tokens.append(token)
    tree = DraftTree.from_parents(torch.tensor(tokens), torch.tensor(parents), 40)
    if seed % 3 == 0:
        tree = replace(tree, dead=torch.rand(tree.size, generator=g) < 0.3)
    length = int(torch.randint(1, 12, (), generator=g))
    node, chain = int(torch.randint(0, tree.size, (), generator=g)), []
    while node > 0:  # a path of the tree from the root, then anything
        chain.insert(0, tokens[node])
        node = parents[node]
    chain = (chain + torch.randint(0, 6, (length,), generator=g).tolist())[:length]
    valid = torch.arange(length) < int(torch.randint(0, length + 1, (), generator=g))
    chain = torch.tensor(chain)
    expected = walk_chain(tree, chain, valid, max_depth=tree.size + length)
    merged = attach_chain(tree, chain, valid)
    for field in ("tokens", "parents", "depths", "mask", "dead"):
        assert torch.equal(getattr(merged, field), getattr(expected, field)), field


REPEATING = ("Repeat this sentence exactly three times: the quick brown fox jumps over the "
             "lazy dog near the river bank.")


@pytest.mark.parametrize("method", ["lookup", "gumiho", "eagle2", "medusa"])
def test_lookup_equals_plain(smollm2, method):
    ids = smollm2.chat_ids(REPEATING)
    config = GenerateConfig(max_new_tokens=48)
    plain = run(smollm2, PlainDrafter(), ids, config)
    tree = TreeConfig.for_method(method, lookup=8, **({} if method == "lookup" else
                                                      {"total_tokens": 12}))
    drafter = load_drafter(method, smollm2, None if method == "lookup" else "random", tree=tree)
    out = run(smollm2, drafter, ids, config)
    assert out.token_ids == plain.token_ids
    assert out.tau > 1.5, out.accept_lengths  # the repetition is found


@pytest.mark.parametrize("first", [False, True])
def test_lookup_sampling_matches_target(first):
    vocab = 16
    target = tiny_llama(vocab_size=vocab, seed=1, logit_scale=25.0)
    prompt = [3, 9, 1, 12, 5, 3, 9, 1, 12, 5, 3, 9]
    drafter = LookupDrafter(RandomDrafter(vocab, size=4, seed=0), tokens=4, min_n=1,
                            first=first)
    assert_samples_match_target(target, drafter, prompt, vocab)


@pytest.mark.parametrize("static_shape", [False, True])
def test_eager_steps_verify_only_the_chain_found(static_shape):
    """Eager: no continuation -> the inner tree alone (one node for plain decoding), a
    short one -> that many nodes, and a match shorter than max_n (3) -> only its first
    `short` (2) tokens. Captured engines always get the full, partly dead chain."""
    drafter = LookupDrafter(PlainDrafter(), tokens=5, static_shape=static_shape)
    drafter.begin(tiny_llama(), 64)
    drafter.observe(None, torch.tensor([1, 2, 3, 4]), [1, 2, 3, 4])
    assert drafter.propose().size == (6 if static_shape else 1)  # nothing recurs yet
    drafter.observe(None, torch.tensor([2]), [2])  # one recurring token is not enough
    assert drafter.propose().size == (6 if static_shape else 1)
    drafter.observe(None, torch.tensor([3]), [3])  # (2, 3) recurs: 4, 2, 3 followed it
    tree = drafter.propose()
    assert tree.size == (6 if static_shape else 3)  # a 2-gram: its first two tokens
    assert tree.tokens[1:3].tolist() == [4, 2]
    assert tree.dead is None or tree.dead.tolist() == [False] * 3 + [True] * (tree.size - 3)
    drafter.observe(None, torch.tensor([4]), [4])  # (2, 3, 4) recurs: 2, 3, 4 followed it
    tree = drafter.propose()
    assert tree.size == (6 if static_shape else 4)
    assert tree.tokens[1:4].tolist() == [2, 3, 4]


@pytest.mark.parametrize("method", ["gumiho", "eagle2", "medusa"])
def test_lookup_first_equals_plain(smollm2, method):
    """Cycles that verify the chain alone leave the drafter's features pending; it catches
    up on all of them at its next draft, and the output stays the target's."""
    ids = smollm2.chat_ids(REPEATING)
    config = GenerateConfig(max_new_tokens=48)
    plain = run(smollm2, PlainDrafter(), ids, config)
    tree = TreeConfig.for_method(method, lookup=8, lookup_first=True, total_tokens=12)
    drafter = load_drafter(method, smollm2, "random", tree=tree)
    calls = []
    propose = drafter.inner.propose
    drafter.inner.propose = lambda: calls.append(1) or propose()
    out = run(smollm2, drafter, ids, config)
    assert out.token_ids == plain.token_ids
    assert out.tau > 1.5, out.accept_lengths  # the repetition is found
    assert 0 < len(calls) < len(out.accept_lengths)  # some cycles skipped the drafter


def test_lookup_first_skips_the_drafter_only_where_a_chain_is_found():
    inner = RandomDrafter(64, size=4, seed=0)
    drafter = LookupDrafter(inner, tokens=5, first=True)
    drafter.begin(tiny_llama(), 64)
    drafter.observe(torch.zeros(4, 8), torch.tensor([1, 2, 3, 4]), [1, 2, 3, 4])
    assert drafter.propose().size == 4  # nothing recurs: the drafter's tree
    drafter.observe(torch.zeros(1, 8), torch.tensor([2]), [2])
    drafter.observe(torch.zeros(1, 8), torch.tensor([3]), [3])  # (2, 3) recurs
    tree = drafter.propose()  # the chain alone: the 2-gram's first two tokens
    assert tree.tokens.tolist() == [3, 4, 2] and tree.parents.tolist() == [-1, 0, 1]
    captured = LookupDrafter(RandomDrafter(64, size=4, seed=0), tokens=5, first=True,
                             static_shape=True)
    assert not captured.first  # one shape every step: the chain stays beside the tree


def test_lookup_first_trusts_a_chain_alone_only_after_a_right_guess():
    """A continuation is verified alone while the last one found was right about its first
    token (the token the target emitted next); after a wrong guess the next continuation's
    first `short` tokens go beside the drafter's tree, until a guess is right again."""
    def started(trust):
        drafter = LookupDrafter(RandomDrafter(64, size=4, seed=0), tokens=5, first=True,
                                trust=trust)
        drafter.begin(tiny_llama(), 64)
        return drafter

    def emitted(drafter, *cycles):
        for tokens in cycles:
            drafter.observe(torch.zeros(len(tokens), 8), torch.tensor(tokens), tokens)

    drafter = started(trust=True)
    emitted(drafter, [1, 2, 3, 4], [2], [3])  # (2, 3) recurs: 4, 2 followed it
    assert drafter.propose().tokens.tolist() == [3, 4, 2]  # alone: no guess was wrong yet
    emitted(drafter, [7])  # the target's token was 7, not the guessed 4
    assert drafter.propose().size == 4  # nothing recurs: the drafter's tree
    emitted(drafter, [2, 3])  # (2, 3) recurs again: 7, 2 followed it last
    tree = drafter.propose()  # the drafter's 4 nodes and the chain's 2 below the root
    assert tree.size == 6 and tree.tokens[4:].tolist() == [7, 2]
    assert tree.parents[4:].tolist() == [0, 4]
    emitted(drafter, [7, 2])  # the guess 7 was right
    tree = drafter.propose()  # (3, 7, 2) recurs: a 3-gram's whole continuation, alone
    assert tree.tokens.tolist() == [2, 3, 7, 2] and tree.parents.tolist() == [-1, 0, 1, 2]
    always = started(trust=False)
    emitted(always, [1, 2, 3, 4], [2], [3])
    always.propose()
    emitted(always, [7])
    always.propose()
    emitted(always, [2, 3])
    tree = always.propose()
    assert tree.tokens.tolist() == [3, 7, 2]  # without trust: alone after a wrong guess too


def test_a_chain_beside_the_tree_after_a_wrong_guess_keeps_the_output(smollm2):
    """The demo's prompt and shape with the shipped drafter: a lookup chain fails there,
    later continuations go beside the drafter's tree, and the output is plain decoding's."""
    from gumiho.demo import PROMPT, shipped_drafter

    ids = smollm2.chat_ids(PROMPT)
    config = GenerateConfig(max_new_tokens=96)
    plain = run(smollm2, PlainDrafter(), ids, config)
    tree = TreeConfig.for_method("gumiho", total_tokens=6, depth=2, lookup=10,
                                 lookup_first=True, min_confidence=0.1,
                                 extend_confidence=0.4)
    drafter = load_drafter("gumiho", smollm2, str(shipped_drafter("gumiho")), tree=tree)
    beside = []
    inner_propose = drafter.inner.propose
    drafter.inner.propose = lambda: beside.append(drafter.guess is not None) or inner_propose()
    out = run(smollm2, drafter, ids, config)
    assert out.token_ids == plain.token_ids
    assert any(beside), "no chain went beside the drafter's tree"


def test_lookup_first_needs_a_chain():
    from gumiho.errors import GumihoError

    with pytest.raises(GumihoError, match="--lookup-first needs"):
        TreeConfig.for_method("gumiho", lookup_first=True)
