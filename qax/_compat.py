"""The one place that touches JAX internals.

Everything qax needs from `jax._src` or `jax.extend` is imported here, so that a JAX
upgrade is a change to this file alone. Written against JAX 0.10.x.
"""

from __future__ import annotations

import jax
import jax.extend.core as jex_core
from jax._src import core as _core
from jax._src import dtypes as _dtypes
from jax._src import linear_util as _lu
from jax._src import source_info_util as _source_info
from jax._src.interpreters import partial_eval as _pe

Trace = _core.Trace
Tracer = _core.Tracer
ShapedArray = _core.ShapedArray
TraceTag = jex_core.TraceTag
Primitive = jex_core.Primitive
ClosedJaxpr = jex_core.ClosedJaxpr
Jaxpr = jex_core.Jaxpr
DebugInfo = jex_core.DebugInfo
take_current_trace = jex_core.take_current_trace
set_current_trace = jex_core.set_current_trace
jaxpr_as_fun = jex_core.jaxpr_as_fun
eval_jaxpr = _core.eval_jaxpr
ensure_no_leaks = _core.ensure_no_leaks
EvalTrace = _core.EvalTrace
typeof = jax.typeof
primitives_module = jex_core.primitives

trace_to_jaxpr_dynamic = _pe.trace_to_jaxpr_dynamic
convert_constvars_jaxpr = _pe.convert_constvars_jaxpr
wrap_init = _lu.wrap_init


def current_trace() -> Trace:
    """The trace that a `bind` right now would go to."""
    return _core.trace_ctx.trace


def is_eval_trace(trace: Trace) -> bool:
    return isinstance(trace, EvalTrace)


def bind_with_trace(trace: Trace, primitive: Primitive, args, params):
    """Bind `primitive` on `trace` with already canonical `args`."""
    return primitive.bind_with_trace(trace, args, tuple(map(typeof, args)), params)


def bind_leaves(trace: Trace, primitive: Primitive, leaves, params):
    """`bind_with_trace` for the leaves of implicit arrays, which may be raw values.

    Leaves built outside any trace (numpy arrays such as the shape witness, Python
    scalars) are canonicalized first, as `Primitive.bind` would do.
    """
    leaves = [
        x if isinstance(x, Tracer) else _dtypes.canonicalize_value(x) for x in leaves
    ]
    return bind_with_trace(trace, primitive, leaves, params)


def user_source_line() -> str | None:
    """`file:line (function)` of the innermost frame outside JAX and qax, if any."""
    info = _source_info.current()
    if info.traceback is None:
        return None
    frame = _source_info.user_frame(info.traceback)
    if frame is None:
        return None
    return f"{frame.file_name}:{frame.start_line} ({frame.function_name})"


def register_exclusion(path: str) -> None:
    """Hide qax's own frames from JAX's "user frame" search and tracebacks."""
    _source_info.register_exclusion(path)


def forget_arg_names(debug_info: DebugInfo | None) -> DebugInfo | None:
    """`debug_info` without argument names (for a function that now takes leaves)."""
    return None if debug_info is None else debug_info.with_unknown_names()


def make_debug_info(name: str) -> DebugInfo:
    return DebugInfo("qax", name, None, None)


from jax._src.sharding_impls import UNSPECIFIED  # noqa: E402,F401

shard_map_p = None
try:  # noqa: SIM105
    from jax._src.shard_map import shard_map_p  # noqa: E402,F401,F811
except ImportError:  # pragma: no cover
    pass

# -- used by the higher-order rules (`qax/_higher_order.py`) ------------------------------
from jax._src import ad_util as _ad_util  # noqa: E402
from jax._src.tree_util import FlatTree  # noqa: E402,F401

pvary_p = getattr(_core, "pvary_p", None)
Zero = _ad_util.Zero
SymbolicZero = _ad_util.SymbolicZero


def transformation2(gen, fun, *static_args):
    """`fun` (a `WrappedFun`) with one more transformation: `gen(f, *static_args, *args)`.

    The result shares `fun`'s output stores, so JAX can reset them before a re-trace.
    Its argument names are forgotten: the transformation may change their number.
    """
    return _lu.transformation2(gen)(fun, *static_args).with_unknown_names()


def reset_stores(fun) -> None:
    """Empty the output stores of a `WrappedFun`, so that it can be called again.

    JAX does the same before re-tracing a custom rule (`jvp_jaxpr_thunk`).
    """
    for store in fun.stores:
        if store is not None:
            store.reset()


mapped_aval = jex_core.mapped_aval
separate_consts = _pe.separate_consts


def merge_common_consts(jaxprs, all_consts):
    """Give branches (consts already turned into leading inputs) one shared const list.

    Returns the padded jaxprs (every branch takes every constant, in the same order)
    and the de-duplicated constants: what `lax.cond` itself does before binding.
    """
    from jax._src.lax.control_flow.common import _merge_common_consts

    return _merge_common_consts(jaxprs, all_consts)
