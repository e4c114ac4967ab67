"""Optax helpers for parameters that hold implicit arrays.

`freeze_keys` trains every field of every implicit array except the named ones (LoRA:
train ``a`` and ``b``, keep ``w``); `freeze_subtrees` does the same for any labelling.
Both are compositions of `optax.partition` with a zero-update transform, so frozen leaves
get no optimizer state at all (no Adam moments for a frozen base weight), and the wrapped
optimizer, including any weight decay, never sees them.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterable
from typing import Any, Final

import jax
import jax.numpy as jnp
import numpy as np
import optax

from . import _errors
from ._base import NB, is_implicit
from ._entry import use_implicit_args
from ._fields import children_of, fields_of, rebuild
from ._implicit_array import ImplicitArray
from ._interpreter import ImplicitTracer
from ._tree_util import key_value
from .symbols import SymbolicConstant

FREEZE = "freeze"
TRAIN = "train"

STEP_INSIDE_WRAPPER: Final = (
    "{what} was called inside `qax.use_implicit_args`, on parameters holding implicit "
    "arrays (the {cls} at {path}). There each implicit array is one value of its "
    "dense shape: its gradient is dense, and adding an update to it forms the dense "
    "array, so the type and its frozen fields would be lost. Keep only the model (the "
    "loss) inside the wrapper and take the optimizer step outside it:\n\n"
    "    def loss_fn(params, batch):\n"
    "        return loss(qax.use_implicit_args(model)(params, batch))\n\n"
    "    grads = jax.grad(loss_fn)(params, batch)\n"
    "    updates, opt_state = optimizer.update(grads, opt_state, params)\n"
    "    params = optax.apply_updates(params, updates)\n\n"
    "(For LoRA, differentiate with respect to the adapters of `qax.lora.split`, "
    "`qax.lora.combine` inside the loss: the guide's training recipe.)"
)


def _check_outside_wrapper(what: str, *trees: Any) -> None:
    """Refuse parameters (or gradients) that are tracers of `use_implicit_args`."""
    for tree in trees:
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            if isinstance(leaf, ImplicitTracer):
                raise RuntimeError(
                    STEP_INSIDE_WRAPPER.format(
                        what=what,
                        cls=type(leaf.value).__name__,
                        path=jax.tree_util.keystr(path),
                    )
                )


_partition = getattr(optax, "partition", None) or optax.multi_transform
_float0 = jax.dtypes.float0


def set_to_zero_scalar() -> optax.GradientTransformation:
    """An optax transformation that replaces every update by a scalar zero.

    Like `optax.set_to_zero`, but each update becomes a 0-d zero of the update's
    dtype instead of a full-size array, so nothing of the parameters' size is created.
    `optax.apply_updates` and `qax.utils.apply_updates` broadcast it. It has no state.

    Examples:
        >>> tx = qax.utils.set_to_zero_scalar()
        >>> tx.update({"w": jnp.ones((3, 3))}, tx.init(None))[0]
        {'w': Array(0., dtype=float32)}

    Returns:
      An `optax.GradientTransformation`.
    """

    def init_fn(params: Any) -> optax.EmptyState:
        del params
        return optax.EmptyState()

    def update_fn(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        del params
        return jax.tree_util.tree_map(_scalar_zero, updates), state

    return optax.GradientTransformation(init_fn, update_fn)


def _dtype(x: Any) -> Any:
    dtype = getattr(x, "dtype", None)
    return jnp.result_type(x) if dtype is None else dtype


def _scalar_zero(x: Any) -> Any:
    dtype = _dtype(x)
    return np.zeros((), dtype) if dtype == _float0 else jnp.zeros((), dtype)


def freeze_subtrees(
    optimizer: optax.GradientTransformation | optax.MultiSteps,
    label_fn: Callable[[Any], Any] | Any,
    use_scalar_zeros: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """Wrap `optimizer` so that the subtrees labelled ``"freeze"`` never change.

    `label_fn(params)` returns a tree of labels with the structure of `params` (or a
    prefix of it): ``"freeze"`` or ``"train"``. Trained leaves are handed to `optimizer`;
    frozen leaves get zero updates and no optimizer state, and `optimizer` (its weight
    decay, its gradient clipping, ...) never sees them. Gradients of dtype ``float0``
    (from integer leaves) are replaced by zeros of the parameter's dtype. Any pytree
    works as parameters, including callable ones such as an `eqx.Module`.

    Gradient accumulation: pass ``optax.MultiSteps(opt, k)`` *as* `optimizer` (it is
    accepted as is), so that only the trained leaves are accumulated. Wrapping the
    result in `optax.MultiSteps` instead accumulates a gradient for every parameter,
    frozen ones included (a full-size buffer for a frozen LoRA base weight).

    Examples:
        >>> tx = qax.utils.freeze_subtrees(
        ...     optax.adam(1e-3), lambda p: {"w": "freeze", "b": "train"})
        >>> state = tx.init({"w": jnp.ones((4, 4)), "b": jnp.ones(4)})  # no moments for w

    Args:
      optimizer: the optax transformation for the trained leaves.
      label_fn: a function from the parameters to a tree of labels, or that tree (a
        callable pytree whose leaves are all labels counts as a tree).
      use_scalar_zeros: give frozen leaves 0-d zero updates (see `set_to_zero_scalar`)
        instead of full-size zeros.

    Returns:
      An optax transformation whose `update` takes ``(grads, state, params)``.

    Raises:
      ValueError: a label other than ``"freeze"``/``"train"``.
    """
    if isinstance(optimizer, optax.MultiSteps):
        optimizer = optimizer.gradient_transformation()
    frozen = set_to_zero_scalar() if use_scalar_zeros else optax.set_to_zero()
    transforms = {FREEZE: frozen, TRAIN: optimizer}

    def labels_for(tree: Any) -> Any:
        labels = label_fn(tree) if _is_function(label_fn) else label_fn
        bad = {x for x in jax.tree_util.tree_leaves(labels)} - {FREEZE, TRAIN}
        if bad:
            raise ValueError(
                _errors.BAD_FREEZE_LABELS.format(
                    freeze=FREEZE, train=TRAIN, bad=sorted(map(repr, bad))
                )
            )
        return labels

    # optax calls a callable label tree as a function, and an `eqx.Module` of labels
    # is callable: hand it the labels through a function, always.
    def init_fn(params: Any) -> Any:
        labels = labels_for(params)
        return _partition(transforms, lambda _: labels).init(params)

    def update_fn(updates: Any, state: Any, params: Any = None, **extra_args: Any):
        labels = labels_for(updates if params is None else params)
        updates = _replace_float0(updates, params, use_scalar_zeros)
        tx = _partition(transforms, lambda _: labels)
        return tx.update(updates, state, params, **extra_args)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _is_function(label_fn: Any) -> bool:
    """Whether `label_fn` is a labelling function rather than a tree of labels.

    Some pytrees are callable (an `eqx.Module` with `__call__`): a callable that
    flattens to more than itself is a tree of labels.
    """
    if not callable(label_fn):
        return False
    leaves, treedef = jax.tree_util.tree_flatten(label_fn)
    if jax.tree_util.treedef_is_leaf(treedef):
        return True
    return not all(isinstance(leaf, str) for leaf in leaves)


def _replace_float0(updates: Any, params: Any, scalar: bool) -> Any:
    if not any(_dtype(u) == _float0 for u in jax.tree_util.tree_leaves(updates)):
        return updates
    if params is None:
        raise ValueError(_errors.FLOAT0_WITHOUT_PARAMS)

    def fix(u: Any, p: Any) -> Any:
        if _dtype(u) != _float0:
            return u
        return jnp.zeros((), p.dtype) if scalar else jnp.zeros_like(p)

    return jax.tree_util.tree_map(fix, updates, params)


def freeze_keys(
    optimizer: optax.GradientTransformation | optax.MultiSteps,
    arr_type: type,
    keys: Iterable[str] | str,
    use_scalar_zeros: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """Wrap `optimizer` so that the fields `keys` of every `arr_type` stay fixed.

    Everything else is trained by `optimizer`. The frozen fields get no optimizer state
    (a frozen 4096x4096 LoRA base weight costs no Adam moments) and `optimizer`, with its
    weight decay, never sees them. Leaves that cannot be trained by gradients are
    frozen too: integer and boolean leaves (their gradients are ``float0``) and empty
    (zero-size) ones.

    Works on any pytree of parameters, including an `eqx.Module`. For gradient
    accumulation pass ``optax.MultiSteps(opt, k)`` as `optimizer` (see
    `freeze_subtrees`): wrapped outside, `MultiSteps` would keep a full-size
    accumulator for every frozen weight.

    Examples:
        >>> optimizer = qax.freeze_keys(optax.adam(3e-4), LoraMatrix, ["w"])
        >>> opt_state = optimizer.init(params)
        >>> updates, opt_state = optimizer.update(grads, opt_state, params)
        >>> params = optax.apply_updates(params, updates)

    Args:
      optimizer: the optax transformation for the trained leaves.
      arr_type: the class whose fields are frozen (an `ImplicitArray` subclass or any
        pytree class with keys); instances of subclasses count too.
      keys: names of the child fields to freeze (a single name may be given as a string).
      use_scalar_zeros: give frozen leaves 0-d zero updates instead of full-size zeros.

    Returns:
      An optax transformation whose `update` takes ``(grads, state, params)``.

    Raises:
      ValueError: a key that is not a child field of `arr_type`.
      RuntimeError: (from ``init`` and ``update``) the parameters are implicit arrays
        inside `qax.use_implicit_args`: the step belongs outside the wrapper.
    """
    keys = _check_keys(arr_type, keys)

    def is_arr(x: Any) -> bool:
        return isinstance(x, arr_type)

    def label_tree(tree: Any) -> Any:
        return jax.tree_util.tree_map(label_node, tree, is_leaf=is_arr)

    def label_node(node: Any) -> Any:
        if not is_arr(node):
            return _leaf_label(node)
        keyed, treedef = jax.tree_util.tree_flatten_with_path(
            node, is_leaf=lambda x: x is not node and x is not None
        )
        labels = []
        for (key, *_), child in keyed:
            if key_value(key) in keys:
                labels.append(jax.tree_util.tree_map(lambda _: FREEZE, child))
            else:
                labels.append(label_tree(child))
        return jax.tree_util.tree_unflatten(treedef, labels)

    tx = freeze_subtrees(optimizer, label_tree, use_scalar_zeros)

    def init_fn(params: Any) -> Any:
        _check_outside_wrapper("freeze_keys(...).init", params)
        leaves = jax.tree_util.tree_leaves(params, is_leaf=is_arr)
        if not any(map(is_arr, leaves)):
            name = getattr(arr_type, "__name__", repr(arr_type))
            warnings.warn(_errors.NOTHING_FROZEN.format(cls=name), stacklevel=2)
        return tx.init(params)

    def update_fn(updates: Any, state: Any, params: Any = None, **extra: Any) -> Any:
        _check_outside_wrapper("freeze_keys(...).update", params)
        return tx.update(updates, state, params, **extra)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _check_keys(arr_type: type, keys: Iterable[str] | str) -> frozenset[str]:
    if not isinstance(arr_type, type):
        raise TypeError(
            f"freeze_keys: `arr_type` must be a class (e.g. LoraMatrix), got {arr_type!r}."
        )
    keys = frozenset([keys] if isinstance(keys, str) else keys)
    if not dataclasses.is_dataclass(arr_type):
        return keys
    if issubclass(arr_type, ImplicitArray):
        known = fields_of(arr_type).children
    else:
        known = tuple(f.name for f in dataclasses.fields(arr_type))
    unknown = sorted(keys - set(known))
    if unknown:
        raise ValueError(
            _errors.UNKNOWN_FREEZE_KEYS.format(
                cls=arr_type.__name__,
                unknown=", ".join(map(repr, unknown)),
                known=", ".join(map(repr, known)),
            )
        )
    return keys


def _leaf_label(leaf: Any) -> str:
    """``"train"`` unless the leaf cannot be trained (empty, or not floating point)."""
    shape, dtype = np.shape(leaf), _dtype(leaf)
    if 0 in shape or not jnp.issubdtype(dtype, jnp.inexact):
        return FREEZE
    return TRAIN


def apply_updates(params: Any, updates: Any) -> Any:
    """`optax.apply_updates` that also accepts symbolic constants among the updates.

    A `qax.symbols.SymbolicConstant` update whose value is zero leaves its parameter as
    it is (bitwise, without materializing anything); another constant is added as a
    scalar. ``None`` and ``float0`` updates leave their parameter unchanged. Parameters
    that are symbolic constants are not trainable and are returned unchanged. The result
    keeps each parameter's dtype.

    Examples:
        >>> zero = qax.symbols.symbolic_zero_like(w)
        >>> qax.utils.apply_updates({"w": w, "b": b}, {"w": zero, "b": db})

    Args:
      params: the parameters (may contain implicit arrays).
      updates: a tree with the structure of `params`, whose leaves may be symbolic
        constants standing for whole arrays.

    Returns:
      The updated parameters.

    Raises:
      ValueError: the structures of `params` and `updates` differ.
      RuntimeError: called inside `qax.use_implicit_args` on implicit parameters (the
        message shows the step outside the wrapper).
    """

    def is_leaf(x: Any) -> bool:
        return x is None or isinstance(x, SymbolicConstant)

    _check_outside_wrapper("apply_updates", params)
    flat_updates, treedef = jax.tree_util.tree_flatten(updates, is_leaf=is_leaf)
    try:
        flat_params = treedef.flatten_up_to(params)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"apply_updates: `updates` must have the structure of `params`: {e}"
        ) from None
    frozen = treedef.flatten_up_to(_frozen_mask(params))
    new = [
        p if f is True else _apply_one(p, u)
        for p, u, f in zip(flat_params, flat_updates, frozen, strict=True)
    ]
    return jax.tree_util.tree_unflatten(treedef, new)


def _frozen_mask(tree: Any) -> Any:
    """`tree` with `True` at every leaf of a field that its implicit array declares
    frozen (`frozen_fields`), `False` at the other leaves."""

    def one(x: Any) -> Any:
        if not is_implicit(x):
            return False
        frozen = set(x.frozen_fields())
        children = {
            name: jax.tree_util.tree_map(lambda _: True, child)
            if name in frozen
            else _frozen_mask(child)
            for name, child in children_of(x).items()
        }
        return rebuild(x, children, x.shape, x.__dict__.get(NB, 0))

    return jax.tree_util.tree_map(one, tree, is_leaf=is_implicit)


def _apply_one(param: Any, update: Any) -> Any:
    if update is None or isinstance(param, SymbolicConstant):
        return param
    if isinstance(update, SymbolicConstant):
        if update.value == 0:
            return param
    elif _dtype(update) == _float0:
        return param
    if isinstance(param, ImplicitArray) or isinstance(update, ImplicitArray):
        return use_implicit_args(_add)(param, update)
    return _add(param, update)


def _add(param: Any, update: Any) -> Any:
    return jnp.asarray(param + update).astype(_dtype(param))
