"""`--total-tokens auto`: acceptance by tree size from one calibration run, and the choice."""

import json
import os
from dataclasses import replace

import pytest
import torch

from gumiho import budget
from gumiho.config import TreeConfig
from gumiho.drafters import load_drafter
from gumiho.engine import GenerateConfig, run
from gumiho.generate import SpeculativeGenerator
from gumiho.target import load_target
from gumiho.tree import DraftTree, Pool, select_tree

from drafters_for_tests import oracle_drafter


def hand_tree():
    # root 0; 1 (best) -> 3 -> 5; 2 -> 4; priorities rank nodes 1, 2, 3, 4, 5
    tree = DraftTree.from_parents(torch.tensor([0, 10, 20, 11, 21, 12]),
                                  torch.tensor([-1, 0, 0, 1, 2, 3]))
    return replace(tree, priority=torch.tensor([float("inf"), -1.0, -2.0, -3.0, -4.0, -5.0]))


@pytest.mark.host
def test_accept_by_size_keeps_the_path_prefix_inside_each_budget():
    tree = hand_tree()
    # accepted drafts 10, 11, 12: nodes 1, 3, 5 with ranks 0, 2, 4
    accept = budget.accept_by_size([tree], [[10, 11, 12]], [2, 3, 4, 5, 6])
    assert accept == {2: 2, 3: 2, 4: 3, 5: 3, 6: 4}  # 1 + accepted drafts kept
    assert budget.accept_by_size([tree], [[]], [6]) == {6: 1}


@pytest.mark.host
def test_select_tree_priority_ranks_a_smaller_budget_as_its_prefix():
    gen = torch.Generator().manual_seed(0)
    # descending, so parents outrank
    scores = -torch.rand(30, generator=gen, device="cpu").cumsum(0)
    parents = torch.tensor([-1] * 5 + [int(torch.randint(i, (), generator=gen, device="cpu"))
                                       for i in range(5, 30)])
    depths = torch.ones(30, dtype=torch.long)
    for i in range(5, 30):
        depths[i] = depths[parents[i]] + 1
    pool = Pool(tokens=torch.arange(30), parents=parents, scores=scores, depths=depths)
    root = torch.tensor(99)
    big, _ = select_tree(root, pool, 20)
    order = torch.argsort(big.priority[1:], descending=True)
    for budget_size in (5, 10, 15):
        small, _ = select_tree(root, pool, budget_size)
        assert set(big.tokens[1:][order[:budget_size]].tolist()) == \
            set(small.tokens[1:].tolist())


def recording(drafter, trees: list):
    """The drafter, each tree it proposes appended to `trees`."""
    propose = drafter.propose
    drafter.propose = lambda: trees.append(propose()) or trees[-1]
    return drafter


def reference_first_cycle(target, prompt: str):
    """The prompt's plain answer and the first cycle of a reference-size Gumiho oracle:
    (ids, plain result, full sequence, [its first tree], that cycle's accepted drafts)."""
    ids = target.chat_ids(prompt)
    plain = run(target, load_drafter("ar", target), ids, GenerateConfig(max_new_tokens=16))
    full = ids + plain.token_ids
    trees = []
    big = recording(oracle_drafter("gumiho", target, full, TreeConfig.for_method("gumiho")),
                    trees)
    first = run(target, big, ids, GenerateConfig(max_new_tokens=16))
    return ids, plain, full, trees[:1], first.token_ids[1: first.accept_lengths[1]]


def test_predicted_accept_matches_a_real_smaller_tree_on_the_first_cycle(smollm2):
    """The counterfactual is exact: the first cycle of a real size-W run accepts what
    the size-64 calibration tree predicted for W."""
    ids, _, full, trees, drafts = reference_first_cycle(smollm2,
                                                        "List three uses of a paperclip.")
    for width in (2, 3, 5, 8, 64):
        predicted = budget.accept_by_size(trees, [drafts], [width])[width]
        tree = TreeConfig.for_method("gumiho", total_tokens=width)
        real = run(smollm2, oracle_drafter("gumiho", smollm2, full, tree), ids,
                   GenerateConfig(max_new_tokens=16))
        assert real.accept_lengths[1] == predicted, width


def test_a_depth_one_gumiho_tree_drafts_level_one_alone(smollm2):
    """`--depth 1`: the serial level-1 candidates only, no serial step, no heads; output
    still plain's, and the first cycle accepts what the reference tree predicted for that
    shape. (Auto does not try it for Gumiho: on this CPU it picked 2 tokens at depth 1 and
    ran 1.43x against the 3-token chain's 1.45x over six benchmarks; docs/engine.md.)"""
    ids, plain, full, trees, drafts = reference_first_cycle(smollm2,
                                                            "List three uses of a paperclip.")
    shape = budget.Shape(3, 1)
    predicted = budget.accept_by_shape(trees, [drafts], [shape])[shape]
    shallow = []
    small = recording(oracle_drafter("gumiho", smollm2, full,
                                     shape.tree(TreeConfig.for_method("gumiho"))), shallow)
    assert small.serial_depth == 1 and small.heads == 0 and small.draft_depth == 1
    real = run(smollm2, small, ids, GenerateConfig(max_new_tokens=16))
    assert real.token_ids == plain.token_ids
    assert real.accept_lengths[1] == predicted
    assert all(int(t.depths.max()) <= 1 and t.size <= 3 for t in shallow)


def test_a_captured_cycle_step_replays_the_loops_drafting_and_commits_nothing(
        tiny_target_dir):
    """What auto times as a captured engine's catch-up (with a proposal): the drafting step
    the loop replays, over a full accept, giving the tree the loop's catch-up and proposal
    give from the same pairs, again and again at the same cache slots. None where drafting
    is not one recorded step."""
    target = load_target(tiny_target_dir)
    tree = TreeConfig.for_method("gumiho", total_tokens=8, top_k=3, mlp_topk=3, pruning=3,
                                 depth=4)
    ids = list(range(8, 40))
    drafter = load_drafter("gumiho", target, "random", tree=tree, engine="static")
    whole = budget.cycle_step(target, drafter, "static", ids)
    length = drafter.cache.length
    first, again = whole(), whole()
    assert drafter.cache.length == length == len(ids)  # the prompt's, and nothing since
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    # the loop's way: the same drafter state, the same pairs observed, then propose
    loop = load_drafter("gumiho", target, "random", tree=tree, engine="static")
    features, tokens = budget._prime(target, loop, ids)
    loop.propose()
    width = loop.draft_depth + 1
    loop.observe(features[-width:], tokens[-width:], ids[-width:])
    proposed = loop.propose()
    assert torch.equal(proposed.tokens, first[0]) and torch.equal(proposed.parents, first[1])
    assert loop.cache.length == length + width  # (the loop commits the accept)
    for engine, method in (("eager", "gumiho"), ("static", "medusa")):
        other = load_drafter(method, target, "random",
                             tree=TreeConfig.for_method(method, total_tokens=8), engine=engine)
        assert budget.cycle_step(target, other, engine, ids) is None


@pytest.mark.parametrize("engine", ["eager", "static"])
def test_auto_picks_the_best_measured_shape(tiny_target_dir, tmp_path, monkeypatch, engine):
    monkeypatch.setenv("GUMIHO_CACHE", str(tmp_path))
    monkeypatch.setattr(budget, "FLAT_VERIFY", 0.0)  # the tiny model's verify is nearly free
    target = load_target(tiny_target_dir)
    tree = TreeConfig.for_method("gumiho", total_tokens=8, top_k=3, mlp_topk=3, pruning=3,
                                 depth=4)  # (the shapes' count, and so the time, grows with it)
    report = budget.choose_tree(target, "gumiho", "random", tree, engine,
                                max_new_tokens=8, widths=(4, 8))
    # every shape pays the catch-up: timed as a phase by eager steps, and where a captured
    # engine records it inside the one drafting step, that step less a proposal, in turns
    fixed = report["fixed_s"]
    assert 0 < fixed["draft_catchup"] < fixed["draft"], fixed
    shapes = report["shapes"]
    # a size past what the tree holds at a depth (1 + 3 a level) is named for what it holds:
    # 8 tokens to depth 1 are its 4, to depth 2 its 7
    holds = {d: 1 + 3 * d for d in range(1, 5)}
    assert {(r["total_tokens"], r["depth"], r["chain"]) for r in shapes.values()} == \
        {(min(w, holds[d]), d, False) for w in (4, 8) for d in range(1, 5) if w - 1 >= d} | \
        {(d + 1, d, True) for d in range(1, 5)}
    for row in shapes.values():
        assert row["accept"] >= 1 and row["cycle_s"] > 0
    # the model's best FINALISTS ran whole cycles; the fastest of those is chosen
    ranked = sorted(shapes.values(), key=lambda row: -row["tokens_per_s"])
    finalists = [row for row in shapes.values() if "measured_tokens_per_s" in row]
    assert finalists and len(finalists) == budget.FINALISTS
    assert all("measured_tokens_per_s" in row for row in ranked[:budget.FINALISTS])
    assert all(row["measured_tokens_per_s"] > 0 for row in finalists)
    best = max(finalists, key=lambda row: row["measured_tokens_per_s"])
    chosen = budget.Shape(best["total_tokens"], best["depth"], best["chain"]).tree(tree)
    assert report["tree"]["total_tokens"] == chosen.total_tokens
    assert report["tree"]["depth"] == chosen.depth
    assert budget.chosen_row(report)[1] is best  # named in the report (the demo prints it)
    old = {key: value for key, value in report.items() if key != "chosen"}  # cached earlier
    assert budget.chosen_row(old)[1]["total_tokens"] == chosen.total_tokens
    # the chosen shape's whole cycle in plain steps, measured: a value for --draft-gate,
    # which auto leaves to the caller
    assert report["break_even"] > 0 and "draft_gate" not in report["tree"]
    # the speed report labels answers by the tree the report chose (gen_answers stores it)
    from gumiho.evaluation.speed import method_label

    label = method_label({"method": "gumiho", "draft": "random", "auto_tree": report})
    assert label == f"gumiho (random, auto tree {chosen.total_tokens}, depth {chosen.depth})"


@pytest.mark.parametrize("flat", [True, False])
def test_auto_tries_trees_past_the_reference_where_a_verify_is_nearly_free(
        tiny_target_dir, tmp_path, monkeypatch, caplog, flat):
    """Where the reference width's verify costs at most FLAT_VERIFY plain steps, the
    candidates take sizes past the reference at each depth whose wider pool holds them,
    the calibration runs on that pool, and the chosen tree is drawn from it; elsewhere
    nothing changes."""
    monkeypatch.setenv("GUMIHO_CACHE", str(tmp_path))
    monkeypatch.setattr(budget, "FLAT_VERIFY", 1e9 if flat else 0.0)
    monkeypatch.setattr(budget, "WIDE_WIDTHS", (12, 16, 400))
    monkeypatch.setattr(budget, "WIDE_BEAM", 5)
    monkeypatch.setattr(budget, "WIDE_PRUNING", 6)
    calibrated = []
    real_calibrate = budget.calibrate
    monkeypatch.setattr(budget, "calibrate", lambda target, drafter, *args: (
        calibrated.append(drafter) or real_calibrate(target, drafter, *args)))
    target = load_target(tiny_target_dir)
    tree = TreeConfig.for_method("gumiho", total_tokens=8, top_k=3, mlp_topk=3, pruning=3,
                                 depth=4)
    report = budget.choose_tree(target, "gumiho", "random", tree, "eager", max_new_tokens=8,
                                widths=(4, 8))
    sizes = {(row["total_tokens"], row["depth"]) for row in report["shapes"].values()}
    [drafter] = calibrated
    if flat:
        # the pool: 2 serial levels of 5, then 2 MLP levels of 6 = 22 nodes (16 to depth 3,
        # 10 to depth 2); 400 is past it
        assert drafter.max_nodes == 23 and (drafter.beam, drafter.pruning) == (5, 6)
        assert {(w, d) for w, d in sizes if w > 8} == {(12, 3), (16, 3), (12, 4), (16, 4)}
        assert report["pool"] == {"total_tokens": 400, "top_k": 5, "pruning": 6}
        # a top_k the caller gave wins: no wider pool, its beam and pruning kept
        kept = budget.choose_tree(target, "gumiho", "random", tree, "eager", max_new_tokens=8,
                                  widths=(4, 8), kept=frozenset({"top_k"}))
        assert kept["pool"] == {"total_tokens": 8, "top_k": 3, "pruning": 3}
        assert (kept["tree"]["top_k"], kept["tree"]["pruning"]) in ((3, 3), (1, 1))
    else:
        assert drafter.max_nodes == 8 and (drafter.beam, drafter.pruning) == (3, 3)
        assert max(w for w, _ in sizes) == 8
        assert report["pool"] == {"total_tokens": 8, "top_k": 3, "pruning": 3}

    def drawn_from_its_pool(report):  # a chain keeps its beam of 1
        chain = budget.chosen_row(report)[1]["chain"]
        pool = report["pool"]
        wanted = (1, 1) if chain else (pool["top_k"], pool["pruning"])
        return (report["tree"]["top_k"], report["tree"]["pruning"]) == wanted

    assert drawn_from_its_pool(report) and report["reference_verify"] > 0
    # The generator sizes from the method's own reference, 64 tokens, which the wider pool
    # (23 nodes here) does not pass: its pool is that reference, whatever the verify costs.
    gen = SpeculativeGenerator.load(tiny_target_dir, "gumiho", "random", total_tokens="auto",
                                    top_k=3, mlp_topk=3, pruning=3, depth=4)
    chosen = gen.auto_report["tree"]  # (random weights are not cached: chosen again)
    assert gen.auto_report["pool"] == {"total_tokens": 64, "top_k": 3, "pruning": 3}
    # and at each depth no size past what that tree holds (its 64 tokens hold 2 levels of
    # 3, then 2 of 3: 13 with the root), so a shape's name is what it verifies
    holds = {d: 1 + 3 * d for d in range(1, 5)}
    assert all(row["total_tokens"] <= holds[row["depth"]]
               for row in gen.auto_report["shapes"].values())
    assert drawn_from_its_pool(gen.auto_report)
    if chosen["depth"] < 4:  # auto's own pick, not a network short of the asked depth
        assert "past what this drafter drafts" not in caplog.text
    assert (gen.drafter.tree.top_k, gen.drafter.tree.pruning, gen.drafter.max_nodes) == \
        (chosen["top_k"], chosen["pruning"], chosen["total_tokens"])  # runs what was chosen


def test_auto_grows_a_static_tree_past_the_reference_where_a_verify_is_nearly_free(
        tiny_target_dir, tmp_path, monkeypatch):
    """Medusa's static tree, built best first, takes the sizes past the reference at its
    own depth, and nothing else about it changes."""
    monkeypatch.setenv("GUMIHO_CACHE", str(tmp_path))
    monkeypatch.setattr(budget, "FLAT_VERIFY", 1e9)
    monkeypatch.setattr(budget, "WIDE_WIDTHS", (12, 16))
    target = load_target(tiny_target_dir)
    tree = TreeConfig.for_method("medusa", total_tokens=8)
    report = budget.choose_tree(target, "medusa", "random", tree, "eager", max_new_tokens=8,
                                widths=(4, 8))
    sizes = {(row["total_tokens"], row["depth"]) for row in report["shapes"].values()}
    assert sizes == {(w, tree.depth) for w in (4, 8, 12, 16)}
    assert report["pool"] == {"total_tokens": 16, "top_k": tree.top_k, "pruning": tree.pruning}
    assert {k: report["tree"][k] for k in ("top_k", "mlp_topk", "pruning")} == \
        {"top_k": tree.top_k, "mlp_topk": tree.mlp_topk, "pruning": tree.pruning}


def test_auto_at_a_temperature_calibrates_and_times_at_it(tiny_target_dir, tmp_path,
                                                         monkeypatch):
    """At T > 0 the acceptance by shape comes from sampled cycles, the finalists run sampled
    (each repeat with its own seed), the widths are timed with their draws, and the choice
    is cached apart from the greedy one (temperatures to two decimals)."""
    monkeypatch.setenv("GUMIHO_CACHE", str(tmp_path))
    target = load_target(tiny_target_dir)
    tree = TreeConfig.for_method("gumiho", total_tokens=6, top_k=3, mlp_topk=3, pruning=3,
                                 depth=2)
    runs, draws = [], []
    real_run, real_sample = budget.run, budget.sample_tokens
    monkeypatch.setattr(budget, "run", lambda target, drafter, ids, config, **kw: (
        runs.append((config.temperature, config.seed)) or real_run(target, drafter, ids,
                                                                   config, **kw)))
    monkeypatch.setattr(budget, "sample_tokens", lambda logits, temperature, generator: (
        draws.append(temperature) or real_sample(logits, temperature, generator)))
    report = budget.choose_tree(target, "gumiho", "random", tree, "eager", max_new_tokens=8,
                                widths=(3, 6), temperature=0.7)
    assert report["temperature"] == 0.7 and {t for t, _ in runs} == {0.7}
    assert len({seed for _, seed in runs}) == 3  # the finalists' repeats
    assert draws and set(draws) == {0.7}
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "model.safetensors").write_bytes(b"")
    greedy = budget._cache_file(target, "gumiho", str(draft), tree, "eager")
    assert greedy == budget._cache_file(target, "gumiho", str(draft), tree, "eager", 0.0)
    sampled = budget._cache_file(target, "gumiho", str(draft), tree, "eager", 0.7)
    assert sampled not in (greedy, budget._cache_file(target, "gumiho", str(draft), tree,
                                                       "eager", 1.0))
    assert sampled == budget._cache_file(target, "gumiho", str(draft), tree, "eager", 0.701)


@pytest.mark.host
def test_a_generator_sizes_its_tree_for_each_temperature_once(tiny_target_dir, monkeypatch):
    """total_tokens="auto": the shape for the load's temperature (greedy by default) at
    load, another chosen at the first call at another temperature (the evaluation records
    it), each chosen once."""
    from gumiho import generate

    asked = []

    def choose(target, method, draft, tree, engine, temperature=0.0, kept=frozenset()):
        asked.append(temperature)
        size = 5 if temperature else 3
        return {"tree": {"total_tokens": size, "depth": 1, "top_k": 4, "mlp_topk": 1,
                         "pruning": 1, "fta": "off"}, "break_even": 1.2,
                "temperature": temperature}

    monkeypatch.setattr(generate, "choose_tree", choose)
    gen = SpeculativeGenerator.load(tiny_target_dir, "gumiho", "random", total_tokens="auto")
    assert asked == [0.0] and gen.drafter.tree.total_tokens == 3
    assert gen.drafter_for(0.0) is gen.drafter and gen.auto_report_for(0) is gen.auto_report
    out = gen.generate([5, 6, 7, 8], max_new_tokens=6, temperature=0.8, seed=1)
    assert asked == [0.0, 0.8] and len(out.token_ids) == 6
    sampled = gen.drafter_for(0.8)
    assert sampled is not gen.drafter and sampled.tree.total_tokens == 5
    assert gen.auto_report_for(0.8)["temperature"] == 0.8
    gen.generate([5, 6, 7, 8], max_new_tokens=6, temperature=0.8, seed=2)
    gen.generate([5, 6, 7, 8], max_new_tokens=6)
    assert asked == [0.0, 0.8]  # each chosen once
    asked.clear()  # sized at load for the temperature it will decode at (the CLI's)
    warm = SpeculativeGenerator.load(tiny_target_dir, "gumiho", "random", total_tokens="auto",
                                     temperature=0.8)
    assert asked == [0.8] and warm.drafter.tree.total_tokens == 5
    assert warm.drafter_for(0.8) is warm.drafter and warm.auto_report["temperature"] == 0.8
    assert warm.drafter_for(0.0).tree.total_tokens == 3 and asked == [0.8, 0.0]
    fixed = SpeculativeGenerator.load(tiny_target_dir, "gumiho", "random", total_tokens=4)
    assert fixed.drafter_for(0.8) is fixed.drafter and fixed.auto_report_for(0.8) is None


@pytest.mark.host
def test_auto_below_the_methods_shallowest_depth_tries_the_reference_depth(monkeypatch):
    """`--total-tokens auto --depth 1` for a method whose auto tries depths from 2 (Gumiho's
    did until 2026-11-29): the shapes of the asked depth, not none (it was an internal error
    in max())."""
    from gumiho.methods import method_spec

    monkeypatch.setattr(budget, "method_spec",
                        lambda name: replace(method_spec(name), auto_min_depth=2))
    reference = TreeConfig.for_method("gumiho", total_tokens=6, top_k=3, depth=1)
    shapes = budget.candidate_shapes("gumiho", reference, widths=(4, 6))
    assert set(shapes) == {budget.Shape(4, 1), budget.Shape(6, 1),
                           budget.Shape(2, 1, chain=True)}


@pytest.mark.host
def test_shape_subtrees_of_a_reference_tree():
    tree = hand_tree()  # depths: 1 -> 1, 2 -> 1, 3 -> 2, 4 -> 2, 5 -> 3
    assert budget.kept_nodes(tree, budget.Shape(3, 1)) == {0, 1, 2}
    assert budget.kept_nodes(tree, budget.Shape(4, 2)) == {0, 1, 2, 3}
    assert budget.kept_nodes(tree, budget.Shape(4, 3, chain=True)) == {0, 1, 3, 5}
    shapes = [budget.Shape(6, 2), budget.Shape(4, 3, chain=True), budget.Shape(2, 1)]
    accept = budget.accept_by_shape([tree], [[10, 11, 12]], shapes)
    assert accept == {shapes[0]: 3, shapes[1]: 4, shapes[2]: 2}


def test_auto_through_the_generator_needs_a_drafter(tiny_target_dir):
    from gumiho.errors import GumihoError

    with pytest.raises(GumihoError, match="auto needs --draft"):
        SpeculativeGenerator.load(tiny_target_dir, "gumiho", None, total_tokens="auto")


def test_the_cached_choice_is_shared_with_and_without_a_lookup_chain(tiny_target_dir,
                                                                    tmp_path, monkeypatch):
    """Calibration ignores the lookup chain, so --lookup N reads the same cached shape (one
    calibration, not one per N); other tree settings still get their own."""
    monkeypatch.setenv("GUMIHO_CACHE", str(tmp_path / "cache"))
    target = load_target(tiny_target_dir)
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "model.safetensors").write_bytes(b"")
    tree = TreeConfig.for_method("gumiho", total_tokens=8)
    path = budget._cache_file(target, "gumiho", str(draft), tree, "eager")
    assert path == budget._cache_file(target, "gumiho", str(draft),
                                      replace(tree, lookup=10), "eager")
    assert path == budget._cache_file(target, "gumiho", str(draft),
                                      replace(tree, draft_gate=1.3), "eager")
    assert path == budget._cache_file(target, "gumiho", str(draft),
                                      replace(tree, min_confidence=0.1), "eager")
    assert path != budget._cache_file(target, "gumiho", str(draft),
                                      replace(tree, top_k=3), "eager")
    # what else moves the costs or the prompts: the threads, the drafter's 16-bit head,
    # the chat template, and top_k or pruning fixed by the caller (no wider pool then)
    assert path != budget._cache_file(target, "gumiho", str(draft), tree, "eager",
                                      kept=frozenset({"top_k"}))
    monkeypatch.setenv("GUMIHO_DRAFT_HEAD16", "0")
    assert path != budget._cache_file(target, "gumiho", str(draft), tree, "eager")
    monkeypatch.delenv("GUMIHO_DRAFT_HEAD16")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 97)
    assert path != budget._cache_file(target, "gumiho", str(draft), tree, "eager")
    monkeypatch.undo()
    monkeypatch.setenv("GUMIHO_CACHE", str(tmp_path / "cache"))
    vicuna = load_target(tiny_target_dir, chat_template="vicuna")
    assert path != budget._cache_file(vicuna, "gumiho", str(draft), tree, "eager")
    assert path == budget._cache_file(target, "gumiho", str(draft), tree, "eager")
    # a new weights file is a new drafter
    os.utime(draft / "model.safetensors", ns=(1, 1))
    assert path != budget._cache_file(target, "gumiho", str(draft), tree, "eager")


@pytest.mark.host
def test_a_target_without_a_tokenizer_calibrates_on_fixed_ids(tiny_target_dir):
    target = load_target(tiny_target_dir)
    bare = replace(target, tokenizer=None)
    ids = budget.calibration_ids(bare)
    assert len(ids) == len(budget.CALIBRATION_PROMPTS) and all(ids)
    assert all(0 <= i < target.config.vocab_size for prompt in ids for i in prompt)
    assert budget.calibration_ids(target)[0] == target.chat_ids(budget.CALIBRATION_PROMPTS[0])


def test_an_unreadable_cached_choice_is_measured_again(tiny_target_dir, tmp_path, monkeypatch,
                                                       caplog):
    from gumiho.checkpoint import save_drafter
    from gumiho.drafters import random_drafter_model

    monkeypatch.setenv("GUMIHO_CACHE", str(tmp_path / "cache"))
    target = load_target(tiny_target_dir)
    save_drafter(random_drafter_model("gumiho", target, 0), tmp_path / "draft")
    tree = TreeConfig.for_method("gumiho", total_tokens=4, top_k=2, mlp_topk=2, pruning=2,
                                 depth=2)
    path = budget._cache_file(target, "gumiho", str(tmp_path / "draft"), tree, "eager")
    path.parent.mkdir(parents=True)
    for bad in ("[1]", '{"tree": 3, "shapes": {}}'):
        path.write_text(bad)
        report = budget.choose_tree(target, "gumiho", str(tmp_path / "draft"), tree, "eager",
                                    max_new_tokens=4, widths=(4,))
        assert report["shapes"] and budget.chosen_row(report)
        assert "measuring again" in caplog.text
        assert json.loads(path.read_text())["tree"] == report["tree"]  # cached anew


@pytest.mark.host
def test_auto_leaves_the_gate_to_the_caller(tiny_target_dir, monkeypatch):
    from gumiho import generate
    from gumiho.gate import GatedDrafter

    report = {"tree": {"total_tokens": 3, "depth": 2, "top_k": 1, "mlp_topk": 1,
                       "pruning": 1, "fta": "off"}, "break_even": 1.3}
    monkeypatch.setattr(generate, "choose_tree", lambda *args, **kwargs: report)
    gen = SpeculativeGenerator.load(tiny_target_dir, "gumiho", "random", total_tokens="auto")
    assert not isinstance(gen.drafter, GatedDrafter) and gen.drafter.tree.total_tokens == 3
    gated = SpeculativeGenerator.load(tiny_target_dir, "gumiho", "random",
                                      total_tokens="auto", draft_gate=1.3)
    assert isinstance(gated.drafter, GatedDrafter) and gated.drafter.break_even == 1.3
    assert gated.drafter.tree.total_tokens == 3
    floored = SpeculativeGenerator.load(tiny_target_dir, "gumiho", "random",
                                        total_tokens="auto", min_confidence=0.1)
    assert floored.drafter.tree.min_confidence == 0.1 and floored.drafter.floor is not None


@pytest.mark.host
def test_verify_widths_are_timed_in_turns_fastest_round_each(monkeypatch):
    """A burst of load lands on one round of every width, not on one width's every round:
    the calls alternate, and each keeps its fastest round."""
    from gumiho import profiling

    order, clock = [], iter(range(1000))
    monkeypatch.setattr(profiling.time, "perf_counter", lambda: next(clock) * 1.0)
    slow = {"a": [5, 1, 9], "b": [2, 7, 3]}  # per timed round: the ticks each call takes

    def call(key):
        def fn():
            order.append(key)
            if len(order) > 4:  # past the two warm-up calls each: burn the round's ticks
                for _ in range(slow[key].pop(0) - 1):
                    next(clock)
        return fn

    best = profiling.fastest_interleaved({"a": call("a"), "b": call("b")},
                                         torch.device("cpu"), repeats=3)
    assert order == ["a", "a", "b", "b"] + ["a", "b"] * 3
    assert best == {"a": 1.0, "b": 2.0}
