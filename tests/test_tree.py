import pytest

from medusa.decoding.tree import chain, compile_tree, load_tree
from medusa.errors import MedusaError

PATHS = [(0, 0), (1,), (0,), (0, 0, 0), (0, 1), (1, 0)]  # deliberately unsorted


def test_buffers_match_hand_computed_values():
    t = compile_tree(PATHS)
    # layout: root, (0,), (1,), (0,0), (0,1), (1,0), (0,0,0)
    assert t.paths == ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    assert t.num_nodes == 7 and t.max_depth == 3
    assert t.parent.tolist() == [-1, 0, 0, 1, 1, 2, 3]
    assert t.depth.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert t.head.tolist() == [-1, 0, 0, 1, 1, 1, 2]
    assert t.rank.tolist() == [-1, 0, 1, 0, 1, 0, 0]
    assert t.topk == (2, 2, 1)
    expected_ancestor = [
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0],
        [1, 0, 1, 0, 0, 1, 0],
        [1, 1, 0, 1, 0, 0, 1],
    ]
    assert t.ancestor.int().tolist() == expected_ancestor
    # leaves: (0,1), (1,0), (0,0,0), each as its root-to-leaf node indices, -1 padded
    assert t.leaves.tolist() == [[0, 1, 4, -1], [0, 2, 5, -1], [0, 1, 3, 6]]
    assert t.leaf_depth.tolist() == [2, 2, 3]
    # candidate index into a flattened [depth, width=2] top-k table
    assert t.candidate_index().tolist() == [0, 1, 2, 3, 2, 4]


def test_empty_tree_is_the_root_alone():
    t = compile_tree([])
    assert t.num_nodes == 1 and t.max_depth == 0 and t.leaves.tolist() == [[0]]


def test_chain():
    t = compile_tree(chain(3))
    assert t.parent.tolist() == [-1, 0, 1, 2]
    assert t.leaves.tolist() == [[0, 1, 2, 3]]


@pytest.mark.parametrize("paths, message", [
    ([(0, 1)], "no parent"),
    ([(0,), (0,)], "twice"),
    ([(0,), (-1,)], "negative"),
    ([()], "non-empty"),
    ([("a",)], "integers"),
])
def test_bad_trees_are_clear_errors(paths, message):
    with pytest.raises(MedusaError, match=message):
        compile_tree(paths)


def test_shipped_trees_compile():
    for name in ("cpu", "gpu"):
        t = compile_tree(load_tree(name))
        assert t.num_nodes > 1
    with pytest.raises(MedusaError, match="not found"):
        load_tree("no-such-tree")
