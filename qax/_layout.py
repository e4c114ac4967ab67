"""`contracted_axes`: PEFT's adapter layout, read from how a model uses each weight.

PEFT and qwix put a LoRA adapter's ``a`` (``lora_A``, the down-projection) along the
axes of a weight that the model contracts with its input, and ``b`` along the others.
For a Dense kernel ``(in, out)`` those are the leading axes, `loraify`'s default; for an
einsum kernel such as Gemma's query kernel ``(heads, d_model, head_dim)`` they are not,
and `loraify` needs ``a_axes`` per kind of kernel. `contracted_axes` traces the model
once, abstractly (shapes only: nothing is computed), and finds for each weight the axes
its products contract, so that one argument gives every kernel PEFT's layout:

```python
layout = qax.lora.contracted_axes(loss_fn, params, batch)
params = qax.lora.loraify(params, 8, key=key, a_axes=layout)
```

Exposed as `qax.utils.contracted_axes` and `qax.lora.contracted_axes`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp

from ._base import ImplicitBase
from ._compat import scan_operand_counts
from ._tree_util import path_string

# Primitives that keep every axis of their operand where it was.
_SAME_AXES = frozenset(
    {"convert_element_type", "copy", "copy_p", "reduce_precision", "stop_gradient"}
)
# Primitives whose parameter holds a jaxpr called with the equation's inputs, in order.
_CALLS = {
    "pjit": "jaxpr",
    "jit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "remat": "jaxpr",
    "remat2": "jaxpr",
    "checkpoint": "jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
}


@dataclasses.dataclass(frozen=True)
class Layout:
    """The axes each weight's products contract, by path (see `contracted_axes`).

    Called as ``layout(path, leaf)`` (the form of `loraify`'s ``a_axes``), it returns
    the contracted axes of one unbatched weight at ``path``, or ``None`` where the trace
    found no single answer (a weight no product took, or one taken in two ways, such as
    a tied embedding looked up and multiplied): `loraify` then uses its default there.

    Attributes:
      axes: path -> contracted axes of one unbatched weight (its axes inside any
        `lax.scan` over stacked layers).
      ambiguous: paths used in more than one way, with each way.
    """

    axes: dict[str, tuple[int, ...]]
    ambiguous: dict[str, tuple[tuple[int, ...], ...]]

    def __call__(self, path: str, leaf: Any = None) -> tuple[int, ...] | None:
        return self.axes.get(path)


def contracted_axes(
    f: Callable[..., Any], params: Any, *args: Any, **kwargs: Any
) -> Layout:
    """The axes of each weight of ``params`` that ``f(params, *args)`` contracts.

    ``f`` is traced once with `jax.make_jaxpr` on abstract values (shapes and dtypes;
    nothing runs, implicit arrays in ``params`` are traced as the dense arrays they
    stand for). A weight's axes are followed through casts, transposes, calls (`jit`,
    `custom_jvp`, `checkpoint`) and `lax.scan` over stacked layers (where the axes are
    those of one layer) to the products that take it: `lax.dot_general` (``x @ w``,
    `jnp.einsum`) and row lookups (``table[ids]``: the looked-up axes). Convolutions are
    left to `loraify`'s default layout.

    Examples:
        >>> layout = qax.lora.contracted_axes(loss_fn, params, batch)
        >>> layout("layers/0/attn/kernel")
        (0,)
        >>> params = qax.lora.loraify(params, 8, key=key, a_axes=layout)

    Args:
      f: the model, ``f(params, *args, **kwargs)``, as it is called in training.
      params: the parameters (a pytree; an NNX `State`, a linen dict, ...).
      *args: example inputs (their shapes are used).
      **kwargs: more inputs.

    Returns:
      A `Layout`: pass it as ``a_axes`` to `loraify` (or `plan`).
    """

    def is_weight(x: Any) -> bool:
        return isinstance(x, ImplicitBase)

    found, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_weight)
    paths = [path_string(p) for p, _ in found]
    structs = [jax.ShapeDtypeStruct(jnp.shape(x), x.dtype) for _, x in found]

    def traced(leaves, args, kwargs):
        return f(jax.tree_util.tree_unflatten(treedef, leaves), *args, **kwargs)

    closed = jax.make_jaxpr(traced)(structs, args, kwargs)
    uses: dict[str, set[tuple[int, ...]]] = {}
    tracked = {
        var: (path, tuple(range(len(s.shape))), 0)
        for var, path, s in zip(closed.jaxpr.invars, paths, structs, strict=False)
    }
    _walk(closed.jaxpr, tracked, uses)
    axes, ambiguous = {}, {}
    for path, ways in uses.items():
        if len(ways) == 1:
            axes[path] = next(iter(ways))
        else:
            ambiguous[path] = tuple(sorted(ways))
    return Layout(axes, ambiguous)


def _jaxpr(x: Any) -> Any:
    return getattr(x, "jaxpr", x)


def _walk(jaxpr: Any, tracked: dict, uses: dict) -> None:
    """Follow the tracked variables (var -> (path, original axis of each axis, layer
    axes dropped)) through `jaxpr`'s equations, recording each product's contracted
    axes in `uses`."""
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        ins = [tracked.get(v) if _is_var(v) else None for v in eqn.invars]
        if not any(ins):
            continue
        if name in _SAME_AXES:
            _bind(tracked, eqn.outvars[0], ins[0])
        elif name == "transpose":
            path, axes, dropped = ins[0]
            perm = eqn.params["permutation"]
            _bind(
                tracked, eqn.outvars[0], (path, tuple(axes[p] for p in perm), dropped)
            )
        elif name == "dot_general":
            (contract_l, contract_r), _ = eqn.params["dimension_numbers"]
            for info, dims in zip(ins, (contract_l, contract_r), strict=True):
                _record(uses, info, dims)
        elif name == "gather" and ins[0] is not None:
            dn = eqn.params["dimension_numbers"]
            _record(uses, ins[0], (*dn.collapsed_slice_dims, *dn.start_index_map))
        elif name in _CALLS or name == "scan":
            inner = _jaxpr(eqn.params.get("jaxpr" if name == "scan" else _CALLS[name]))
            if inner is None or not hasattr(inner, "eqns"):
                continue
            sub = {}
            consts, first_x = None, None
            if name == "scan":
                consts, carry = scan_operand_counts(eqn.params)
                first_x = consts + carry
            for k, (var, info) in enumerate(zip(inner.invars, ins, strict=False)):
                if info is None:
                    continue
                if first_x is not None and k >= first_x:
                    path, axes, dropped = info
                    if not axes or axes[0] is None:
                        continue
                    info = (path, axes[1:], dropped + 1)
                elif first_x is not None and k >= consts:
                    continue  # a carry changes from step to step
                sub[var] = info
            _walk(inner, sub, uses)


def _is_var(v: Any) -> bool:
    return not hasattr(v, "val")  # a literal has a value


def _bind(tracked: dict, var: Any, info: Any) -> None:
    if info is not None:
        tracked[var] = info


def _record(uses: dict, info: Any, dims: Iterable[int]) -> None:
    if info is None:
        return
    path, axes, dropped = info
    original = sorted({axes[d] for d in dims if axes[d] is not None})
    if original:
        uses.setdefault(path, set()).add(tuple(a - dropped for a in original))
