"""Rules for `jit` and `checkpoint` (`remat`): bodies re-traced on implicit values.

A body is staged over the leaves of its implicit operands, once per input signature
(kept by `qax._bodies`), and the primitive is bound again on the leaves, so the parent
sees one unit.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from .. import _bodies, _dispatch
from .._base import ImplicitBase
from .._compat import (
    UNSPECIFIED,
    ArrayImpl,
    Tracer,
    bind_with_trace,
    canonicalize_value,
    eval_context,
    eval_jaxpr,
    is_inline_jit,
    known_constant,
    primitives_module,
    typeof,
    weakly_typed,
)
from .._interpreter import ImplicitTrace
from . import _staging
from ._staging import _hoisted, _leaf_shardings, _per_leaf, _same_for_all

# ----------------------------------------------------------------------------------------
# jit


def _jit_rule(trace: ImplicitTrace, primitive, vals: list, params: dict) -> list:
    """A nested `jit` on implicit operands: its body, re-traced once per signature.

    The body runs on the implicit values (so their handlers apply) and is staged over
    their leaves; the result is bound as a `jit` again, so the parent sees one cached
    unit (its differentiation, batching and compilation are cached by JAX too; eagerly,
    the trace runs it as it runs any plain `jit`). Scalars with known values given to a
    `jnp` wrapper (``inline=True``) are baked into the body, where a traced program sees
    them as literals.
    """
    closed = params["jaxpr"]
    inline = is_inline_jit(params)
    baked = _scalar_literals(vals) if inline else {}
    for i, v in baked.items():  # as weak as the body declares them (the tangent
        # inputs of a differentiated `jnp` function are as weak as its primal inputs)
        if closed.in_avals[i].weak_type and not typeof(v).weak_type:
            with eval_context():
                baked[i] = weakly_typed(v)
    dynamic = [v for i, v in enumerate(vals) if i not in baked]
    # Bytes, not values: 0.0 and -0.0 are equal but fold differently.
    scalars = tuple((i, np.asarray(v).tobytes(), typeof(v)) for i, v in baked.items())
    key, flat_dynamic = _bodies.signature(dynamic, "jit", scalars)
    traced = _bodies.reuse(closed, key)
    if traced is None:

        def body(wrapped):
            it = iter(wrapped)
            args = [baked[i] if i in baked else next(it) for i in range(len(vals))]
            return eval_jaxpr(closed.jaxpr, closed.consts, *args)

        declared = [a for i, a in enumerate(closed.in_avals) if i not in baked]
        traced, _ = _staging.trace_body(
            trace, body, dynamic, params["name"], declared=declared
        )
        _bodies.keep(closed, key, traced, traced.events, traced.cacheable)

    out_vals = traced.out_skeleton()
    if baked:  # drop the baked operands' entries from the per-operand parameters
        kept = [i not in baked for i in range(len(vals))]
        per_operand = ("donated_invars", "in_shardings", "in_layouts")
        params = params | {
            n: tuple(itertools.compress(params[n], kept)) for n in per_operand
        }

    def sharding(p, value):
        return _leaf_shardings(p, value, UNSPECIFIED, "jit shardings")

    new_params = dict(
        params,
        jaxpr=traced.jaxpr,
        donated_invars=_per_leaf(dynamic, params["donated_invars"], _const(False)),
        in_shardings=_per_leaf(dynamic, params["in_shardings"], sharding),
        in_layouts=_per_leaf(dynamic, params["in_layouts"], _const(None)),
        out_shardings=_per_leaf(out_vals, params["out_shardings"], sharding),
        out_layouts=_per_leaf(out_vals, params["out_layouts"], _const(None)),
    )
    flat_dynamic = [
        x if isinstance(x, Tracer) else canonicalize_value(x) for x in flat_dynamic
    ]
    outs = trace.bind_plain(primitive, flat_dynamic, new_params)
    return jax.tree_util.tree_unflatten(traced.out_tree, outs)


_dispatch.primitive_rules[primitives_module.jit_p] = _jit_rule


def _scalar_literals(vals: Sequence) -> dict[int, Any]:
    """The scalar operands whose values are known now (concrete, or trace literals).

    A traced program sees them as literals, so baking them into a re-traced body keeps
    what handlers see (e.g. symbolic constants fold ``c * 2.0``).
    """
    found = {}
    for i, v in enumerate(vals):
        if (type(v) is ArrayImpl and v.ndim) or isinstance(v, ImplicitBase):
            continue
        try:
            aval = typeof(v)
        except TypeError:
            continue
        if aval.shape:
            continue
        if isinstance(v, Tracer):
            v = known_constant(v)
            if v is None:
                continue
        found[i] = canonicalize_value(v)
    return found


def _const(default: Any) -> Callable:
    """`default` for every leaf of a value, whatever its parameter."""
    return lambda _p, v: _same_for_all(default, v)


# ----------------------------------------------------------------------------------------
# checkpoint / remat


def _remat_rule(trace: ImplicitTrace, primitive, vals: list, params: dict) -> list:
    jaxpr = params["jaxpr"]  # an open Jaxpr without constvars
    key, flat_vals = _bodies.signature(vals)
    traced = _bodies.reuse(jaxpr, key)
    if traced is None:

        def body(wrapped):
            return eval_jaxpr(jaxpr, (), *wrapped)

        declared = [v.aval for v in jaxpr.invars]
        traced, _ = _staging.trace_body(
            trace, body, vals, "checkpoint", declared=declared
        )
        _bodies.keep(jaxpr, key, traced, traced.events, traced.cacheable)
    body_jaxpr, hoisted = _hoisted(traced)
    prevent_cse = params["prevent_cse"]
    if isinstance(prevent_cse, tuple):
        per_leaf = _per_leaf(vals, prevent_cse, _same_for_all)
        prevent_cse = (True,) * len(hoisted) + per_leaf
    new_params = dict(params, jaxpr=body_jaxpr.jaxpr, prevent_cse=prevent_cse)
    operands = [*hoisted, *flat_vals]
    outs = bind_with_trace(trace.parent_trace, primitive, operands, new_params)
    return jax.tree_util.tree_unflatten(traced.out_tree, outs)


_dispatch.primitive_rules[primitives_module.remat_p] = _remat_rule
