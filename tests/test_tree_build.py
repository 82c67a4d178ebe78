"""Tree construction: selection, static trees, serial-level isolation, MLP-row pairing, FTA."""

import pytest
import torch

from gumiho import rowgemm
from gumiho.config import TreeConfig
from gumiho.drafters import load_drafter
from gumiho.engine import prefill
from gumiho.fta import complete_paths, exact_fta_tree, splice_official
from gumiho.hostsync import LaunchCounter
from gumiho.kv_cache import KVCache
from gumiho.sampling import accept_greedy
from gumiho.tree import (
    LOGPROB_FLOOR,
    DraftTree,
    Pool,
    Star,
    expand_level,
    select_tree,
    static_tree,
)


def random_pool(seed, levels=4, width=6, vocab=50):
    g = torch.Generator().manual_seed(seed)
    scores = torch.zeros(1)
    parts, first = [], -1
    for depth in range(1, levels + 1):
        lp = torch.log_softmax(torch.randn(scores.shape[0], vocab, generator=g, device="cpu"), -1)
        top = lp.topk(width)
        level, _ = expand_level(scores, top.indices, top.values, width, first, depth)
        if depth == 1:  # root's children: no parent in the pool
            level = Pool(level.tokens, torch.full_like(level.parents, -1), level.scores,
                         level.depths)
        first = sum(p.tokens.shape[0] for p in parts)
        parts.append(level)
        scores = level.scores
    return Pool.concat(parts)


@pytest.mark.host
@pytest.mark.parametrize("budget", [1, 5, 13, 24])
def test_select_tree_takes_best_scores_ancestor_closed(budget):
    pool = random_pool(0)
    tree, chosen = select_tree(torch.tensor([3]), pool, budget)
    assert tree.size == budget + 1
    assert set(chosen.tolist()) == set(pool.scores.topk(budget).indices.tolist())
    for node in chosen.tolist():  # parents of chosen nodes are chosen too
        parent = int(pool.parents[node])
        assert parent == -1 or parent in chosen.tolist()
    assert (tree.depths[1:] == pool.depths[chosen]).all()
    assert (tree.tokens[1:] == pool.tokens[chosen]).all()


@pytest.mark.host
@pytest.mark.parametrize("size", [1, 2, 3, 5, 8])
def test_a_depth_1_star_is_the_selected_tree(size):
    """tree.Star's fixed fields and its two kernels give what the selection from a one-level
    pool gives, field for field (ties among the scores included)."""
    g = torch.Generator().manual_seed(size)
    scores = (torch.randn(size, generator=g) * 2).round().sort(descending=True).values
    tokens = torch.randint(0, 1000, (size,), generator=g)
    root = torch.tensor([7])
    pool = Pool(tokens, torch.full_like(tokens, -1), scores, torch.ones_like(tokens))
    tree, _ = select_tree(root[0], pool, size, max_depth=1)
    star = Star(size, torch.device("cpu")).tree(root, scores, tokens)
    for got, want in zip(star, (tree.tokens, tree.parents, tree.depths, tree.mask,
                                tree.priority), strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.host
def test_static_tree_shape():
    parents, depths, ranks = static_tree(63, 4, [0.6, 0.4, 0.3, 0.25])
    tree = DraftTree.from_parents(torch.zeros(64, dtype=torch.long), parents)
    assert tree.size == 64 and int(depths.max()) == 4
    assert (tree.depths == depths).all()
    # siblings have distinct ranks (so distinct tokens)
    for node in range(64):
        kids = (parents == node).nonzero().flatten()
        assert len(set(ranks[kids].tolist())) == len(kids)


def random_gumiho_after_prompt(target, tree: TreeConfig):
    drafter = load_drafter("gumiho", target, "random", tree=tree)
    prompt = torch.tensor([[5, 17, 3, 42, 8]])
    cache = KVCache.for_model(target.model, 64)
    features, _ = prefill(target, cache, prompt)
    drafter.begin(target, 64)
    drafter.observe(features, torch.cat([prompt[0, 1:], torch.tensor([11])]))
    return drafter


@pytest.fixture()
def gumiho_random(tiny_target):
    return random_gumiho_after_prompt(tiny_target, TreeConfig(top_k=5, mlp_topk=4, pruning=6,
                                                               total_tokens=24, fta="off"))


def test_tree_step_kernels_at_the_reference_tree(tiny_target):
    """Building the tree (MLP levels, selection, ancestor mask; part of the recorded
    drafting step) at the reference Gumiho tree (64 tokens, depth 7): on a GPU its kernels
    are tiny, so their number is its cost. 137 when the mask walked one level per step (6
    kernels a level); 92 with repeated squaring and the floor applied inside the drafter's
    steps; 84 without the MLP branches, which only `--fta exact` reads."""
    drafter = random_gumiho_after_prompt(tiny_target, TreeConfig.for_method("gumiho"))
    calls, build = [], drafter._tree_fn
    drafter._tree_fn = lambda *inputs: calls.append(inputs) or build(*inputs)
    reference = drafter.propose()
    with LaunchCounter() as launches:
        tree = DraftTree(*build(*calls[0])[:4])
    assert launches.total <= 90, launches.by_module
    assert torch.equal(tree.tokens, reference.tokens) and torch.equal(tree.mask, reference.mask)


@pytest.mark.parametrize("method", ["gumiho", "eagle2"])
def test_fused_serial_step_is_the_models_in_fewer_kernels(tiny_target, method):
    """Drafting runs the serial layers as FusedSerial (q/k/v and gate/up one product each,
    one RMSNorm call, the rotary embedding over q and k at once): the same outputs
    as the model's own step, with a cache and a tree mask, in fewer kernels (on a GPU
    each is a launch, also inside a captured step)."""
    drafter = load_drafter(method, tiny_target, "random",
                           tree=TreeConfig.for_method(method))
    model = drafter.model
    assert type(drafter.serial_step).__name__ == "FusedSerial"
    drafter.serial_step.reserve(16)  # what begin does for its cache: the rotary table
    g = torch.Generator().manual_seed(3)
    hidden = model.config.hidden_size
    tokens = torch.randint(90, (1, 5), generator=g, device="cpu").to(tiny_target.device)
    features = torch.randn(1, 5, hidden, generator=g, device="cpu").to(tiny_target.device)
    device = tiny_target.device
    positions = torch.arange(5, device=device)[None]
    outputs, counts = [], []
    for step in (model.serial_step, drafter.serial_step):
        cache = KVCache(model.config.llama_config(), 16, tiny_target.device,
                        tiny_target.dtype)
        with torch.no_grad():  # a prompt of 3 pairs, then a 2-node tree level over it
            step(tokens[:, :3], features[:, :3], positions[:, :3],
                 cache.attention_mask(torch.ones(3, 3, dtype=torch.bool, device=device).tril()),
                 cache.hf)
            cache.commit(3)
            cache.begin_step(2)
            mask = cache.attention_mask(torch.eye(2, dtype=torch.bool, device=device))
            with LaunchCounter() as launches:
                outputs.append(step(tokens[:, 3:], features[:, 3:], positions[:, 3:] * 0 + 3,
                                    mask, cache.hf))
        counts.append(launches.total)
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-5, rtol=1e-4)
    if tiny_target.device.type == "cpu" and rowgemm.kernel() is not None:
        assert torch.equal(outputs[1], outputs[0])  # rowgemm sums each output alone
    # on the CPU 95 -> 64 (EAGLE-2 50 -> 32; rowgemm's products launch no kernel); on a GPU
    # every product is a kernel too, and both steps repeat grouped KV heads there
    assert counts[1] < (0.7 if tiny_target.device.type == "cpu" else 0.85) * counts[0], counts


def test_serial_level_siblings_do_not_see_each_other(gumiho_random):
    drafter = gumiho_random
    _, out1, _, _ = drafter._catch_up()
    tokens = torch.tensor([4, 9, 23, 51])
    together, _, _ = drafter._serial_level(tokens, out1.expand(4, -1),
                                           torch.zeros(4, 0, dtype=torch.bool))
    for i in range(4):
        alone, _, _ = drafter._serial_level(tokens[i : i + 1], out1[None],
                                            torch.zeros(1, 0, dtype=torch.bool))
        torch.testing.assert_close(together[i], alone[0], atol=1e-5, rtol=0)


def record_heads(drafter) -> dict:
    """What the drafter's MLP heads are called with from now on (the last call): d1, out1,
    d2, out2, heads, first."""
    seen, original = {}, drafter.model.parallel_heads

    def record(d1, out1, d2, out2, heads=None, first=0):
        seen.update(d1=d1, out1=out1, d2=d2, out2=out2, heads=heads, first=first)
        return original(d1, out1, d2, out2, heads, first)

    drafter.model.parallel_heads = record
    return seen


def test_each_mlp_row_pairs_a_level2_node_with_its_own_parent(gumiho_random):
    drafter = gumiho_random
    seen = record_heads(drafter)
    drafter.propose()
    out1 = seen["out1"][0]
    for j in range(seen["d1"].shape[0]):
        # out2[j] is what serial step 2 gives for d1[j] alone ...
        alone = drafter._serial_level(seen["d1"][j : j + 1], out1[None],
                                      torch.zeros(1, 0, dtype=torch.bool))[0][0]
        torch.testing.assert_close(seen["out2"][j], alone, atol=1e-5, rtol=0)
        # ... and d2[j] was drawn from that output's top-k
        top = drafter._top(alone, drafter.beam)[1]
        assert int(seen["d2"][j]) in top.tolist()


def test_gumiho_tree_invariants(gumiho_random):
    tree = gumiho_random.propose()
    assert tree.size == 24 and int(tree.depths.max()) <= 7
    for i in range(tree.size):  # the mask is exactly "self and ancestors"
        row = set(tree.mask[i].nonzero().flatten().tolist())
        node, anc = i, {i}
        while tree.parents[node] >= 0:
            node = int(tree.parents[node])
            anc.add(node)
        assert row == anc


def hand_tree():
    # nodes in level order, like a drafter's: 0 root; short path 0-2 (B), listed first as
    # its leaf comes first; long path 0-1-3-4 (A). Token = node index.
    return DraftTree.from_parents(torch.tensor([0, 1, 2, 3, 4]),
                                  torch.tensor([-1, 0, 0, 1, 3]))


@pytest.mark.host
def test_official_fta_accepts_tokens_verified_in_another_branch():
    tree = hand_tree()
    spliced = splice_official(tree)
    assert spliced.paths.tolist() == [[0, 2, 3, 4], [0, 1, 3, 4]]
    # Target argmax: root -> 2 (branch B), node 2 -> 3, node 3 -> 4. Node 3's logits were
    # computed in branch A's context (after token 1), not after token 2.
    logits = torch.full((5, 5), -5.0)
    for node, best in [(0, 2), (2, 3), (3, 4), (1, 0), (4, 0)]:
        logits[node, best] = 5.0
    accepted, _ = accept_greedy(spliced, logits)
    assert accepted.tolist() == [0, 2, 3, 4]  # 3 drafts, the last two justified by A's context
    plain, bonus = accept_greedy(tree, logits)
    assert plain.tolist() == [0, 2] and int(bonus) == 3  # lossless: 1 draft + bonus 3


@pytest.mark.host
def test_exact_fta_completes_mlp_leaves_within_budget():
    pool = random_pool(1, levels=7, width=5)
    branch = torch.where(pool.depths >= 2, torch.arange(pool.tokens.shape[0]) % 5, -1)
    chains = torch.randint(50, (5, 5), generator=torch.Generator().manual_seed(0), device="cpu")
    root = torch.tensor([1])
    for budget in (6, 12, 20, 30):
        tree = exact_fta_tree(root, pool, budget, branch, chains, first_mlp_depth=3)
        assert tree.size - 1 <= budget
        leaves = [i for i in range(tree.size) if i not in tree.parents.tolist()]
        assert all(int(tree.depths[leaf]) in (1, 7) for leaf in leaves)
    # completion appends the branch's own chain under a depth-2 leaf
    child = int((pool.depths == 2).nonzero()[0])
    chosen = torch.tensor([int(pool.parents[child]), child])  # a depth-1 node and its child
    tree = complete_paths(root, pool, chosen, branch, chains, first_mlp_depth=3)
    leaf_branch = int(branch[chosen[-1]])
    assert tree.tokens[3:].tolist() == chains[leaf_branch].tolist()
    assert tree.paths.tolist() == [list(range(8))]


def token_paths(tree):
    """The set of root-to-node token paths of a tree (independent of node order)."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    paths = []
    for node in range(1, len(tokens)):
        path, n = [], node
        while n > 0:
            path.append(tokens[n])
            n = parents[n]
        paths.append(tuple(reversed(path)))
    return set(paths)


@pytest.mark.parametrize("size", [5, 8, 16])
def test_capped_levels_build_the_uncapped_tree(smollm2, size):
    """Per-level candidate caps at the budget (and MLP rows at W - 2) change nothing."""
    from gumiho.config import TreeConfig
    from gumiho.drafters import load_drafter

    ids = smollm2.chat_ids("Write a haiku about the sea.")
    trees = {}
    for capped in (True, False):
        drafter = load_drafter("gumiho", smollm2, "random",
                               tree=TreeConfig.for_method("gumiho", total_tokens=size))
        if not capped:
            drafter.beam, drafter.mlp_rows = drafter.tree.top_k, drafter.tree.top_k
            drafter.mlp_topk, drafter.pruning = drafter.tree.mlp_topk, drafter.tree.pruning
        trees[capped] = propose_after_prompt(smollm2, drafter, ids)
    assert trees[True].size == trees[False].size == size
    assert token_paths(trees[True]) == token_paths(trees[False])


def propose_after_prompt(target, drafter, ids):
    from gumiho.engine import prefill
    from gumiho.kv_cache import KVCache

    cache = KVCache.for_model(target.model, 128)
    prompt = torch.tensor([ids])
    features, logits = prefill(target, cache, prompt)
    drafter.begin(target, 128)
    drafter.observe(features, torch.cat([prompt[0, 1:], logits[-1].argmax().view(1)]))
    return drafter.propose()


def test_gumiho_depth_uses_fewer_heads(smollm2):
    from gumiho.config import TreeConfig
    from gumiho.drafters import load_drafter

    ids = smollm2.chat_ids("Write a haiku about the sea.")
    for depth in (2, 4, 7):
        drafter = load_drafter("gumiho", smollm2, "random",
                               tree=TreeConfig.for_method("gumiho", depth=depth))
        tree = propose_after_prompt(smollm2, drafter, ids)
        assert drafter.heads == depth - 2 and drafter.draft_depth == depth
        assert int(tree.depths.max()) <= depth


@pytest.mark.parametrize("levels, serial_depth, first_head, heads", [
    (2, 2, 0, 5), (3, 3, 1, 4), (4, 4, 2, 3), (7, 7, 5, 0), (9, 7, 5, 0)])
def test_serial_levels_take_the_levels_of_the_first_heads(tiny_target, levels, serial_depth,
                                                          first_head, heads):
    """`--serial-levels S`: the serial head drafts levels 1..S, and MLP head j still draws
    level j + 2, so the heads from S - 1 on follow, within the tree's depth of 7."""
    drafter = load_drafter("gumiho", tiny_target, "random",
                           tree=TreeConfig.for_method("gumiho", serial_levels=levels))
    assert (drafter.serial_depth, drafter.first_head, drafter.heads) == \
        (serial_depth, first_head, heads)
    assert drafter.draft_depth == 7


@pytest.mark.parametrize("levels", [3, 4])
def test_mlp_levels_under_deeper_serial_levels_come_from_their_level2_ancestor(
        tiny_target, levels):
    """With S serial levels, a node at MLP level d (> S) is one of the top candidates of
    head d - 3 (0-based) run on its own level-2 ancestor; the tree is the pool's best nodes,
    ancestor-closed, with its serial levels from the serial steps."""
    tree = TreeConfig(top_k=5, mlp_topk=4, pruning=6, total_tokens=40, depth=7, fta="off",
                      serial_levels=levels)
    drafter = random_gumiho_after_prompt(tiny_target, tree)
    seen = record_heads(drafter)
    calls, build = [], drafter._levels
    drafter._levels = lambda *a: calls.append(build(*a)) or calls[-1]
    tree_out = drafter.propose()
    assert seen["first"] == levels - 2 and seen["heads"] == 7 - levels
    serial, (values, indices, branch) = calls[-1]
    pool, branches = drafter._mlp_pool(serial, values, indices, branch)
    assert serial.tokens.shape[0] == levels * drafter.beam  # a beam a serial level
    assert seen["d2"].shape[0] == drafter.beam  # every level-2 node gets heads
    level2 = list(range(drafter.beam, 2 * drafter.beam))  # pool indices, in row order
    for node in range(pool.tokens.shape[0]):
        depth, ancestor = int(pool.depths[node]), node
        if depth < levels:  # above the last serial level: no heads' row
            assert int(branches[node]) == -1
            continue
        while int(pool.depths[ancestor]) > 2:
            ancestor = int(pool.parents[ancestor])
        row = level2.index(ancestor)
        assert int(branches[node]) == row
        if depth > levels:  # an MLP level: drawn by head depth - 3 of its ancestor's row
            assert int(pool.tokens[node]) in indices[row, depth - levels - 1].tolist()
    assert int(tree_out.depths.max()) <= 7
    for i in range(1, tree_out.size):  # topological and ancestor-closed
        assert 0 <= int(tree_out.parents[i]) < i
        assert tree_out.mask[i, tree_out.parents[i]]


@pytest.mark.host
def test_serial_levels_are_refused_where_they_mean_nothing_and_named_in_reports():
    from gumiho.config import check_tree_options
    from gumiho.errors import GumihoError
    from gumiho.evaluation.speed import method_label

    for bad in (1, -1):
        with pytest.raises(GumihoError, match="--serial-levels"):
            TreeConfig(serial_levels=bad)
    for bad in (True, 2.5):  # the API's wrong types
        with pytest.raises(TypeError, match="serial_levels must be an int"):
            TreeConfig(serial_levels=bad)
    with pytest.raises(GumihoError, match="--fta exact"):
        TreeConfig(serial_levels=3, fta="exact")
    with pytest.raises(GumihoError, match="--serial-levels does not apply to --method eagle2"):
        check_tree_options("eagle2", {"serial_levels": 3})
    settings = {"method": "gumiho", "draft": "d", "tree": {"serial_levels": 4}}
    assert method_label(settings) == "gumiho (serial levels 4)"
    assert method_label({**settings, "tree": {"serial_levels": 2}}) == "gumiho"


@pytest.mark.host
@pytest.mark.parametrize("budget", range(1, 40))
def test_select_tree_stays_ancestor_closed_when_scores_tie(budget):
    """Floored draft log-probs (and, in float32, scores below about -16 whose children are
    near-certain) tie a node with its children once the per-depth 1e-6 is rounded away:
    the selection must still take a parent before its child, never a child alone (whose
    parent index then was -1: a second root)."""
    n = 20  # root children: one likely, n - 1 floored; each floored one has a sure child
    pool = Pool(tokens=torch.arange(2 * n) + 5,
                parents=torch.tensor([-1] * n + list(range(n))),
                scores=torch.tensor([0.0] + [LOGPROB_FLOOR] * (2 * n - 1)),
                depths=torch.tensor([1] * n + [2] * n))
    tree, chosen = select_tree(torch.tensor([1]), pool, budget)
    picked = set(chosen.tolist())
    assert all(int(pool.parents[i]) in picked | {-1} for i in picked)
    assert (tree.parents[1:] >= 0).all() and (tree.depths[1:] >= 1).all()
