"""qax.utils tree helpers: implicit arrays as leaves, one-layer flattening, EmptyNode."""

import pickle

import jax
import jax.numpy as jnp

import qax
from qax import utils
from tests.helpers import LoraMatrix, Zeros, assert_close, make_lora


def _nested():
    return LoraMatrix(jnp.ones((3, 4)), Zeros(shape=(3, 2)), Zeros(shape=(4, 2)))


def test_with_implicit_helpers_keep_implicit_arrays_whole():
    tree = {"w": make_lora(jax.random.PRNGKey(0)), "b": jnp.ones(3), "n": None}
    leaves, treedef = utils.tree_flatten_with_implicit(tree)
    assert [type(x).__name__ for x in leaves] == ["ArrayImpl", "LoraMatrix"]
    assert utils.tree_unflatten(treedef, leaves)["w"] is tree["w"]
    assert utils.tree_leaves_with_implicit(tree) == leaves
    assert utils.tree_structure_with_implicit(tree) == treedef
    shapes = utils.tree_map_with_implicit(lambda x: x.shape, tree)
    assert shapes == {"w": (6, 5), "b": (3,), "n": None}
    paths = utils.tree_map_with_path_with_implicit(
        lambda p, x: jax.tree_util.keystr(p), tree
    )
    assert paths["w"] == "['w']"
    keyed, _ = utils.tree_flatten_with_path_with_implicit(tree)
    assert [jax.tree_util.keystr(p) for p, _ in keyed] == ["['b']", "['w']"]
    assert isinstance(keyed[1][1], LoraMatrix)
    # an extra is_leaf is honoured as well
    assert utils.tree_leaves_with_implicit(
        tree, is_leaf=lambda x: isinstance(x, dict)
    ) == [tree]


def test_implicit_depth():
    assert utils.implicit_depth(jnp.ones(2)) == 0
    assert utils.implicit_depth(Zeros(shape=(2,))) == 1
    assert utils.implicit_depth({"a": [_nested()]}) == 2


def test_flatten_one_implicit_layer_opens_only_the_outer_arrays():
    tree = [_nested(), jnp.zeros(2)]
    leaves, treedef = utils.flatten_one_implicit_layer(tree)
    kinds = [type(x).__name__ for x in leaves]
    assert kinds.count("Zeros") == 2 and "LoraMatrix" not in kinds
    rebuilt = jax.tree_util.tree_unflatten(treedef, leaves)
    assert isinstance(rebuilt[0], LoraMatrix) and isinstance(rebuilt[0].a, Zeros)


def test_empty_node_has_no_leaves():
    node = qax.EmptyNode
    assert jax.tree_util.tree_leaves({"f": node}) == []
    assert jax.tree_util.tree_leaves({"x": node, "y": 1.0}) == [1.0]
    assert jax.tree_util.tree_map(lambda x: x + 1, {"x": node})["x"] is node
    assert repr(node) == "EmptyNode"


def test_empty_node_is_a_singleton_as_in_the_original():
    assert qax.EmptyNode is qax.utils.EmptyNode
    assert not isinstance(qax.EmptyNode, type)
    assert type(qax.EmptyNode)() is qax.EmptyNode
    assert pickle.loads(pickle.dumps(qax.EmptyNode)) is qax.EmptyNode
    leaves, treedef = jax.tree_util.tree_flatten([qax.EmptyNode, 1])
    assert jax.tree_util.tree_unflatten(treedef, leaves)[0] is qax.EmptyNode


def test_get_common_prefix_transforms_materializes_only_what_differs():
    t1 = [Zeros(shape=(3,)), Zeros(shape=(2,))]
    t2 = [jnp.ones(3), Zeros(shape=(2,))]
    f1, f2 = utils.get_common_prefix_transforms([t1, t2])
    out1, out2 = f1(t1), f2(t2)
    assert not isinstance(out1[0], qax.ImplicitArray) and isinstance(out1[1], Zeros)
    assert_close(out1[0], jnp.zeros(3))
    assert_close(out2[0], jnp.ones(3))
    assert isinstance(out2[1], Zeros)


def test_materialize_nested_of_a_tree_materializes_every_implicit_leaf():
    """Issue 42, item 9: a dict came back unchanged (implicit compared with implicit)."""
    lora = make_lora(jax.random.PRNGKey(0))
    nested = LoraMatrix(Zeros(shape=(3, 4)), jnp.ones((3, 2)), jnp.ones((4, 2)))
    tree = {"w": lora, "layers": [nested, jnp.ones(3)], "n": None}
    full = qax.materialize_nested(tree, full=True)
    leaves = utils.tree_leaves_with_implicit(full)
    assert not any(isinstance(x, qax.ImplicitArray) for x in leaves), full
    assert_close(full["w"], lora.w + lora.a @ lora.b.T)
    assert_close(full["layers"][0], jnp.full((3, 4), 2.0))
    assert_close(full["layers"][1], jnp.ones(3))
    assert full["n"] is None
    # One layer of each implicit leaf (here the only one).
    one = qax.materialize_nested({"w": lora})
    assert isinstance(one["w"], jax.Array)
    assert_close(one["w"], full["w"])
