"""Flax NNX support: an optimizer, a filter and gradient transforms for models whose
hold implicit arrays.

Put an implicit array into any `nnx.Variable` (``layer.kernel.set_value(lora)``) and call
the model through `qax.use_implicit_args`, in either order with `nnx.jit`:
``nnx.jit(qax.use_implicit_args(f))`` and ``qax.use_implicit_args(nnx.jit(f))`` both
work, and in-place updates that `f` makes to the model's `Variable`s reach the caller's
model.

Three things need this module:

- `Optimizer`: `nnx.Optimizer` stores its state by flattening it with NNX's graph
  flattening, which takes an implicit array in a moment (Adam's ``mu`` of a LoRA
  weight) apart into its fields, so the second `update` fails with a pytree structure
  error. `qax.nnx.Optimizer` is a drop-in replacement that writes the new state back
  `Variable` by `Variable`.
- `holds`: an NNX filter (for `nnx.state`, `nnx.split`, `nnx.DiffState`, ``wrt=``) that
  selects the `Variable`s holding an implicit array of given types, e.g. the LoRA
  weights.
- `value_and_grad` and `grad`: NNX filters select whole `Variable`s, so
  ``nnx.DiffState(0, holds(LoraWeight))`` makes `nnx.value_and_grad` differentiate
  everything a selected `Variable` holds; over a quantized base (QLoRA) that includes
  integer codes, which JAX refuses (and the error, raised from `holds`, names this
  recipe). ``qax.nnx.value_and_grad`` takes the same arguments and differentiates only
  the trainable fields of the implicit values, so QLoRA trains by the LoRA recipe with
  that one name changed::

    lora = qax.nnx.holds(LoraWeight)
    optimizer = qax.nnx.Optimizer(
        model, qax.freeze_keys(optax.adam(1e-3), LoraWeight, ["w"]), wrt=lora)
    grad_fn = qax.nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, lora))
    loss, grads = grad_fn(model, x, y)   # the codes get float0 gradients
    optimizer.update(model, grads)       # the codes stay bitwise as they were

Importing this module imports Flax; `import qax` alone never does.

Examples:
    >>> from flax import nnx
    >>> model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    >>> model.kernel.set_value(LoraMatrix(model.kernel.get_value(), a, b))
    >>> trainable = qax.nnx.holds(LoraMatrix)
    >>> opt = qax.nnx.Optimizer(model, qax.freeze_keys(optax.adam(1e-2), LoraMatrix, ["w"]),
    ...                         wrt=trainable)
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

try:
    from flax import nnx
except ImportError as e:  # pragma: no cover (flax is in the test extra)
    raise ImportError(
        "qax.nnx needs Flax: `pip install flax` (or `pip install qax[integrations]`)."
    ) from e

from . import _errors
from ._base import ImplicitBase
from ._compat import frame_variable
from ._interpreter import ImplicitTracer
from ._optax import apply_updates

__all__ = ["Optimizer", "grad", "holds", "value_and_grad"]


def holds(*types: type) -> Any:
    """An NNX filter: the `Variable`s whose value is an implicit array of `types`.

    With no `types`, any implicit array matches. Combine it with NNX's own filters
    (``nnx.All(nnx.Param, qax.nnx.holds(LoraMatrix))``) and use it wherever NNX takes
    a filter: `nnx.state`, `nnx.split`, `nnx.DiffState` for `nnx.grad`, and ``wrt=`` of
    `qax.nnx.Optimizer`. It selects whole `Variable`s: to differentiate only the
    factors of LoRA weights over a quantized base (QLoRA), use `qax.nnx.value_and_grad`
    (see the module docstring). Used by `nnx.grad` / `nnx.value_and_grad` (without
    ``allow_int``) on a `Variable` whose value holds integer codes, it raises the error
    that names that recipe, before JAX's.

    Examples:
        >>> lora_state = nnx.state(model, qax.nnx.holds(LoraMatrix))

    Args:
      types: implicit array classes (subclasses of `qax.ImplicitArray`).

    Returns:
      A filter: a callable ``(path, value) -> bool``.

    Raises:
      TypeError: one of `types` is not an implicit array class; or, from the filter,
        `nnx.grad` would differentiate integer codes (see above).
    """
    for t in types:
        if not (isinstance(t, type) and issubclass(t, ImplicitBase)):
            raise TypeError(
                f"qax.nnx.holds takes implicit array classes, got {t!r}. Pass the "
                "class of the values to select, e.g. `qax.nnx.holds(LoraWeight)`."
            )
    wanted = types or (ImplicitBase,)

    names = ", ".join(t.__name__ for t in types) or "any implicit array"

    def holds_implicit(path: tuple, value: Any) -> bool:
        if not isinstance(value, nnx.Variable):
            return False
        raw = value.get_raw_value()
        if isinstance(raw, ImplicitTracer):  # inside `qax.use_implicit_args`
            raw = raw.value
        if not isinstance(raw, wanted):
            return False
        integer = _integer_field(raw)
        if integer is not None and _whole_variable_grad():
            field, dtype, owner = integer
            raise TypeError(
                _errors.NNX_GRAD_WHOLE_VARIABLE.format(
                    filter=f"qax.nnx.holds({names})",
                    path=".".join(map(str, path)),
                    cls=type(raw).__name__,
                    field=field,
                    dtype=dtype,
                    owner=owner,
                )
            )
        return True

    holds_implicit.__qualname__ = holds_implicit.__name__ = f"holds({names})"
    return holds_implicit


def _integer_field(value: ImplicitBase, prefix: str = "") -> tuple | None:
    """The first leaf of `value` that JAX cannot differentiate, as (its key path, its
    dtype, the class of the implicit array whose field it is), or ``None``."""
    children = jax.tree_util.tree_flatten_with_path(
        value, is_leaf=lambda x: x is not value and isinstance(x, ImplicitBase)
    )[0]
    for path, leaf in children:
        name = prefix + jax.tree_util.keystr(path)
        if isinstance(leaf, ImplicitBase):
            found = _integer_field(leaf, name)
            if found is not None:
                return found
            continue
        dtype = getattr(leaf, "dtype", None)
        if dtype is not None and not np.issubdtype(dtype, np.inexact):
            return name, dtype, type(value).__name__
    return None


def _whole_variable_grad() -> bool:
    """Whether a filter runs where `nnx.grad` / `nnx.value_and_grad` splits off the
    Variables it will differentiate, without ``allow_int``: Flax's ``_grad_split_fn``
    under its ``grad_wrapper``. Best effort (Flax's own frames): ``False`` where they
    are not recognised, and JAX's error then comes as it is."""
    frame, split = sys._getframe(2), False
    for _ in range(40):
        if frame is None:
            return False
        code = frame.f_code
        if "flax" in code.co_filename:
            if code.co_name == "_grad_split_fn":
                split = True
            elif code.co_name == "grad_wrapper" and split:
                return frame_variable(frame, "allow_int") is False
        frame = frame.f_back
    return False


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def _check_outside_wrapper(params: Any) -> None:
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        if isinstance(leaf, ImplicitTracer):
            raise RuntimeError(
                _errors.NNX_UPDATE_INSIDE_WRAPPER.format(
                    path=jax.tree_util.keystr(path), cls=type(leaf.value).__name__
                )
            )


class Optimizer(nnx.Optimizer):
    """`nnx.Optimizer` for models whose `Variable`s hold implicit arrays.

    Same constructor and `update(model, grads)` as `nnx.Optimizer`. Its optimizer state
    keeps each implicit array (the moments of a LoRA weight are LoRA-shaped) intact
    across updates, which `nnx.Optimizer` does not (see the module docstring). With
    plain arrays only it computes exactly what `nnx.Optimizer` computes.

    Examples:
        >>> opt = qax.nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        >>> grads = nnx.grad(loss)(model)  # loss calls the model via qax.use_implicit_args
        >>> opt.update(model, grads)

    It takes `nnx.Optimizer`'s arguments: ``model``, the NNX module; ``tx``, the optax
    transformation, e.g. ``qax.freeze_keys(optax.adam(1e-3), LoraWeight, ["w"])`` to
    train the LoRA factors only; ``wrt``, the filter of the `Variable`s to optimize.
    """

    def update(self, model: Any, grads: Any, /, **kwargs: Any) -> Any:
        """Apply one optimizer step to `model` in place.

        Args:
          model: the module the optimizer was built for.
          grads: gradients from `nnx.grad` (a `State` or a module).
          **kwargs: extra arguments for `tx.update` (as `nnx.Optimizer.update`).

        Returns:
          The updates applied to the parameters.

        Raises:
          RuntimeError: called inside `qax.use_implicit_args` (the message shows the
            order that works).
        """
        params = nnx.as_pure(nnx.state(model, self.wrt, graph=self.graph))
        _check_outside_wrapper(params)
        grads = nnx.as_pure(nnx.state(grads, self.wrt, graph=self.graph))
        state = nnx.as_pure(self.opt_state)
        updates, new_state = self.tx.update(grads, state, params, **nnx.as_pure(kwargs))
        # qax's `apply_updates`: fields that a value declares frozen stay as they are
        nnx.update(model, apply_updates(params, updates))
        # Each optimizer-state Variable takes the whole new subtree at its position
        # (an implicit array stays one value), instead of NNX's graph flattening of it.
        jax.tree_util.tree_map(
            lambda variable, value: variable.set_value(value),
            self.opt_state,
            new_state,
            is_leaf=_is_variable,
        )
        self.step[...] += 1
        return updates


def value_and_grad(
    f: Callable[..., Any] | None = None,
    *,
    argnums: Any = 0,
    has_aux: bool = False,
    **kwargs: Any,
) -> Any:
    """`nnx.value_and_grad` for models whose `Variable`s hold implicit arrays whose
    fields JAX cannot differentiate (QLoRA: LoRA factors over integer codes).

    The same arguments and results as `nnx.value_and_grad` (``argnums`` with
    `nnx.DiffState` filters, ``has_aux``, ``holomorphic``, in-place updates), so the
    NNX LoRA recipe trains QLoRA with this one name changed. The integer fields of the
    implicit values in the differentiated Variables (quantized codes) get `float0`
    gradients instead of JAX's error; frozen fields get none that count
    (`qax.lora.LoraWeight` stops the gradient of its base ``w``), so
    ``qax.freeze_keys(optax.adam(...), LoraWeight, ["w"])`` with `qax.nnx.Optimizer`
    trains the factors and leaves the codes bitwise unchanged. An integer array that
    no implicit array holds is refused, as JAX refuses it.

    Examples:
        >>> lora = qax.nnx.holds(qax.lora.LoraWeight)
        >>> optimizer = qax.nnx.Optimizer(
        ...     model, qax.freeze_keys(optax.adam(1e-2), LoraWeight, ["w"]), wrt=lora)
        >>> grad_fn = qax.nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, lora))
        >>> loss, grads = grad_fn(model, x, y)
        >>> optimizer.update(model, grads)

    Args:
      f: the function to differentiate (omitted: a decorator).
      argnums: as for `nnx.value_and_grad`: positions, or `nnx.DiffState` filters.
      has_aux: as for `nnx.value_and_grad`.
      **kwargs: `nnx.value_and_grad`'s other options (``holomorphic``, ``graph``,
        ...).

    Returns:
      A function returning ``(value, grads)`` (``((value, aux), grads)`` with
      ``has_aux``).

    Raises:
      TypeError: a differentiated argument holds an integer array outside any
        implicit array (when the returned function is called).
    """
    return _differentiated(
        nnx.value_and_grad, "value_and_grad", f, argnums, has_aux, kwargs
    )


def grad(
    f: Callable[..., Any] | None = None,
    *,
    argnums: Any = 0,
    has_aux: bool = False,
    **kwargs: Any,
) -> Any:
    """`nnx.grad` for models whose `Variable`s hold implicit arrays whose fields JAX
    cannot differentiate; see `value_and_grad`.

    Examples:
        >>> grads = qax.nnx.grad(loss_fn, argnums=nnx.DiffState(0, lora))(model, x, y)

    Args:
      f: the function to differentiate (omitted: a decorator).
      argnums: as for `nnx.grad`: positions, or `nnx.DiffState` filters.
      has_aux: as for `nnx.grad`.
      **kwargs: `nnx.grad`'s other options.

    Returns:
      A function returning the gradients (``(grads, aux)`` with ``has_aux``).

    Raises:
      TypeError: a differentiated argument holds an integer array outside any
        implicit array (when the returned function is called).
    """
    return _differentiated(nnx.grad, "grad", f, argnums, has_aux, kwargs)


def _differentiated(
    transform: Callable, name: str, f: Any, argnums: Any, has_aux: bool, kwargs: dict
) -> Any:
    if f is None:  # used as a decorator with arguments
        return functools.partial(
            _differentiated, transform, name, argnums=argnums, has_aux=has_aux,
            kwargs=kwargs,
        )  # fmt: skip
    kwargs = dict(kwargs)
    allow_int = kwargs.pop("allow_int", False)
    gradded = transform(f, argnums=argnums, has_aux=has_aux, allow_int=True, **kwargs)
    filters = _diff_filters(argnums)

    @functools.wraps(f)
    def differentiated(*args: Any, **kw: Any) -> Any:
        if not allow_int:
            _check_differentiable(f"qax.nnx.{name}", f, filters, args, kw)
        return gradded(*args, **kw)

    return differentiated


def _diff_filters(argnums: Any) -> dict[int, Any]:
    """The differentiated positions and their filters (`nnx.Param` for a bare int,
    as `nnx.grad` takes for modules)."""
    items = argnums if isinstance(argnums, (list, tuple)) else [argnums]
    out = {}
    for item in items:
        if isinstance(item, nnx.DiffState):
            out[item.argnum] = item.filter
        else:
            out[int(item)] = nnx.Param
    return out


def _check_differentiable(
    name: str, f: Callable, filters: dict[int, Any], args: tuple, kw: dict
) -> None:
    """Refuse, as JAX does, integer arrays in the differentiated arguments that no
    implicit array holds."""
    if kw:
        try:
            args = inspect.signature(f).bind(*args, **kw).args
        except (TypeError, ValueError):
            pass
    for argnum, where in filters.items():
        if argnum >= len(args):
            continue
        arg = args[argnum]
        tree = nnx.state(arg, where) if nnx.graph.is_graph_node(arg) else arg
        leaves = jax.tree_util.tree_leaves_with_path(
            tree, is_leaf=lambda x: isinstance(x, (ImplicitBase, ImplicitTracer))
        )
        for path, leaf in leaves:
            if isinstance(leaf, (ImplicitBase, ImplicitTracer)):
                continue
            dtype = getattr(leaf, "dtype", None)
            if dtype is not None and not np.issubdtype(dtype, np.inexact):
                raise TypeError(
                    _errors.NNX_GRAD_INTEGER_INPUT.format(
                        name=name,
                        argnum=argnum,
                        dtype=dtype,
                        path=jax.tree_util.keystr(path) or "the argument itself",
                    )
                )
