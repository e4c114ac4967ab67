"""Flax NNX support: an optimizer and filters for models whose `Variable`s hold implicit
arrays.

Put an implicit array into any `nnx.Variable` (``layer.kernel.set_value(lora)``) and call
the model through `qax.use_implicit_args`, in either order with `nnx.jit`:
``nnx.jit(qax.use_implicit_args(f))`` and ``qax.use_implicit_args(nnx.jit(f))`` both
work, and in-place updates that `f` makes to the model's `Variable`s reach the caller's
model.

Two things need this module:

- `Optimizer`: `nnx.Optimizer` stores its state by flattening it with NNX's graph
  flattening, which takes an implicit array in a moment (Adam's ``mu`` of a LoRA
  weight) apart into its fields, so the second `update` fails with a pytree structure
  error. `qax.nnx.Optimizer` is a drop-in replacement that writes the new state back
  `Variable` by `Variable`.
- `holds`: an NNX filter (for `nnx.state`, `nnx.split`, `nnx.DiffState`, ``wrt=``) that
  selects the `Variable`s holding an implicit array of given types, e.g. the LoRA
  weights.

NNX filters select whole `Variable`s, so ``nnx.DiffState(0, holds(LoraWeight))``
differentiates everything a selected `Variable` holds. Over a quantized base (QLoRA)
that includes integer codes, which JAX refuses to differentiate; split the factors off
instead and differentiate only them (nothing in ``base`` is differentiated)::

    graphdef, lora_state, rest = nnx.split(model, qax.nnx.holds(LoraWeight), ...)
    adapters, base = qax.lora.split(lora_state)
    def loss(adapters):
        model = nnx.merge(graphdef, qax.lora.combine(adapters, base), rest)
        ...
    grads = jax.grad(loss)(adapters)    # then optax on `adapters`, and at the end
    nnx.update(model, qax.lora.combine(adapters, base))

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

from typing import Any

import jax

try:
    from flax import nnx
except ImportError as e:  # pragma: no cover (flax is in the test extra)
    raise ImportError(
        "qax.nnx needs Flax: `pip install flax` (or `pip install qax[integrations]`)."
    ) from e

from . import _errors
from ._base import ImplicitBase
from ._interpreter import ImplicitTracer
from ._optax import apply_updates

__all__ = ["Optimizer", "holds"]


def holds(*types: type) -> Any:
    """An NNX filter: the `Variable`s whose value is an implicit array of `types`.

    With no `types`, any implicit array matches. Combine it with NNX's own filters
    (``nnx.All(nnx.Param, qax.nnx.holds(LoraMatrix))``) and use it wherever NNX takes
    a filter: `nnx.state`, `nnx.split`, `nnx.DiffState` for `nnx.grad`, and ``wrt=`` of
    `qax.nnx.Optimizer`. It selects whole `Variable`s: to differentiate only the
    factors of LoRA weights over a quantized base (QLoRA), split them off with
    ``nnx.split(model, holds(LoraWeight), ...)`` and `qax.lora.split` (see the module
    docstring).

    Examples:
        >>> lora_state = nnx.state(model, qax.nnx.holds(LoraMatrix))

    Args:
      types: implicit array classes (subclasses of `qax.ImplicitArray`).

    Returns:
      A filter: a callable ``(path, value) -> bool``.

    Raises:
      TypeError: one of `types` is not an implicit array class.
    """
    for t in types:
        if not (isinstance(t, type) and issubclass(t, ImplicitBase)):
            raise TypeError(
                f"qax.nnx.holds takes implicit array classes, got {t!r}. Pass the "
                "class of the values to select, e.g. `qax.nnx.holds(LoraWeight)`."
            )
    wanted = types or (ImplicitBase,)

    def holds_implicit(path: tuple, value: Any) -> bool:
        del path
        if not isinstance(value, nnx.Variable):
            return False
        raw = value.get_raw_value()
        if isinstance(raw, ImplicitTracer):  # inside `qax.use_implicit_args`
            raw = raw.value
        return isinstance(raw, wanted)

    names = ", ".join(t.__name__ for t in types) or "any implicit array"
    holds_implicit.__qualname__ = holds_implicit.__name__ = f"holds({names})"
    return holds_implicit


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
