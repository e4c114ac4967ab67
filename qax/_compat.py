"""The one place that touches JAX internals.

Everything qax needs from `jax._src` or `jax.extend`, from JAX's frames, and the
parameter layouts of the primitives its rules read (`PARAM_LAYOUTS`) is reached here, so
that a JAX upgrade is a change to this file alone. Supports JAX 0.10.2 to 0.12.x;
differences between versions are found by feature (an attribute, a parameter name),
never by version number. `tests/test_compat.py` checks every item on the installed JAX
and names the function here to fix when one is gone.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable

import jax
import jax.extend.core as jex_core
from jax._src import ad_util as _ad_util
from jax._src import config as _config
from jax._src import core as _core
from jax._src import dtypes as _dtypes
from jax._src import linear_util as _lu
from jax._src import source_info_util as _source_info
from jax._src import traceback_util as _traceback_util
from jax._src.array import ArrayImpl as ArrayImpl
from jax._src.interpreters import ad as _ad
from jax._src.interpreters import batching as _batching
from jax._src.interpreters import mlir as _mlir
from jax._src.interpreters import partial_eval as _pe
from jax._src.lax import parallel as _parallel
from jax._src.lax.control_flow.common import _merge_common_consts
from jax._src.lax.lax import ragged_dot_general_p as ragged_dot_general_p
from jax._src.lib.mlir.dialects import sdy as _sdy
from jax._src.shard_map import shard_map_p as shard_map_p
from jax._src.sharding_impls import UNSPECIFIED as UNSPECIFIED
from jax.sharding import NamedSharding as _NamedSharding
from jax.sharding import PartitionSpec as _P

try:  # JAX >= 0.11
    from jax._src import flattree as _flattree

    flatten_ft = _flattree.flatten
except ImportError:  # JAX 0.10
    from jax._src.tree_util import FlatTree as _FlatTree

    flatten_ft = _FlatTree.flatten

Trace = _core.Trace
Tracer = _core.Tracer
ShapedArray = _core.ShapedArray
TraceTag = jex_core.TraceTag
Primitive = jex_core.Primitive
ClosedJaxpr = jex_core.ClosedJaxpr
Jaxpr = jex_core.Jaxpr
DebugInfo = jex_core.DebugInfo
set_current_trace = jex_core.set_current_trace
jaxpr_as_fun = jex_core.jaxpr_as_fun
eval_jaxpr = _core.eval_jaxpr
ensure_no_leaks = _core.ensure_no_leaks
EvalTrace = _core.EvalTrace
typeof = jax.typeof
primitives_module = jex_core.primitives
# Primitives that neither `jax.lax` nor `primitives_module` names as ``<name>_p``, so
# that `qax.primitive_handler` finds them by name (``"ragged_dot_general"``: the
# primitive of `jax.lax.ragged_dot` and `jax.lax.ragged_dot_general`).
unlisted_primitives = (ragged_dot_general_p,)

trace_to_jaxpr_dynamic = _pe.trace_to_jaxpr_dynamic
convert_constvars_jaxpr = _pe.convert_constvars_jaxpr
wrap_init = _lu.wrap_init


def init_tracer(tracer: Tracer, trace: Trace, aval) -> None:
    """Initialize a new tracer of a `Tracer` subclass (JAX's constructor)."""
    Tracer.__init__(tracer, trace, aval)


def canonicalize_value(x):
    """`x` as a value a trace accepts (NumPy arrays and Python scalars canonicalized)."""
    if isinstance(x, Tracer):
        return x
    return _dtypes.canonicalize_value(x)


def jaxpr_as_function(closed: ClosedJaxpr) -> Callable:
    """A closed jaxpr (a `cond` branch, a `jit` body in a handler's parameters) as a
    function of its inputs that returns the list of its outputs."""
    return jaxpr_as_fun(closed)


def eval_context():
    """A context in which primitives run eagerly on concrete values, whatever trace is
    current (also inside a handler traced under `jax.jit`): for handlers that fold
    constants known at trace time (`qax.symbols`).

    Examples:
        >>> with qax.utils.eval_context():
        ...     folded = lax.add(np.float32(1), np.float32(2))  # a concrete array
    """
    return _core.eval_context()


def varying_axes(aval) -> frozenset:
    """The `shard_map` mesh axes that values of `aval` vary over (empty outside)."""
    manual = getattr(aval, "manual_axis_type", None)
    return manual.varying if manual is not None else frozenset()


def insert_collective_pvary(axes: tuple, x):
    """`x`, made to vary over `axes` where it does not (as JAX's collectives do to their
    operands inside `shard_map`); `x` itself without varying-axes checks."""
    return _parallel.insert_collective_pvary(axes, x)


def tracks_varying_axes() -> bool:
    """Whether the `shard_map` being traced checks which axes values vary over
    (``check_vma=True``, JAX's default); without it every value looks invariant."""
    return bool(_config._check_vma.value)


def varying_aval(shape, dtype, reference, axes: frozenset) -> ShapedArray:
    """An aval of `shape`/`dtype` in `reference`'s `shard_map` context, varying over `axes`.

    (A bare `ShapedArray` has no mesh, so it cannot vary over mesh axes.)
    """
    manual = reference.manual_axis_type
    kept = {"unreduced": manual.unreduced, "reduced": manual.reduced}
    if hasattr(manual, "unreduced_kind"):  # JAX >= 0.11
        kept["unreduced_kind"] = manual.unreduced_kind
    new = type(manual)(varying=frozenset(axes), **kept)
    sharding = _NamedSharding(reference.sharding.mesh, _P())
    return reference.update(
        shape=shape,
        dtype=dtype,
        weak_type=False,
        sharding=sharding,
        manual_axis_type=new,
    )


def jit_context() -> tuple:
    """The configuration that JAX's caches of staged `jit` functions are keyed on."""
    return _config.trace_context()


def current_trace() -> Trace:
    """The trace that a `bind` right now would go to."""
    return _core.trace_ctx.trace


def is_eval_trace(trace: Trace) -> bool:
    return isinstance(trace, EvalTrace)


_STAGING_TRACES = (_pe.DynamicJaxprTrace, _pe.JaxprTrace)
_DIFFERENTIATING_TRACES = (_ad.JVPTrace, _ad.LinearizeTrace)


def _below(trace: Trace, kinds: tuple) -> bool:
    while not isinstance(trace, EvalTrace):
        if isinstance(trace, kinds):
            return True
        trace = getattr(trace, "parent_trace", None)
        if trace is None:  # a trace of an unknown kind: assume the worst
            return True
    return False


def may_stage(trace: Trace) -> bool:
    """Whether `trace`, or a trace below it, records operations into a jaxpr.

    JAX may differentiate a recorded program later (`jax.grad` of a `jax.jit`ted
    function). A trace of an unknown kind (one without `parent_trace`) counts as one.
    """
    return _below(trace, _STAGING_TRACES)


def may_run_rules_later(trace: Trace) -> bool:
    """Whether custom derivative rules bound on `trace` may run after the bind returns:
    in a backward pass, or from a recorded program."""
    return _below(trace, _STAGING_TRACES + _DIFFERENTIATING_TRACES)


def bind_canonical(trace: Trace, primitive: Primitive, args, params):
    """Bind `primitive` on `trace` with `args` that `bind` already canonicalized."""
    return primitive.bind_with_trace(trace, args, tuple(map(typeof, args)), params)


def bind_with_trace(trace: Trace, primitive: Primitive, args, params):
    """Bind `primitive` on `trace`, canonicalizing non-tracer `args` as `bind` does.

    (NumPy arrays reach here as leaves of implicit arrays built inside handlers;
    staging traces reject non-canonical constants.)
    """
    args = [a if isinstance(a, Tracer) else _dtypes.canonicalize_value(a) for a in args]
    return primitive.bind_with_trace(trace, args, tuple(map(typeof, args)), params)


def known_constant(x):
    """The value of `x` if it is known while tracing, else None: `x` itself when it is
    concrete (an array, a NumPy or Python scalar), the literal a `jit` tracer stands
    for, None for other tracers.

    Inside a traced function, a Python scalar that JAX promotes (``x * 2`` with a float
    ``x``) reaches other traces as a tracer of the staging trace, although its value is
    a literal; handlers that fold constants (`qax.symbols`) read it with this.
    """
    if not isinstance(x, Tracer):
        return x
    if isinstance(x, _pe.DynamicJaxprTracer):
        try:
            return x.get_const()
        except Exception:  # noqa: BLE001 (no constant: an ordinary tracer)
            return None
    return None


# The functions that run a backward pass (transposition): `jax.vjp`, `jax.grad`,
# `jax.linear_transpose` and the transpose rules of control flow all go through them.
_BACKWARD_PASS_CODE = frozenset(
    fn.__code__
    for fn in (getattr(_ad, name, None) for name in ("backward_pass3", "backward_pass"))
    if hasattr(fn, "__code__")
)


def in_backward_pass() -> bool:
    """Whether JAX is running a backward (transpose) pass right now.

    The name stack carries a `transpose` transform there, but re-traced bodies (jit) reset
    it; the Python call stack still holds the frame of `ad.backward_pass3` then.
    """
    for entry in _source_info.current_name_stack().stack:
        if isinstance(entry, _source_info.Transform) and entry.name == "transpose":
            return True
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in _BACKWARD_PASS_CODE:
            return True
        frame = frame.f_back
    return False


def traced_source_line(skip: Callable[[str], bool]) -> str | None:
    """`file:line (function)` of the innermost user frame (outside JAX, and not a file
    for which `skip(filename)` is true) of the traceback JAX attached to what it
    evaluates now, if any.

    In a backward pass that is the traceback of the forward operation being transposed.
    The operations of a `jnp` function are recorded with tracebacks that end in the
    function (JAX > 0.10): then the equations that the enclosing backward passes are
    transposing (found in their frames) are tried, innermost first.
    """
    for traceback in _tracebacks_now():
        codes, lastis = traceback.raw_frames()
        for code, lasti in zip(codes, lastis, strict=False):
            name = code.co_filename
            if _source_info.is_user_filename(name) and not skip(name):
                frame = _source_info.raw_frame_to_frame(code, lasti)
                return f"{frame.file_name}:{frame.start_line} ({frame.function_name})"
    return None


def _tracebacks_now():
    traceback = _source_info.current().traceback
    if traceback is not None:
        yield traceback
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code in _BACKWARD_PASS_CODE:
            source_info = getattr(frame.f_locals.get("eqn"), "source_info", None)
            traceback = getattr(source_info, "traceback", None)
            if traceback is not None:
                yield traceback
        frame = frame.f_back


def forget_arg_names(debug_info: DebugInfo | None) -> DebugInfo | None:
    """`debug_info` without argument names (for a function that now takes leaves)."""
    return None if debug_info is None else debug_info.with_unknown_names()


def make_debug_info(name: str) -> DebugInfo:
    return DebugInfo("qax", name, None, None)


# -- defining a primitive (`implicit_p` in `qax/_interpreter.py`) -------------------------

primitive_jvps = _ad.primitive_jvps
primitive_batchers = _batching.primitive_batchers
instantiate_zeros = _ad.instantiate_zeros


def register_lowering_fun(primitive: Primitive, fn) -> None:
    """Compile `primitive` as the JAX function `fn` of its operands."""
    _mlir.register_lowering(
        primitive, _mlir.lower_fun(fn, multiple_results=primitive.multiple_results)
    )


def register_lowering(primitive: Primitive, rule: Callable) -> None:
    """Compile `primitive` with `rule(ctx, *operands)` (MLIR values in, out)."""
    _mlir.register_lowering(primitive, rule)


def propagation_barrier(x):
    """MLIR: `x` behind a Shardy barrier that sharding propagation crosses in neither
    direction (`x` itself under the GSPMD partitioner)."""
    if not _config.use_shardy_partitioner.value:
        return x
    return _sdy.propagation_barrier(x, _sdy.PropagationDirection.NONE)


# -- used by the structural rules (`qax/_rules/`) -----------------------------------------

pvary_p = getattr(_core, "pvary_p", None)
Zero = _ad_util.Zero
SymbolicZero = _ad_util.SymbolicZero


def transformation2(gen, fun, *static_args):
    """`fun` (a `WrappedFun`) with one more transformation: `gen(f, *static_args, *args)`.

    The result shares `fun`'s output stores, so JAX can reset them before a re-trace.
    Its argument names are forgotten: the transformation may change their number.
    """
    return _lu.transformation2(gen)(fun, *static_args).with_unknown_names()


mapped_aval = jex_core.mapped_aval
separate_consts = _pe.separate_consts


def merge_common_consts(jaxprs, all_consts):
    """Give branches (consts already turned into leading inputs) one shared const list.

    Returns the padded jaxprs (every branch takes every constant, in the same order)
    and the de-duplicated constants: what `lax.cond` itself does before binding.
    """
    return _merge_common_consts(jaxprs, all_consts)


def register_vmappable(cls: type, to_elt, from_elt) -> None:
    """Make `jax.vmap` treat instances of `cls` as one value, batched by these rules.

    `to_elt(cont, get_idx, x, axis)` gives the per-example value of `x` mapped along
    `axis` (`cont(y, axis)` maps a part `y` of it); `from_elt(cont, axis_size, x, axis)`
    gives the batched value of a per-example output (`cont(axis_size, y, axis)` stacks a
    part). `jax.vmap` flattens its arguments and results with these types as leaves.
    """
    _batching.register_vmappable(cls, int, int, to_elt, from_elt, None)


# -- implicit arrays handed to `Primitive.bind` directly ------------------------------


def register_bind_converter(cls: type, convert: Callable[[object], object]) -> None:
    """Have `Primitive.bind` (every `lax` function) pass instances of `cls` (and of its
    subclasses) through `convert` before it reads their abstract value.

    JAX calls it on each operand it does not know (`dtypes.canonicalize_value`), with
    the caller's trace current; `convert` returns a value JAX can take (a tracer).
    """
    _dtypes.register_canonicalize_value_handler(cls, convert)


# -- implicit arrays handed to JAX functions outside `use_implicit_args` -----------------

# The modules of `jax.numpy` that ask an argument for `__jax_array__`: its array-like check
# (every `jnp` function) and its array constructors (`jnp.asarray`, `jnp.array`). JAX's
# binary operators ask too, but must not get an answer (see `qax/_outside.py`).
_JNP_ARRAYLIKE_CHECK = "jax._src.numpy.util"
_JNP_CONSTRUCTORS = "jax._src.numpy.array_constructors"
_JNP_OPERATORS = "jax._src.numpy.array_methods"


def jax_array_asker(depth: int) -> tuple[str | None, str | None]:
    """Which part of JAX reads `__jax_array__` from the frame `depth` levels above the
    caller: ``("constructor", None)`` for `jnp.asarray`/`jnp.array`, ``("check", name)``
    for the array-like check of the `jnp` function `name` (None if not found), else
    ``(None, None)``: JAX's binary operators, or a JAX that moved these modules.
    """
    frame = sys._getframe(depth + 1)
    module = frame.f_globals.get("__name__")
    if module == _JNP_CONSTRUCTORS:
        return "constructor", None
    if module == _JNP_OPERATORS:
        return "operator", None
    if module != _JNP_ARRAYLIKE_CHECK:
        return None, None
    for _ in range(4):  # the `fun_name` that the check was given, e.g. "sin"
        if frame is None:
            break
        name = frame.f_locals.get("fun_name")
        if isinstance(name, str):
            return "check", name
        frame = frame.f_back
    return "check", None


# -- tracebacks -------------------------------------------------------------------------

api_boundary = _traceback_util.api_boundary


def hide_frames_of(path: str) -> None:
    """Leave the frames of files under `path` out of the tracebacks JAX filters (as JAX
    leaves out its own), so that the user's lines stand out."""
    _traceback_util.register_exclusion(path)


def is_stack_before_transformation(e: BaseException | None) -> bool:
    """Whether `e` is the copy of the user's stack that JAX chains to an error raised
    while it re-evaluated a traced operation."""
    return isinstance(e, _source_info.JaxStackTraceBeforeTransformation)


def forget_export_serialization(nodetype: type, serialized_name: str) -> None:
    """Drop `jax.export`'s serialization entries for `nodetype` and `serialized_name`.

    `jax.export.register_pytree_node_serialization` refuses a second registration; a
    class defined again under the same name (a re-run notebook cell) replaces the old
    one instead.
    """
    from jax._src.export import _export

    entry = _export.deserialization_registry.pop(serialized_name, None)
    if entry is not None:
        _export.serialization_registry.pop(entry[0], None)
    _export.serialization_registry.pop(nodetype, None)


# -- parameter layouts of primitives whose rules rebind them ------------------------------
#
# The parameters that qax's rules read or set, per primitive (`qax/_rules/`,
# `qax/_interpreter.py`). `tests/test_compat.py` checks each on the installed JAX; where
# versions differ, the functions below read them.

PARAM_LAYOUTS: dict[str, frozenset] = {
    "jit": frozenset(
        {
            "jaxpr",
            "name",
            "inline",
            "donated_invars",
            "in_shardings",
            "out_shardings",
            "in_layouts",
            "out_layouts",
            "ctx_mesh",
            "keep_unused",
            "compiler_options_kvs",
        }
    ),
    "cond": frozenset({"branches"}),
    "scan": frozenset({"jaxpr", "length"}),
    "while": frozenset({"cond_jaxpr", "body_jaxpr", "cond_nconsts", "body_nconsts"}),
    "remat2": frozenset({"jaxpr", "prevent_cse"}),
    "shard_map": frozenset({"mesh", "in_specs"}),
    "sharding_constraint": frozenset({"sharding", "layout"}),
    "device_put": frozenset({"devices", "srcs", "copy_semantics"}),
}


def weakly_typed(x):
    """`x` (a strongly typed value), weakly typed: as a body traced for a weak input
    sees it."""
    return jax.lax.convert_element_type_p.bind(
        x, new_dtype=typeof(x).dtype, weak_type=True, sharding=None
    )


_INLINE = getattr(jax, "Inline", None)  # JAX >= 0.11: `jit(inline=...)` is an enum
_INLINED = (True,) if _INLINE is None else (True, _INLINE.JAX_EARLY, _INLINE.JAX_LATE)


def is_inline_jit(params: dict) -> bool:
    """Whether a `jit` bind is of a function jitted with ``inline=True`` (every `jnp`
    function), which JAX inlines into an enclosing program.

    JAX 0.10 keeps the flag as a bool; later versions as `jax.Inline`, whose members
    are all truthy.
    """
    return params.get("inline", False) in _INLINED


def jit_params_are_default(params: dict) -> bool:
    """Whether a `jit` bind asks for nothing that a plain `jax.jit` of its jaxpr would
    lose: no effects, shardings, layouts, donation, mesh or compiler options."""
    closed = params["jaxpr"]
    return (
        not closed.effects  # ordered effects, refs: JAX's own path
        and not getattr(closed.jaxpr, "is_high", False)
        and all(s is UNSPECIFIED for s in params["in_shardings"])
        and all(s is UNSPECIFIED for s in params["out_shardings"])
        and all(layout is None for layout in params["in_layouts"])
        and all(layout is None for layout in params["out_layouts"])
        and not any(params["donated_invars"])
        and params["ctx_mesh"].empty
        and not params["compiler_options_kvs"]
    )


def scan_operand_counts(params: dict) -> tuple[int, int]:
    """The numbers of constants and carries among the operands of a `scan` bind.

    JAX 0.10 keeps them as `num_consts`/`num_carry`; later versions as a `FlatTree`
    `ft_in` of (constants, carries, xs).
    """
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


def scan_params(params: dict, jaxpr, counts: tuple[int, int, int, int]) -> dict:
    """`params` of a `scan` bind, for the body `jaxpr` over (constants, carries, xs)
    and giving (carries, ys), with `counts` = the numbers of each.

    (Re-binding through `lax.scan` would trace the body once more: measured 1.28x the
    tracing of hand-written LoRA for a layer-stacked train step, instead of 1.05x.)
    """
    n_consts, n_carry, n_xs, n_ys = counts
    if "num_consts" in params:
        return dict(params, jaxpr=jaxpr, num_consts=n_consts, num_carry=n_carry)
    ft = _flattree
    return dict(
        params,
        jaxpr=jaxpr,
        ft_in=ft.pack((ft.nones(n_consts), ft.nones(n_carry), ft.nones(n_xs))),
        ft_out=ft.pack((ft.nones(n_carry), ft.nones(n_ys))),
    )


# JAX > 0.11: a `custom_vjp` backward rule, flattened, returns its cotangents and the
# logs of `defvjp_with_logs` as a pair.
BWD_RETURNS_LOGS = hasattr(jax.custom_vjp, "defvjp_with_logs")


def split_bwd_result(result) -> tuple:
    """`(cotangents, logs)` of what a flattened `custom_vjp` backward rule returned."""
    if BWD_RETURNS_LOGS:
        cts, logs = result
        return cts, logs
    return result, None


def join_bwd_result(cts: list, logs):
    """What a flattened `custom_vjp` backward rule returns, given its parts."""
    return (cts, logs) if BWD_RETURNS_LOGS else cts


# JAX > 0.11 removed the call primitives: `call_p` and `closed_call_p` are aliases of
# `eval_jaxpr_p`, an ordinary primitive with a `call_jaxpr` parameter (`CALL_JAXPR_P`);
# before, they are call primitives handed a function (`CALL_PRIMITIVES`).
CALL_JAXPR_P = getattr(_core, "eval_jaxpr_p", None)
CALL_PRIMITIVES = tuple(
    {
        p
        for p in (jex_core.primitives.call_p, jex_core.primitives.closed_call_p)
        if p is not CALL_JAXPR_P
    }
)


def frame_variable(frame: types.FrameType, name: str) -> object:
    """The local or closure variable `name` of the Python `frame`, or None.

    For what another library's function was called with where it offers no public way
    to ask (`qax.nnx` reads ``allow_int`` of Flax's `nnx.grad` wrapper, for an error
    message only); `tests/test_compat.py` checks that closure variables are readable.
    """
    return frame.f_locals.get(name)
