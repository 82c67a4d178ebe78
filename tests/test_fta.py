"""`--fta official` is the released code's splice exactly: fills from every path that
reaches a column, the leaves' extra attention in verification, and at T > 0 its
lexicographic path order (usually no splice) and its sampler along spliced paths."""

import pytest
import torch

from gumiho.config import TreeConfig
from gumiho.drafters import load_drafter
from gumiho.engine import GenerateConfig, prefill, run, verify_tree
from gumiho.fta import official_for_sampling, splice_official
from gumiho.kv_cache import KVCache
from gumiho.sampling import accept, accept_greedy
from gumiho.tree import DraftTree, Pool, expand_level, select_tree


def released_splice(rows: list[list[int]]) -> tuple[list[list[int]], set[tuple[int, int]]]:
    """The released splice, step by step as its loop does it, on the retrieve-index rows
    (-1 padded, in the released order): the columns after row 0's last node, each filled
    with its most common node among the rows that have one (ties: the lowest index), and
    the last real node of the first rows made to attend to it."""
    rows = [list(r) for r in rows]
    original = [list(r) for r in rows]
    short = sum(r[-1] == -1 for r in original)
    # the last real node of each of the first `short` rows: for a full row the index
    # before its first gap (0) is -1, its last node
    leaves = [r[(r.index(-1) if -1 in r else 0) - 1] for r in original[:short]]
    extra = set()
    columns = len(rows[0])
    for col in range(columns - rows[0].count(-1), columns):
        values = [r[col] for r in original if r[col] != -1]
        best = min(set(values), key=lambda v: (-values.count(v), v))
        missing = sum(r[col] == -1 for r in original)
        for r in rows:
            if r[col] == -1:
                r[col] = best
        extra.update((leaf, best) for leaf in leaves[:missing])
    return rows, extra


def drafted_tree(seed: int, levels: int = 6, width: int = 5) -> DraftTree:
    """A tree built the way our drafters build one: a level-ordered pool of random
    log-probs, then the best nodes by cumulative score (ancestor-closed)."""
    g = torch.Generator().manual_seed(seed)
    scores, parts, first = torch.zeros(1), [], -1
    for depth in range(1, levels + 1):
        top = torch.log_softmax(torch.randn(scores.shape[0], 40, generator=g), -1).topk(width)
        level, _ = expand_level(scores, top.indices, top.values, width, first, depth)
        if depth == 1:
            level = Pool(level.tokens, torch.full_like(level.parents, -1), level.scores,
                         level.depths)
        first = sum(p.tokens.shape[0] for p in parts)
        parts.append(level)
        scores = level.scores
    budget = int(torch.randint(6, 24, (), generator=g))
    return select_tree(torch.tensor([1]), Pool.concat(parts), budget)[0]


def depth_four_tree() -> DraftTree:
    """Nodes in level order. Depth 1: 1 (long branch A), 2, 3 (a leaf). Depth 2: 4 (A),
    5 (under 2). Depth 3: 6 (A), 7 and 8 (leaves under 5). Depth 4: 9 (A)."""
    parents = torch.tensor([-1, 0, 0, 0, 1, 2, 4, 5, 5, 6])
    return DraftTree.from_parents(torch.arange(10) + 100, parents)


def test_official_fills_each_column_from_every_path_that_reaches_it():
    tree = depth_four_tree()
    assert tree.paths.tolist() == [[0, 3, -1, -1, -1], [0, 2, 5, 7, -1], [0, 2, 5, 8, -1],
                                   [0, 1, 4, 6, 9]]
    spliced = splice_official(tree)
    # depth 2: node 5 is on two paths, node 4 on one (only the longest path would say 4);
    # depth 3: 6, 7 and 8 once each, the lowest index wins; depth 4: only 9
    assert spliced.paths.tolist() == [[0, 3, 5, 6, 9], [0, 2, 5, 7, 9], [0, 2, 5, 8, 9],
                                      [0, 1, 4, 6, 9]]
    extra = {tuple(e) for e in spliced.spliced_attend.nonzero().tolist()}
    assert extra == {(3, 5), (3, 6), (3, 9), (7, 9), (8, 9)}
    assert torch.equal(spliced.mask, tree.mask)  # the tree keeps its real ancestry
    assert torch.equal(spliced.verify_mask, tree.mask | spliced.spliced_attend)
    assert spliced.unspliced().spliced_paths is None
    assert torch.equal(spliced.unspliced().verify_mask, tree.mask)


def released_order(rows: list[list[int]], sampling: bool) -> list[list[int]]:
    """The released row order: leaves in node order (greedy), or sorted with -1 after
    every index (sampling)."""
    return sorted(rows, key=lambda r: [v if v >= 0 else 10**6 for v in r]) if sampling \
        else rows


@pytest.mark.host
@pytest.mark.parametrize("sampling", [False, True])
@pytest.mark.parametrize("seed", range(8))
def test_official_splice_equals_the_released_procedure(seed, sampling):
    """On trees drafted like ours (level order, score-ranked selection) the splice gives
    the released loop's paths and extra attention exactly, in both of its row orders."""
    tree = drafted_tree(seed)
    rows = released_order(tree.paths.tolist(), sampling)
    want_rows, want_extra = released_splice(rows)
    spliced = splice_official(tree, sampling=sampling)
    if want_rows == rows:  # nothing to splice
        assert spliced.spliced_paths is None and spliced.spliced_attend is None
        return
    assert spliced.paths.tolist() == want_rows
    assert {tuple(e) for e in spliced.spliced_attend.nonzero().tolist()} == want_extra


def test_sampling_order_splices_rarely_and_quirkily():
    # the greedy splice of depth_four_tree does nothing at T > 0: the first path in the
    # lexicographic order (1-4-6-9, each level's first child) reaches the tree's depth
    again = official_for_sampling(splice_official(depth_four_tree()))
    assert again.spliced_paths is None and again.spliced_attend is None
    # 1 is a leaf: the first path is short. The released rule then gives the extra
    # attention to the first rows of that order (a full one attends to itself) and fills
    # a short path (0-2-4) without it.
    tree = DraftTree.from_parents(torch.arange(6), torch.tensor([-1, 0, 0, 2, 2, 3]))
    spliced = official_for_sampling(splice_official(tree))
    assert spliced.paths.tolist() == [[0, 1, 3, 5], [0, 2, 3, 5], [0, 2, 4, 5]]
    assert {tuple(e) for e in spliced.spliced_attend.nonzero().tolist()} == \
        {(1, 3), (1, 5), (5, 5)}


def test_short_leaf_attends_to_spliced_nodes_in_verification(tiny_target):
    """verify_tree gives a short leaf its extra keys (its logits change) and leaves every
    other node's logits as they are."""
    tree = depth_four_tree()
    tree = DraftTree.from_parents(torch.tensor([7, 3, 9, 11, 4, 5, 6, 12, 13, 14]),
                                  tree.parents)
    spliced = splice_official(tree)
    prompt = torch.tensor([[5, 17, 3, 42, 8]])
    logits = {}
    for name, t in (("plain", tree), ("spliced", spliced)):
        cache = KVCache.for_model(tiny_target.model, 64)
        prefill(tiny_target, cache, prompt)
        logits[name] = verify_tree(tiny_target, cache, t)[1]
    changed = (logits["plain"] - logits["spliced"]).abs().amax(-1) > 1e-5
    assert changed.nonzero().flatten().tolist() == [3, 7, 8]  # the short leaves


def test_official_accepts_along_spliced_paths():
    tree = depth_four_tree()
    spliced = splice_official(tree)
    # the target picks 3 at the root, then the spliced 5, 6 and 9: accepted in full
    logits = torch.full((10, 200), -5.0)
    for node, token in [(0, 103), (3, 105), (5, 106), (6, 109), (9, 150)]:
        logits[node, token] = 5.0
    accepted, bonus = accept_greedy(spliced, logits)
    assert accepted.tolist() == [0, 3, 5, 6, 9] and int(bonus) == 150
    plain, bonus = accept_greedy(tree, logits)  # lossless: one draft and the bonus
    assert plain.tolist() == [0, 3] and int(bonus) == 105


def released_sampler(candidates: list[list[int]], probs: list[list[float]],
                     rng) -> tuple[int, int, int]:
    """The released evaluate_posterior at T > 0, step by step: candidates (P, C) tokens
    of the (spliced) paths, -1 padded; probs[r][c]: the target's distribution at path r's
    column c. Returns (best path, accepted drafts, bonus token)."""
    import numpy as np

    accept_length, accepted, best = 1, candidates[0][:1], 0
    gtp = None
    for i in range(1, len(candidates[0])):
        if i != accept_length:
            break
        adjust = False
        same = [r for r in range(len(candidates)) if candidates[r][:accept_length] == accepted]
        gtp = np.array(probs[same[0]][i - 1], dtype=float)
        tried = []
        for j in same:
            x = candidates[j][i]
            if x in tried or x == -1:
                continue
            tried.append(x)
            if rng.random() <= gtp[x]:
                accepted, accept_length, best = accepted + [x], accept_length + 1, j
                break
            gtp[x] = 0
            gtp = gtp / gtp.sum()
            adjust = True
    if not (adjust and accept_length != len(candidates[0])):
        gtp = np.array(probs[best][accept_length - 1], dtype=float)
    return best, accept_length - 1, int(rng.choice(len(gtp), p=gtp / gtp.sum()))


@pytest.mark.host
def test_official_sampling_follows_the_released_sampler():
    """Along spliced paths our sampler's (path, accepted drafts, bonus) has the released
    sampler's distribution (6000 draws each, total variation < 0.05)."""
    import random
    from collections import Counter

    import numpy as np

    tree = DraftTree.from_parents(torch.tensor([0, 1, 2, 3, 1, 2]),
                                  torch.tensor([-1, 0, 0, 2, 2, 3]))
    spliced = official_for_sampling(splice_official(tree))
    assert spliced.spliced_paths is not None
    logits = torch.log(torch.tensor([[.1, .5, .3, .05, .05], [.2, .2, .2, .2, .2],
                                     [.05, .5, .05, .3, .1], [.1, .1, .6, .1, .1],
                                     [.3, .1, .1, .4, .1], [.2, .3, .1, .1, .3]]))
    paths = spliced.paths.tolist()
    candidates = [[int(spliced.tokens[n]) for n in row] for row in paths]
    probs = [[torch.softmax(logits[n], -1).tolist() for n in row] for row in paths]
    generator = torch.Generator().manual_seed(0)
    ours, theirs = Counter(), Counter()
    rng = np.random.default_rng(0)
    random.seed(0)
    for _ in range(6000):
        accepted, bonus = accept(spliced, logits, 1.0, generator)[:2]
        ours[(tuple(int(n) for n in accepted), int(bonus))] += 1
        best, n, token = released_sampler(candidates, probs, rng)
        theirs[(tuple(paths[best][: n + 1]), token)] += 1
    total_variation = sum(abs(ours[k] - theirs[k]) for k in ours | theirs) / 2 / 6000
    assert total_variation < 0.05, (ours, theirs)


def test_official_at_positive_temperature_runs(tiny_target):
    prompt = [5, 17, 3, 42, 8, 21]
    config = GenerateConfig(max_new_tokens=20, temperature=0.8, seed=3)
    drafter = load_drafter("gumiho", tiny_target, "random", tree=TreeConfig(
        top_k=4, mlp_topk=3, pruning=4, total_tokens=16, fta="official"))
    result = run(tiny_target, drafter, prompt, config)
    assert len(result.token_ids) == 20 and sum(result.accept_lengths) == 20


def test_official_penalties_count_each_nodes_own_path(tiny_target, monkeypatch):
    """The splice lets a short path's leaf attend to nodes of other paths; the penalties
    (min_tokens' depth, repetition, presence/frequency, no_repeat_ngram) read the verify
    mask too, so such a leaf counted tokens it would not emit with: min_tokens unmasked a
    stop token too early. Each row's view is its own path (a chain: of any two nodes it
    sees, one is the other's ancestor)."""
    import gumiho.fta as fta
    import gumiho.serial_drafter as serial
    from gumiho.penalty import Penalties

    seen, spliced = [], []
    rows = Penalties.rows

    def recording(self, logits, tokens, sees):
        seen.append(sees.clone())
        return rows(self, logits, tokens, sees)

    monkeypatch.setattr(Penalties, "rows", recording)
    splice = fta.splice_official

    def splicing(tree, *args, **kwargs):
        out = splice(tree, *args, **kwargs)
        spliced.append(out.spliced_attend is not None and bool(out.spliced_attend.any()))
        return out

    monkeypatch.setattr(fta, "splice_official", splicing)
    monkeypatch.setattr(serial, "splice_official", splicing)
    config = GenerateConfig(max_new_tokens=16, temperature=0.0, seed=3,
                            min_tokens=12, repetition_penalty=1.3)
    drafter = load_drafter("gumiho", tiny_target, "random", tree=TreeConfig(
        top_k=4, mlp_topk=3, pruning=4, total_tokens=16, fta="official"))
    run(tiny_target, drafter, [5, 17, 3, 42, 8, 21], config)
    assert any(spliced) and seen
    for sees in seen:
        s = sees.long()
        # i sees j and k: j sees k or k sees j (a chain of ancestors)
        for i in range(s.shape[0]):
            on = s[i].nonzero().flatten()
            pair = s[on][:, on]
            assert bool(((pair + pair.T) > 0).all()), (i, on.tolist())
