"""--min-confidence: verify only draft nodes the drafter finds likely enough, draft no deeper
once none is, and take a plain step when even the first draft token falls short; the
output stays exactly the target's."""

import math

import pytest

from gumiho.config import TreeConfig
from gumiho.demo import shipped_drafter
from gumiho.drafters import PlainDrafter, load_drafter
from gumiho.engine import GenerateConfig, run
from gumiho.errors import GumihoError
from gumiho.evaluation.speed import method_label
from gumiho.serial_drafter import SerialDrafter

from conftest import tiny_llama
from test_sampling import assert_samples_match_target


def eager_drafter(method, target, draft, tree):
    """Floors shape each cycle's tree, so they act on the eager engine only (a captured
    engine keeps one tree shape and ignores them): on a GPU, where graphs are the default,
    these tests ask for eager by name."""
    return load_drafter(method, target, draft, tree=tree, engine="eager")


def cycle_trees(target, drafter, prompt, max_new_tokens=24, **config):
    trees = []
    out = run(target, drafter, prompt, GenerateConfig(max_new_tokens=max_new_tokens, **config),
              on_cycle=lambda tree, emitted: trees.append(tree))
    return out, trees


SHAPE = {"total_tokens": 8, "top_k": 2}
PROMPT = [3, 9, 1, 12]


def first_tree_scores(target) -> tuple[float, float]:
    """The best level-1 and level-2 path scores (log) of the first cycle without floors."""
    drafter = load_drafter("gumiho", target, "random",
                           tree=TreeConfig.for_method("gumiho", **SHAPE))
    _, trees = cycle_trees(target, drafter, PROMPT, 2)
    scores, depths = trees[0].priority[1:], trees[0].depths[1:]
    return float(scores[depths == 1].max()), float(scores[depths == 2].max())


def counted_first_tree(target, **floors):
    """The first cycle's tree with `floors` (TreeConfig fields), and the drafter steps it
    ran: "serial" per serial level past the first, "heads" per MLP heads call."""
    drafter = load_drafter("gumiho", target, "random",
                           tree=TreeConfig.for_method("gumiho", **SHAPE, **floors))
    assert isinstance(drafter, SerialDrafter)
    calls = []
    real_level, real_heads = drafter._serial_level, drafter.model.parallel_heads
    drafter._serial_level = lambda *a: calls.append("serial") or real_level(*a)
    # the model's, not _heads_step: begin() rebinds that
    drafter.model.parallel_heads = lambda *a: calls.append("heads") or real_heads(*a)
    _, trees = cycle_trees(target, drafter, PROMPT, 2)
    return trees[0], calls


@pytest.mark.parametrize("method", ["gumiho", "eagle2"])
def test_every_verified_draft_reaches_the_floor_and_the_output_is_plain(smollm2, method):
    ids = smollm2.chat_ids("Write a short poem about the sea, then explain its rhyme scheme.")
    plain = run(smollm2, PlainDrafter(), ids, GenerateConfig(max_new_tokens=48))
    full_tree = TreeConfig.for_method(method, total_tokens=16)
    _, full = cycle_trees(smollm2, eager_drafter(method, smollm2, str(shipped_drafter(method)),
                                                 tree=full_tree), ids, 48)
    floor = 0.1
    tree = TreeConfig.for_method(method, total_tokens=16, min_confidence=floor)
    out, trees = cycle_trees(smollm2, eager_drafter(method, smollm2,
                                                    str(shipped_drafter(method)), tree=tree),
                             ids, 48)
    assert out.token_ids == plain.token_ids
    sizes = [t.size for t in trees]
    assert 1 in sizes, "no cycle fell back to a plain step: the floor was never met"
    assert max(sizes) > 2, "no cycle verified more than one draft"
    assert sum(sizes) < sum(t.size for t in full), "the floor pruned nothing"
    for t in trees:
        if t.size > 1:
            assert float(t.priority[1:].min()) >= math.log(floor) - 1e-4


@pytest.mark.host
def test_a_floor_near_one_makes_every_cycle_a_plain_step():
    target = tiny_llama()
    prompt = [3, 9, 1, 12, 5]
    plain = run(target, PlainDrafter(), prompt, GenerateConfig(max_new_tokens=12))
    drafter = load_drafter("gumiho", target, "random",
                           tree=TreeConfig.for_method("gumiho", total_tokens=8,
                                                      min_confidence=0.999))
    out, trees = cycle_trees(target, drafter, prompt, 12)
    assert out.token_ids == plain.token_ids
    assert {t.size for t in trees} == {1} and out.tau == 1.0


@pytest.mark.host
def test_the_floor_stops_the_serial_levels_and_the_heads():
    """Level 2 is drafted only below a level-1 node that reaches the floor, the MLP heads
    only below a level-2 node that does; with no level-1 node there, the root alone."""
    target = tiny_llama(vocab_size=16, seed=1)
    best1, best2 = first_tree_scores(target)
    tree, calls = counted_first_tree(target)  # no floor: every step runs (the counter counts)
    assert calls == ["serial", "heads"] and int(tree.depths.max()) > 2
    for floor, steps, deepest in (((best1 + best2) / 2, ["serial"], 1),
                                  (best1 + 0.01, [], 0)):
        tree, calls = counted_first_tree(target, min_confidence=math.exp(floor))
        assert calls == steps and int(tree.depths.max()) == deepest


@pytest.mark.parametrize("floor", [0.05, 0.12])
def test_sampling_with_a_floor_matches_target(floor):
    vocab = 16
    target = tiny_llama(vocab_size=vocab, seed=1, logit_scale=25.0)
    drafter = eager_drafter("gumiho", target, "random",
                            tree=TreeConfig.for_method("gumiho", total_tokens=8,
                                                       min_confidence=floor))
    _, trees = cycle_trees(target, drafter, [3, 9, 1, 12, 5], 40, temperature=1.0)
    assert min(t.size for t in trees) < 8, "the floor pruned nothing: the test would check nothing"
    assert_samples_match_target(target, drafter, [3, 9, 1, 12, 5], vocab, runs=1000)


@pytest.mark.host
def test_captured_engines_ignore_the_floor(tiny_target_dir):
    from gumiho.target import load_target

    target = load_target(tiny_target_dir)
    tree = TreeConfig.for_method("gumiho", total_tokens=8, min_confidence=0.5)
    assert load_drafter("gumiho", target, "random", tree=tree, engine="compile").floor is None
    assert load_drafter("gumiho", target, "random", tree=tree).floor == pytest.approx(
        math.log(0.5))


@pytest.mark.host
@pytest.mark.parametrize("bad", [-0.1, 1, 1.5, True, "0.2"])
def test_a_bad_floor_is_one_line(bad):
    """Out of range: GumihoError naming the flag; of another type (the API): TypeError."""
    wrong_type = isinstance(bad, bool | str)
    with pytest.raises(TypeError if wrong_type else GumihoError,
                       match="min_confidence must be a number" if wrong_type else
                       "--min-confidence must be a probability"):
        TreeConfig.for_method("gumiho", min_confidence=bad)


@pytest.mark.host
def test_the_label_names_the_floor():
    settings = {"method": "gumiho", "tree": {"min_confidence": 0.1}, "engine": "eager"}
    assert method_label(settings) == "gumiho (confidence 0.1)"
    assert method_label({**settings, "engine": "graphs"}) == "gumiho"


@pytest.mark.host
def test_the_extend_floor_stops_deeper_levels_but_keeps_the_first_draft():
    """--extend-confidence above the best level-1 score: no serial level 2 (nor heads), but
    the level-1 drafts that reach --min-confidence are verified; above the best level-2
    score only: level 2 is drafted and verified, the MLP heads do not run."""
    target = tiny_llama(vocab_size=16, seed=1)
    best1, best2 = first_tree_scores(target)
    assert best2 + 0.02 < best1
    for extend, steps, deepest in ((best1 + 0.01, [], 1), (best2 + 0.01, ["serial"], 2)):
        tree, calls = counted_first_tree(target, min_confidence=1e-6,
                                         extend_confidence=math.exp(extend))
        assert calls == steps and int(tree.depths.max()) == deepest
        assert int((tree.depths == 1).sum()) == 2  # both level-1 drafts verified


def test_an_extend_floor_keeps_the_output_plain(smollm2):
    ids = smollm2.chat_ids("Write a short poem about the sea, then explain its rhyme scheme.")
    plain = run(smollm2, PlainDrafter(), ids, GenerateConfig(max_new_tokens=48))
    tree = TreeConfig.for_method("gumiho", total_tokens=8, min_confidence=0.05,
                                 extend_confidence=0.4)
    out, trees = cycle_trees(smollm2, eager_drafter("gumiho", smollm2,
                                                    str(shipped_drafter("gumiho")), tree=tree),
                             ids, 48)
    assert out.token_ids == plain.token_ids
    depths = [int(t.depths.max()) for t in trees]
    assert 1 in depths and max(depths) > 1, depths  # some cycles stop at level 1, not all
    for t in trees:
        if int(t.depths.max()) > 1:  # a deeper level hangs below a node that reached 0.4
            parents = t.parents[t.depths == 2]
            assert float(t.priority[parents].max()) >= math.log(0.4) - 1e-4


@pytest.mark.host
@pytest.mark.parametrize("bad", [-0.1, 1])
def test_a_bad_extend_floor_is_one_line(bad):
    with pytest.raises(GumihoError, match="--extend-confidence must be a probability"):
        TreeConfig.for_method("gumiho", extend_confidence=bad)


@pytest.mark.host
def test_the_label_names_the_extend_floor():
    settings = {"method": "gumiho", "engine": "eager",
                "tree": {"min_confidence": 0.1, "extend_confidence": 0.4}}
    assert method_label(settings) == "gumiho (confidence 0.1, extend 0.4)"
    settings["tree"]["extend_confidence"] = 0.05  # below the floor: the floor rules
    assert method_label(settings) == "gumiho (confidence 0.1)"
