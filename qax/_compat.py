"""The one place that touches JAX internals.

Everything qax needs from `jax._src` or `jax.extend` is imported here, so that a JAX
upgrade is a change to this file alone. Written against JAX 0.10.x.
"""

from __future__ import annotations

import sys
import threading
import types
import weakref
from collections.abc import Callable

import jax
import jax.extend.core as jex_core
import numpy as np
from jax._src import ad_util as _ad_util
from jax._src import config as _config
from jax._src import core as _core
from jax._src import dtypes as _dtypes
from jax._src import linear_util as _lu
from jax._src import pjit as _pjit
from jax._src import source_info_util as _source_info
from jax._src import traceback_util as _traceback_util
from jax._src.array import ArrayImpl as ArrayImpl
from jax._src.interpreters import ad as _ad
from jax._src.interpreters import batching as _batching
from jax._src.interpreters import mlir as _mlir
from jax._src.interpreters import partial_eval as _pe
from jax._src.lax import lax as _lax_internal
from jax._src.lax.control_flow.common import _merge_common_consts
from jax._src.shard_map import shard_map_p as shard_map_p
from jax._src.sharding_impls import UNSPECIFIED as UNSPECIFIED
from jax._src.tree_util import FlatTree as FlatTree
from jax.sharding import NamedSharding as _NamedSharding
from jax.sharding import PartitionSpec as _P

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


def canonicalize_value(x):
    """`x` as a value a trace accepts (NumPy arrays and Python scalars canonicalized)."""
    if isinstance(x, Tracer):
        return x
    return _dtypes.canonicalize_value(x)


def eval_context():
    """Context in which binds execute eagerly, whatever trace is current."""
    return _core.eval_context()


def varying_axes(aval) -> frozenset:
    """The `shard_map` mesh axes that values of `aval` vary over (empty outside)."""
    manual = getattr(aval, "manual_axis_type", None)
    return manual.varying if manual is not None else frozenset()


def varying_aval(shape, dtype, reference, axes: frozenset) -> ShapedArray:
    """An aval of `shape`/`dtype` in `reference`'s `shard_map` context, varying over `axes`.

    (A bare `ShapedArray` has no mesh, so it cannot vary over mesh axes.)
    """
    manual = reference.manual_axis_type
    new = type(manual)(
        varying=frozenset(axes), unreduced=manual.unreduced, reduced=manual.reduced
    )
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


def share_jit_key(trace: Trace, parent: Trace) -> None:
    """Make `trace`, while current, key JAX's `jit` caches as `parent` does.

    JAX puts a weak reference to the current trace into the key of every `jit` cache
    (C++ dispatch, traced jaxprs): under any other trace than the eval trace, a call of
    a jitted function (every `jnp` function) misses the C++ fast path and is staged in
    Python. A trace that binds everything without an implicit operand to `parent`
    unchanged can take `parent`'s identity there: calls on plain arrays then hit what
    `parent` compiled. Calls with one of `trace`'s tracers as operand still miss (the
    fast path takes arrays only) and reach `trace`. A first call under `trace` must be
    made at top level instead (`run_jit_at_top_level`), or it marks the shared entry
    "stage in Python" for top-level calls too.
    """
    trace._weakref = parent._weakref


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
    """The value of a `jit` tracer that stands for a known constant, else None.

    Inside a traced function, a Python scalar that JAX promotes (``x * 2`` with a float
    ``x``) reaches other traces as a tracer of the staging trace, although its value is
    a literal; symbolic constants fold such operands.
    """
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
    """
    traceback = _source_info.current().traceback
    if traceback is None:
        return None
    codes, lastis = traceback.raw_frames()
    for code, lasti in zip(codes, lastis, strict=False):
        name = code.co_filename
        if _source_info.is_user_filename(name) and not skip(name):
            frame = _source_info.raw_frame_to_frame(code, lasti)
            return f"{frame.file_name}:{frame.start_line} ({frame.function_name})"
    return None


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


# -- used by the higher-order rules (`qax/_higher_order.py`) ------------------------------

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


# -- implicit arrays handed to JAX functions outside `use_implicit_args` -----------------

# The modules of `jax.numpy` that ask an argument for `__jax_array__`: its array-like check
# (every `jnp` function) and its array constructors (`jnp.asarray`, `jnp.array`). JAX's
# binary operators ask too, but must not get an answer (see `qax/_outside.py`).
JNP_ARRAYLIKE_CHECK = "jax._src.numpy.util"
JNP_CONSTRUCTORS = "jax._src.numpy.array_constructors"


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


# -- eager `jit` calls on plain arrays (the eager `ImplicitTrace`) ------------------------
#
# JAX's C++ `jit` dispatch keeps, per jitted function and call signature (argument types,
# shardings, and the `jit` key of the current trace), either a compiled call or a mark
# "stage in Python". It makes the entry on the first call, and a call made under any
# trace but the eval trace marks it "stage in Python" for good. The eager `ImplicitTrace`
# shares the eval trace's key (`share_jit_key`), so that calls on plain arrays under it
# reuse what top-level calls compiled; a first call under it would then mark the
# top-level entry too (about 10x slower plain JAX afterwards). `run_jit_at_top_level`
# replaces such a first call: it drops the function's entries (the one being made among
# them), makes the call again with the eval trace current, which stores the compiled
# call, and restores the function's other entries it made before by calling it with
# stand-in arguments of their signatures. Where that cannot work (see `_Made`), the call
# is left to JAX.


def _inner_code(fn, name: str) -> types.CodeType | None:
    """The code of the function `name` defined inside the function `fn`, if any."""
    code = getattr(fn, "__code__", None)
    consts = () if code is None else code.co_consts
    return next(
        (c for c in consts if isinstance(c, types.CodeType) and c.co_name == name), None
    )


# The frames `run_jit_at_top_level` looks for (JAX 0.10: a C++ `jit` miss calls
# `cache_miss`, which stages the call in `_run_python_pjit`). Other JAX versions: None,
# and the fast path is off (`tests/test_eager.py` then fails, pointing here).
_RUN_PYTHON_JIT = getattr(getattr(_pjit, "_run_python_pjit", None), "__code__", None)
_CACHE_MISS = _inner_code(getattr(_pjit, "_cpp_pjit", None), "cache_miss")
_MAX_SIGNATURES = 16  # signatures made per function, at most
_MAX_REPEATS = 3  # misses of signatures made before, after which qax stops
# Per jitted function (weakly, as JAX's C++ cache holds it) and `jit` options: what qax
# made at top level for it (`_Made`).
_made: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# Guards `_made` (never held while JAX runs a call: a call may wait for another
# thread's call of the same function to finish compiling).
_made_lock = threading.Lock()


class _Made:
    """The call signatures qax made at top level for one `jit` (key -> stand-in
    arguments), and how often one missed JAX's C++ cache again.

    A signature made at top level misses again when the `jit` object being called does
    not share the C++ cache that qax's dispatcher reaches (after `jax.clear_caches()`,
    `jit` objects made before keep a cache of their own), when JAX's cache evicted it,
    or when calls alternate between JAX configurations (`jax.default_matmul_precision`,
    ...; a stand-in call restores the entry of the current one): after `_MAX_REPEATS`
    such misses, qax leaves the `jit` to JAX (`off`), as without this fast path (a
    signature first called under the eager trace then stays "stage in Python" at top
    level too).
    """

    __slots__ = ("signatures", "repeats", "off")

    def __init__(self):
        self.signatures: dict = {}
        self.repeats = 0
        self.off = False

    @staticmethod
    def of(fun, info) -> _Made | None:
        """None if `fun` is not weakly referable (JAX's C++ cache of its `jit` is then
        private to that `jit` object, which qax cannot reach)."""
        options = _jit_options(info)
        with _made_lock:
            try:
                per_options = _made.setdefault(fun, {})
            except TypeError:
                return None
            made = per_options.get(options)
            if made is None:
                made = per_options[options] = _Made()
            return made

    def missed(self, key) -> bool:
        """Count a C++ miss of `key`; whether qax still makes calls of this `jit`.

        A signature without stand-ins (`key` None) counts as a repeat: its entry is not
        restored when another signature's first call drops the function's entries. A
        `jit` called with more than `_MAX_SIGNATURES` signatures is left to JAX: their
        entries could not all be restored, and would drop each other for good.
        """
        with _made_lock:
            new = key is not None and key not in self.signatures
            if not new:
                self.repeats += 1
            if new and len(self.signatures) >= _MAX_SIGNATURES:
                self.off = True
            self.off = self.off or self.repeats > _MAX_REPEATS
            return not self.off

    def restore(self, dispatch, keep) -> None:
        """Make the C++ entries of the signatures made before again (but `keep`'s)."""
        with _made_lock:
            made = [item for item in self.signatures.items() if item[0] != keep]
        for key, stand_in in made:
            try:
                args, kwargs = stand_in()
                dispatch(*args, **kwargs)
            except Exception:  # noqa: BLE001 (only a fast path is lost)
                with _made_lock:
                    self.signatures.pop(key, None)

    def remember(self, signature) -> None:
        if signature is not None:
            key, stand_in = signature
            with _made_lock:
                self.signatures[key] = stand_in


def run_jit_at_top_level(args_flat: list):
    """Make the `jit` call whose bind reached the current trace with `args_flat` at top
    level, storing it in JAX's C++ dispatch cache; its flat outputs, or None.

    None (bind as usual) unless the frames are those of a C++ `jit` call whose staged
    operands are `args_flat` and the call can be made again at top level: no effects
    (a stand-in call must not print or call back), no NaN/Inf/key-reuse checks, and
    qax has not left the `jit` to JAX (`_Made`).
    """
    if _RUN_PYTHON_JIT is None or _CACHE_MISS is None:
        return None
    # run_jit_at_top_level <- process_primitive <- bind_with_trace <- bind
    # <- _run_python_pjit <- cache_miss
    frame = sys._getframe(4)
    if frame.f_code is not _RUN_PYTHON_JIT:
        return None
    caller = frame.f_back
    if caller is None or caller.f_code is not _CACHE_MISS:
        return None
    staged = frame.f_locals
    bound, p = staged.get("args_flat"), staged.get("p")
    if bound is None or p is None or len(bound) != len(args_flat):
        return None
    for staged_arg, arg in zip(bound, args_flat, strict=True):
        # (`bind` turns Python scalars and NumPy values into new objects)
        if staged_arg is not arg and isinstance(staged_arg, ArrayImpl | Tracer):
            return None
    info = caller.f_locals.get("jit_info")
    if info is None or p.params["jaxpr"].effects:
        return None
    if _config.debug_nans.value or _config.debug_infs.value:
        return None
    if _config.debug_key_reuse.value:
        return None
    fun, args, kwargs = staged["fun"], staged["args"], staged["kwargs"]
    del frame, caller, staged, bound
    made = _Made.of(fun, info)
    if made is None or made.off:
        return None
    signature = _stand_in_call(info, args, kwargs)
    key = None if signature is None else signature[0]
    if not made.missed(key):
        return None
    with _core.take_current_trace():
        if not _core.trace_state_clean():
            return None
        dispatch = _pjit._cpp_pjit(fun, info)  # shares the C++ cache of `fun`'s `jit`s
        # Drops the entry C++ is making for this call (it would stay "stage in
        # Python"), and the function's others: the calls below make them again.
        dispatch._clear_cache()
        outs = dispatch(*args, **kwargs)
        made.restore(dispatch, keep=key)
        made.remember(signature)
    return p.out_tree.flatten_up_to(outs)


def _jit_options(info) -> tuple:
    """The options of a `jit` (JAX's `PjitInfo`) that key its C++ cache, with the function
    (some `jnp` functions, such as `jnp.einsum`, make a new `jit` of one function on every
    call: their signatures share one C++ cache)."""
    key = tuple(
        getattr(info, name) for name in info._fields if name not in _UNKEYED_INFO
    )
    try:
        hash(key)
    except TypeError:  # (JAX's `PjitInfo` itself hashes by identity)
        return (info,)
    return key


# Fields of JAX's `PjitInfo` that describe the function rather than key its cache.
_UNKEYED_INFO = frozenset({"fun_sourceinfo", "fun_signature"})
_SCALARS = (bool, int, float, complex)


def _leaf_kind(x):
    """What the C++ signature of a call records of an argument leaf `x` (None: a kind
    of leaf no stand-in is made for)."""
    if type(x) is ArrayImpl:
        if _dtypes.issubdtype(x.dtype, _dtypes.extended):
            return None
        return ("array", x.shape, x.dtype, x.weak_type, x.sharding, x._committed)
    if type(x) in _SCALARS:
        return ("scalar", type(x))
    if isinstance(x, np.generic | np.ndarray):
        return ("numpy", type(x), np.shape(x), x.dtype)
    return None


def _zeros_of_kind(kind, x):
    """A leaf of `kind` holding zeros (`x`, when it is a Python scalar)."""
    if kind[0] == "scalar":
        return x
    if kind[0] == "numpy":
        _, cls, shape, dtype = kind
        return dtype.type(0) if issubclass(cls, np.generic) else np.zeros(shape, dtype)
    _, shape, dtype, weak_type, sharding, committed = kind
    zero = _lax_internal._convert_element_type(
        np.zeros((), dtype), dtype, weak_type=weak_type
    )
    zeros = _lax_internal.broadcast(zero, shape)
    return jax.device_put(zeros, sharding) if committed else zeros


def _stand_in_call(info, args, kwargs):
    """`(key, stand_in)` for a call of the `jit` with `info`: a hashable key of the
    call's C++ signature and a function giving `(args, kwargs)` of that signature
    holding zeros. None if some argument is of a kind no stand-in is made for."""
    static, names = info.static_argnums, info.static_argnames
    dynamic = (
        [a for i, a in enumerate(args) if i not in static],
        {k: v for k, v in kwargs.items() if k not in names},
    )
    static_args = {i: a for i, a in enumerate(args) if i in static}
    static_kwargs = {k: v for k, v in kwargs.items() if k in names}
    leaves, treedef = jax.tree_util.tree_flatten(dynamic)
    kinds = tuple(map(_leaf_kind, leaves))
    if any(kind is None for kind in kinds):
        return None
    key = (len(args), tuple(static_args.items()), tuple(sorted(static_kwargs.items())))
    key = (*key, treedef, kinds)
    try:
        hash(key)
    except TypeError:
        return None
    scalars = [x if kind[0] == "scalar" else None for x, kind in zip(leaves, kinds)]
    count = len(args)  # (the stand-in keeps no argument array alive)

    def stand_in():
        values = [_zeros_of_kind(k, x) for k, x in zip(kinds, scalars, strict=True)]
        dyn_args, dyn_kwargs = jax.tree_util.tree_unflatten(treedef, values)
        dyn_args = iter(dyn_args)
        full = [
            static_args[i] if i in static_args else next(dyn_args) for i in range(count)
        ]
        return full, {**static_kwargs, **dyn_kwargs}

    return key, stand_in
