import pytest
import torch

from gumiho.tree import DraftTree

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


def test_chain_and_single():
    tree = DraftTree.chain(torch.tensor([4, 5, 6]))
    assert tree.paths.tolist() == [[0, 1, 2]]
    assert tree.mask.tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    single = DraftTree.chain(torch.tensor([9]))
    assert single.size == 1 and single.paths.tolist() == [[0]]


def test_rejects_non_topological_parents():
    with pytest.raises(ValueError, match="topological"):
        DraftTree.from_parents(torch.tensor([1, 2, 3]), torch.tensor([-1, 2, 0]))
