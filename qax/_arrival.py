"""Stored fields reach the code that decodes them in their stored form.

In a program split over devices, XLA moves a value between devices where its sharding
propagation finds that a producer and a consumer need different layouts. A quantized
weight stored split along a dimension (FSDP) and decoded by an elementwise conversion
(int8 codes to float) is gathered *after* the conversion: the conversion takes the
layout of its operand, the product needs the whole weight, so the floats move, four
times the bytes of the codes.

A field declared ``qax.array_field(..., stored=True)`` holds storage of that kind. When
a product (`dot_general`, `conv_general_dilated`) has an implicit operand in a staged
program, each tracer leaf of the operand's stored fields first passes through `arrive`,
before the handler, rule or materialization that decodes it runs: an identity that
compiles to a Shardy propagation barrier closed in both directions, so that the layout
of its result comes from the product and that of its operand from where it is stored.
The resharding then happens at the barrier, on the stored leaf: under FSDP the codes
are gathered as int8 / uint8 and decoded after the gather; in a Megatron layout the
product uses the weight where it lies, and nothing moves.

Only products: a consumer with no layout of its own (an elementwise op whose result is
returned, a reduction) would give the barrier's result no layout to take, and the
stored leaf would be gathered whole where the decoded value could have stayed split.
For the same reason a product whose other operand is replicated gathers the codes,
where XLA would otherwise have summed partial products (cheaper for a handful of rows:
one row of 1024 outputs is 4 KB against 256 KB of int8 codes of a 256 x 1024 weight).

The barrier is gone after sharding propagation: on one device, and in programs that
need no resharding, it compiles to nothing. With the deprecated GSPMD partitioner
(``jax_use_shardy_partitioner=False``) it is an identity: correct, without the saving.
"""

from __future__ import annotations

from typing import Any

import jax

from ._base import NB, ImplicitBase, is_implicit
from ._compat import (
    Primitive,
    Tracer,
    may_stage,
    primitive_batchers,
    primitive_jvps,
    propagation_barrier,
    register_lowering,
    set_current_trace,
)
from ._fields import fields_of, rebuild

__all__ = ["PRODUCTS", "arrive", "arrived_operands", "stored_fields"]


# ----------------------------------------------------------------------------------------
# The primitive: an identity that AD and vmap see through


arrive_p = Primitive("qax_arrive")
arrive_p.def_impl(lambda x: x)
arrive_p.def_abstract_eval(lambda aval: aval)


def _arrive_jvp(primals: Any, tangents: Any) -> tuple:
    ((x,), (t,)) = primals, tangents
    return arrive_p.bind(x), t


def _arrive_batch(args: Any, dims: Any) -> tuple:
    return arrive_p.bind(args[0]), dims[0]


primitive_jvps[arrive_p] = _arrive_jvp
primitive_batchers[arrive_p] = _arrive_batch
register_lowering(arrive_p, lambda ctx, x: [propagation_barrier(x)])


# The primitives whose implicit operands' stored fields arrive before they are decoded.
PRODUCTS = frozenset((jax.lax.dot_general_p, jax.lax.conv_general_dilated_p))


def arrive(x: Any) -> Any:
    """`x`, resharded (in a program split over devices) as its consumers need it."""
    return arrive_p.bind(x)


# ----------------------------------------------------------------------------------------
# Implicit arrays


def stored_fields(x: Any) -> tuple[str, ...]:
    """The fields of implicit `x` declared ``stored=True`` (none for other values)."""
    return fields_of(type(x)).stored if isinstance(x, ImplicitBase) else ()


def with_stored_arrived(x: Any) -> Any:
    """`x`, with the tracer leaves of its stored fields passed through `arrive`.

    A copy when `x` is an implicit array whose type declares stored fields; else `x`
    itself. Implicit arrays inside those fields are left to their own declarations.
    """
    names = stored_fields(x)
    if not names:
        return x
    d = x.__dict__
    changes = {
        name: jax.tree_util.tree_map(_arrived, d[name], is_leaf=is_implicit)
        for name in names
    }
    return rebuild(x, changes, d["shape"], d.get(NB, 0))


def _arrived(leaf: Any) -> Any:
    return arrive(leaf) if isinstance(leaf, Tracer) else leaf


def arrived_operands(trace: Any, vals: list) -> list:
    """`vals`, the operands of a product on `trace` (an `ImplicitTrace`), with the
    stored fields of the implicit ones arrived when the program is staged."""
    parent = trace.parent_trace
    if not may_stage(parent):
        return vals
    with set_current_trace(parent):
        return [with_stored_arrived(v) for v in vals]
