import pytest
import torch

from gumiho.tree import DraftTree, ancestor_mask, walk_ancestors

from drafters_for_tests import random_tree

pytestmark = pytest.mark.host  # pure tree arithmetic on hand-made tensors


def ancestors(parents, i):
    out = {i}
    while parents[i] >= 0:
        i = parents[i]
        out.add(i)
    return out


@pytest.mark.parametrize("seed", range(5))
def test_random_tree_fields_match_definitions(seed):
    rng = torch.Generator().manual_seed(seed)
    tree = random_tree(torch.tensor([7]), 30, 50, rng)
    parents = tree.parents.tolist()
    for i in range(tree.size):
        anc = ancestors(parents, i)
        assert set(tree.mask[i].nonzero().flatten().tolist()) == anc
        assert tree.depths[i] == len(anc) - 1
    leaves = {i for i in range(tree.size) if i not in parents}
    assert {int(p[p >= 0][-1]) for p in tree.paths} == leaves
    for path in tree.paths:
        nodes = path[path >= 0].tolist()
        assert nodes[0] == 0
        # each step along a path is an edge
        assert all(parents[b] == a for a, b in zip(nodes, nodes[1:], strict=False))
        assert (path[len(nodes):] == -1).all()


@pytest.mark.parametrize("size", [1, 2, 3, 9, 64, 128, 200])
def test_depth_bound_mask_matches_the_walk(size):
    """The sync-free mask (repeated squaring up to 128 nodes, then a fixed-length walk on
    a CPU) equals the checked walk for every depth bound at least the tree's depth."""
    rng = torch.Generator().manual_seed(size)
    # deep and shallow shapes: parents drawn from the whole prefix or the last few nodes
    for span in (size, 3):
        parents = torch.tensor([-1] + [int(torch.randint(max(0, i - span), i, (),
                                                         generator=rng)) for i in range(1, size)])
        checked = walk_ancestors(parents, None)
        depth = int(checked.sum(1).max()) - 1
        for bound in sorted({depth, depth + 1, depth + 5}):
            assert torch.equal(ancestor_mask(parents, bound), checked), (span, bound)
        if depth > 1:  # a bound below the depth misses the farthest ancestors
            assert not torch.equal(ancestor_mask(parents, 1), checked)


def test_chain_and_single():
    tree = DraftTree.chain(torch.tensor([4, 5, 6]))
    assert tree.paths.tolist() == [[0, 1, 2]]
    assert tree.mask.tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    single = DraftTree.chain(torch.tensor([9]))
    assert single.size == 1 and single.paths.tolist() == [[0]]


def test_rejects_non_topological_parents():
    with pytest.raises(ValueError, match="topological"):
        DraftTree.from_parents(torch.tensor([1, 2, 3]), torch.tensor([-1, 2, 0]))
