"""Training with frozen fields: optax helpers, apply_updates and vmap_all_but_one."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import qax
from qax.symbols import SymbolicConstant, symbolic_zero_like
from qax.utils import apply_updates, freeze_keys, freeze_subtrees, vmap_all_but_one
from tests.helpers import OPTAX_RANK, TaggedLora, lora_problem, sizes, state_size


def loss(params, x, y):
    hidden = jnp.tanh(x @ params["l1"])
    return jnp.mean((hidden @ params["l2"] + params["bias"] - y) ** 2)


def train(optimizer, params, x, y, steps=20, apply=optax.apply_updates):
    grad_fn = jax.value_and_grad(qax.use_implicit_args(loss))

    @jax.jit
    def step(params, opt_state):
        value, grads = grad_fn(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return value, apply(params, updates), opt_state

    opt_state = optimizer.init(params)
    for _ in range(steps):
        _, params, opt_state = step(params, opt_state)
    return params, opt_state


OPTIMIZERS = {
    "adam": lambda: optax.adam(0.05),
    "adamw": lambda: optax.adamw(0.05, weight_decay=0.1),
    "clip+adam": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.05)),
}


@pytest.mark.parametrize("scalar_zeros", [False, True], ids=["zeros", "scalar"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_freeze_keys_trains_lora_factors_only(name, scalar_zeros):
    params, x, y = lora_problem()
    optimizer = freeze_keys(OPTIMIZERS[name](), TaggedLora, ["w"], scalar_zeros)
    trained, opt_state = train(optimizer, params, x, y)

    implicit_loss = qax.use_implicit_args(loss)
    assert implicit_loss(params, x, y) / implicit_loss(trained, x, y) >= 5
    for k in ("l1", "l2"):
        assert isinstance(trained[k], TaggedLora) and trained[k].tag == "lora"
        np.testing.assert_array_equal(trained[k].w, params[k].w)  # bitwise
        assert not np.allclose(trained[k].a, params[k].a)
        assert not np.allclose(trained[k].b, params[k].b)
        assert trained[k].shape == params[k].shape
    # Moments for a, b and bias only: about twice the trainable size, not all params.
    trainable = sizes(params, "ab") + params["bias"].size
    assert 2 * trainable <= state_size(opt_state) <= 2 * trainable + 8
    assert state_size(opt_state) < 2 * (trainable + sizes(params, "w"))


def test_frozen_weights_stay_frozen_under_weight_decay_and_momentum():
    """Regression: decay or momentum must not move "frozen" weights.

    The control shows the failure mode that a freeze by zeroed gradients has: the
    optimizer still decays `w` (and keeps moments for it).
    """
    params, x, y = lora_problem(seed=1)
    decaying = optax.chain(optax.sgd(0.1, momentum=0.9), optax.add_decayed_weights(0.5))

    frozen, _ = train(freeze_keys(decaying, TaggedLora, "w"), params, x, y, steps=10)

    def zero_w(grads):
        return {
            k: TaggedLora(jnp.zeros_like(g.w), g.a, g.b) if k != "bias" else g
            for k, g in grads.items()
        }

    naive = optax.chain(optax.stateless(lambda g, p: zero_w(g)), decaying)
    moved, _ = train(naive, params, x, y, steps=10)
    for k in ("l1", "l2"):
        np.testing.assert_array_equal(frozen[k].w, params[k].w)
        assert not np.allclose(moved[k].w, params[k].w)


def test_frozen_updates_are_zero_and_the_tutorials_argument_order_works():
    params, x, y = lora_problem()
    optimizer = freeze_keys(optax.adam(0.05), TaggedLora, ["w"])
    grads = jax.grad(qax.use_implicit_args(loss))(params, x, y)
    updates, _ = optimizer.update(grads, optimizer.init(params), params)
    assert not np.any(updates["l1"].w) and np.any(updates["l1"].b)
    swapped = optax.apply_updates(updates, params)  # as in the original how-to
    np.testing.assert_array_equal(swapped["l1"].w, params["l1"].w)


def test_scalar_zeros_give_rank_zero_updates():
    params, x, y = lora_problem()
    optimizer = freeze_keys(optax.sgd(0.1), TaggedLora, ["w"], use_scalar_zeros=True)
    grads = jax.grad(qax.use_implicit_args(loss))(params, x, y)
    updates, _ = optimizer.update(grads, optimizer.init(params), params)
    assert updates["l1"].w.shape == () and updates["l1"].a.shape == (8, OPTAX_RANK)
    for apply in (optax.apply_updates, apply_updates):
        new = apply(params, updates)
        np.testing.assert_array_equal(new["l1"].w, params["l1"].w)
        assert new["l1"].shape == params["l1"].shape


def test_set_to_zero_scalar_has_no_state():
    tx = qax.utils.set_to_zero_scalar()
    updates, state = tx.update(
        {"w": jnp.ones((3, 3)), "n": jnp.ones(2, jnp.int8)}, None
    )
    assert state is None and updates["w"].shape == () and updates["n"].dtype == jnp.int8
    assert tx.init({"w": jnp.ones(3)}) == optax.EmptyState()


# ----------------------------------------------------------------------------------------
# freeze_subtrees and bad input

PARAMS = {"enc": {"w": jnp.ones((3, 3)), "b": jnp.ones(3)}, "head": jnp.ones((3, 2))}
LABELS = {
    "flat": {"enc": "freeze", "head": "train"},
    "nested": {"enc": {"w": "freeze", "b": "train"}, "head": "train"},
    "all": "freeze",
    "none": "train",
}


@pytest.mark.parametrize("case", sorted(LABELS))
def test_freeze_subtrees(case):
    labels = LABELS[case]
    optimizer = freeze_subtrees(optax.adam(0.1), lambda params: labels)
    state = optimizer.init(PARAMS)
    grads = jax.tree_util.tree_map(jnp.ones_like, PARAMS)
    updates, _ = optimizer.update(grads, state, PARAMS)
    new = optax.apply_updates(PARAMS, updates)

    full = (
        jax.tree_util.tree_map(lambda _: labels, PARAMS)
        if isinstance(labels, str)
        else labels
    )
    flags = jax.tree_util.tree_leaves(
        jax.tree_util.tree_map(
            lambda label, p: jax.tree_util.tree_map(lambda _: label == "freeze", p),
            full,
            PARAMS,
        )
    )
    for frozen, old, now in zip(
        flags,
        jax.tree_util.tree_leaves(PARAMS),
        jax.tree_util.tree_leaves(new),
        strict=True,
    ):
        assert np.array_equal(old, now) == frozen
    trained = sum(
        p.size
        for f, p in zip(flags, jax.tree_util.tree_leaves(PARAMS), strict=True)
        if not f
    )
    assert 2 * trained <= state_size(state) <= 2 * trained + 1


def test_freeze_subtrees_rejects_unknown_labels():
    optimizer = freeze_subtrees(optax.adam(0.1), {"enc": "frozen", "head": "train"})
    with pytest.raises(ValueError, match="'frozen'"):
        optimizer.init(PARAMS)


def test_freeze_keys_rejects_unknown_and_static_fields():
    with pytest.raises(ValueError, match="no child field 'W'.*'w', 'a', 'b'"):
        freeze_keys(optax.adam(0.1), TaggedLora, ["W"])
    with pytest.raises(ValueError, match="'tag'"):
        freeze_keys(optax.adam(0.1), TaggedLora, ["tag"])
    with pytest.raises(TypeError, match="must be a class"):
        freeze_keys(optax.adam(0.1), "TaggedLora", ["w"])


def test_freeze_keys_warns_when_nothing_matches():
    optimizer = freeze_keys(optax.adam(0.1), TaggedLora, ["w"])
    with pytest.warns(UserWarning, match="found no TaggedLora"):
        optimizer.init(PARAMS)


def test_float0_gradients_of_integer_leaves():
    params, x, y = lora_problem()
    params = {**params, "steps": jnp.array([3, 4], jnp.int32)}

    def int_loss(params, x, y):
        return loss(params, x, y) + 0.0 * params["steps"].sum()

    grads = jax.grad(qax.use_implicit_args(int_loss), allow_int=True)(params, x, y)
    assert grads["steps"].dtype == jax.dtypes.float0
    optimizer = freeze_keys(optax.adam(0.05), TaggedLora, ["w"])
    state = optimizer.init(params)
    updates, _ = optimizer.update(grads, state, params)
    new = optax.apply_updates(params, updates)
    np.testing.assert_array_equal(new["steps"], params["steps"])
    assert new["steps"].dtype == jnp.int32
    with pytest.raises(ValueError, match="pass `params`"):
        optimizer.update(grads, state)


# ----------------------------------------------------------------------------------------
# apply_updates


def test_apply_updates_with_symbolic_constants():
    w, b = jnp.arange(6.0).reshape(2, 3), jnp.ones(3, jnp.bfloat16)
    params = {"w": w, "b": b, "c": None}
    updates = {
        "w": symbolic_zero_like(w),
        "b": SymbolicConstant(0.5, shape=(3,)),
        "c": None,
    }
    new = apply_updates(params, updates)
    assert new["w"] is w  # nothing materialized, bitwise the same
    assert new["b"].dtype == jnp.bfloat16 and new["c"] is None
    np.testing.assert_array_equal(new["b"], jnp.full(3, 1.5, jnp.bfloat16))

    jaxpr = jax.make_jaxpr(apply_updates)(params, updates)
    assert [e.primitive.name for e in jaxpr.eqns].count("add") == 1  # only `b`


def test_apply_updates_matches_optax_and_skips_float0():
    params, x, y = lora_problem()
    grads = jax.grad(qax.use_implicit_args(loss))(params, x, y)
    np.testing.assert_array_equal(
        apply_updates(params, grads)["l1"].a, optax.apply_updates(params, grads)["l1"].a
    )
    zero = np.zeros((2,), jax.dtypes.float0)
    steps = jnp.array([1, 2])
    assert apply_updates({"s": steps}, {"s": zero})["s"] is steps


def test_apply_updates_leaves_constant_params_alone():
    c = SymbolicConstant(2.0, shape=(3,), dtype=jnp.float32)
    grads = jax.grad(qax.use_implicit_args(lambda c, v: jnp.sum(c * v)))(c, jnp.ones(3))
    new = apply_updates({"c": c}, {"c": grads})
    assert isinstance(new["c"], SymbolicConstant) and new["c"].value == 2.0


def test_apply_updates_rejects_mismatched_structures():
    with pytest.raises(ValueError, match="structure of `params`"):
        apply_updates({"w": jnp.ones(3)}, {"v": jnp.ones(3)})


# ----------------------------------------------------------------------------------------
# vmap_all_but_one and the public surface


@pytest.mark.parametrize("axis", [0, 1, 2, -1])
def test_vmap_all_but_one(axis):
    x = jnp.arange(24.0).reshape(2, 3, 4)
    np.testing.assert_array_equal(vmap_all_but_one(jnp.sum, axis)(x), x.sum(axis))
    np.testing.assert_array_equal(
        vmap_all_but_one(jnp.cumsum, axis, out_ndim=1)(x), jnp.cumsum(x, axis)
    )
    np.testing.assert_allclose(
        vmap_all_but_one(jnp.dot, axis)(x, x + 1), jnp.sum(x * (x + 1), axis)
    )
    with pytest.raises(ValueError, match="out of range"):
        vmap_all_but_one(jnp.sum, 3)(x)


def test_public_surface():
    assert qax.freeze_keys is qax.utils.freeze_keys
    public = {n for n in dir(qax.utils) if not n.startswith("_")}
    assert public == set(qax.utils.__all__)
    for name in [
        "apply_updates",
        "freeze_keys",
        "freeze_subtrees",
        "set_to_zero_scalar",
    ]:
        assert getattr(qax.utils, name).__doc__, name
    assert qax.utils.vmap_all_but_one.__doc__
    assert set(qax.symbols.__all__) <= set(dir(qax.symbols))


def test_apply_updates_never_moves_a_field_its_value_declares_frozen():
    # LoraWeight(freeze_w=True) declares `w` frozen: weight decay (adamw, no
    # freeze_keys) would move it; qax's apply_updates leaves it bitwise as it is.
    key_w, key_a, key_b = jax.random.split(jax.random.PRNGKey(3), 3)
    w = jax.random.normal(key_w, (6, 4))
    a = 0.1 * jax.random.normal(key_a, (6, 2))
    b = 0.1 * jax.random.normal(key_b, (2, 4))
    params = {
        "frozen": qax.lora.LoraWeight(w, a, b),
        "free": qax.lora.LoraWeight(w, a, b, freeze_w=False),
    }
    x = jnp.ones((3, 6))
    tx = optax.adamw(1e-2, weight_decay=0.5)
    state = tx.init(params)
    step_loss = qax.use_implicit_args(
        lambda p: jnp.sum((x @ p["frozen"]) ** 2) + jnp.sum((x @ p["free"]) ** 2)
    )
    new = params
    for _ in range(3):
        grads = jax.grad(step_loss)(new)
        updates, state = tx.update(grads, state, new)
        moved = optax.apply_updates(new, updates)
        new = apply_updates(new, updates)
    assert new["frozen"].w is w  # untouched: not even copied
    assert not np.allclose(moved["frozen"].w, w)  # what optax itself would have done
    assert not np.allclose(new["free"].w, w)  # not frozen: weight decay moves it
    assert not np.allclose(new["frozen"].a, a)  # the factors train
    np.testing.assert_allclose(new["frozen"].b, moved["frozen"].b)
    assert qax.lora.LoraWeight(w, a, b).frozen_fields() == ("w",)
    assert params["free"].frozen_fields() == ()


# ----------------------------------------------------------------------------------------
# The whole optimizer step inside `qax.use_implicit_args` (issue 42, item 4)


def _lora_step_inside(tx, update_fn):
    params = {
        "w": qax.lora.loraify(
            {"w": jax.random.normal(jax.random.key(0), (8, 4))},
            2,
            key=jax.random.key(1),
        )["w"]
    }
    opt_state = tx.init(params)
    x = jnp.ones((3, 8))

    def step(params, opt_state, x):
        grads = jax.grad(lambda p: jnp.sum((x @ p["w"]) ** 2))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return update_fn(params, updates), opt_state

    return qax.use_implicit_args(step), (params, opt_state, x)


@pytest.mark.parametrize(
    "update_fn", [optax.apply_updates, qax.utils.apply_updates], ids=["optax", "qax"]
)
def test_freeze_keys_inside_the_wrapper_names_the_step_outside(update_fn):
    tx = qax.freeze_keys(optax.adam(1e-2), qax.lora.LoraWeight, ["w"])
    step, args = _lora_step_inside(tx, update_fn)
    with pytest.raises(
        RuntimeError,
        match=r"(?s)freeze_keys.*inside `qax.use_implicit_args`.*LoraWeight at \['w'\]"
        r".*jax.grad\(loss_fn\).*optax.apply_updates",
    ):
        step(*args)


def test_apply_updates_inside_the_wrapper_names_the_step_outside():
    step, args = _lora_step_inside(optax.sgd(0.1), qax.utils.apply_updates)
    with pytest.raises(
        RuntimeError, match=r"(?s)apply_updates.*inside `qax.use_implicit_args`"
    ):
        step(*args)
