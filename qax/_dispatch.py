"""The handler registry: one plum `Function` per primitive, and the dispatch cache.

`primitive_handler` registers user functions; the interpreter asks `lookup(primitive,
types)` which handler applies to a combination of operand types. The answer is cached per
(primitive, types) until the next registration: we cache *which* handler applies, never
what it returned.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any, Union

import jax
import plum

from . import _errors
from ._base import ImplicitBase
from ._compat import Primitive, primitives_module, unlisted_primitives

ArrayValue = Union[jax.Array, ImplicitBase]  # noqa: UP007 (plum needs a typing.Union)
"""Annotation for "a JAX array or an implicit array" in handler signatures."""

# Names that are not `jax.lax.<name>_p` but that users (and the original Qax) use.
_ALIASES = {"pjit": "jit", "checkpoint": "remat"}
# `jnp` operations whose primitive has another name: what "did you mean" suggests first.
_HINTS = {
    "matmul": "dot_general",
    "dot": "dot_general",
    "einsum": "dot_general",
    "tensordot": "dot_general",
    "multiply": "mul",
    "subtract": "sub",
    "divide": "div",
    "power": "pow",
    "getitem": "gather",
    "take": "gather",
    "where": "select_n",
    "maximum": "max",
    "minimum": "min",
    "astype": "convert_element_type",
}

_functions: dict[Primitive, plum.Function] = {}
_cache: dict[tuple, Callable | None] = {}
# Bumped by every registration: caches of re-traced bodies include it in their keys.
generation = [0]


@functools.cache
def _known_primitives() -> dict[str, Primitive]:
    """The primitives JAX names (`primitives_module` and `unlisted_primitives` too),
    by the name of their attribute (``add`` for `add_p`) and by their own name
    (``remat2`` for `remat_p`, ``ragged_dot_general``)."""
    by_attribute: dict[str, Primitive] = {}
    for namespace in (jax.lax, primitives_module):  # `jax.lax` first
        for attr in dir(namespace):
            value = getattr(namespace, attr, None)
            if attr.endswith("_p") and isinstance(value, Primitive):
                by_attribute.setdefault(attr[:-2], value)
    for value in unlisted_primitives:
        by_attribute.setdefault(value.name, value)
    by_name = {p.name: p for p in by_attribute.values()}
    return {**by_name, **by_attribute}  # an attribute's name wins


def _all_primitive_names() -> list[str]:
    return sorted(set(_known_primitives()) | set(_ALIASES))


def resolve_primitive(primitive: str | Primitive) -> Primitive:
    """The `Primitive` object for a name (``"add"`` -> `jax.lax.add_p`) or a primitive."""
    if isinstance(primitive, Primitive):
        return primitive
    if not isinstance(primitive, str):
        raise TypeError(
            "A primitive must be given as a name (e.g. 'dot_general') or a "
            f"JAX `Primitive` object (e.g. `jax.lax.dot_general_p`), got "
            f"{type(primitive).__name__}: {primitive!r}."
        )
    found = _known_primitives().get(_ALIASES.get(primitive, primitive))
    if found is not None:
        return found
    close = difflib.get_close_matches(primitive, _all_primitive_names(), n=3)
    hint = _HINTS.get(primitive)
    if hint is not None:
        close = [hint, *(c for c in close if c != hint)][:3]
    suggestion = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    raise ValueError(
        _errors.UNKNOWN_PRIMITIVE.format(name=primitive, suggestion=suggestion)
    )


def _function_for(primitive: Primitive) -> plum.Function:
    function = _functions.get(primitive)
    if function is None:

        def handler() -> None: ...

        handler.__name__ = handler.__qualname__ = f"{primitive.name}_handler"
        function = _functions[primitive] = plum.Function(handler)
    return function


def primitive_handler(
    primitives: str | Primitive | Iterable[str | Primitive], precedence: int = 0
) -> Callable[[Callable], Callable]:
    """Register a handler for one or more primitives.

    The handler is called as ``handler(primitive, *operands, **params)`` whenever the
    annotated types of the operands match (multiple dispatch over *all* positional
    arguments, via plum). Operands that are not implicit arrays dispatch as `jax.Array`.
    Return `NotImplemented` to fall back to the default rule.

    Examples:
        >>> @qax.primitive_handler("mul")
        ... def mul(primitive, a: Zeros, b: jax.Array):
        ...     return Zeros(shape=jnp.broadcast_shapes(a.shape, b.shape), dtype=a.dtype)

    Args:
      primitives: a primitive name (looked up as ``jax.lax.<name>_p``, then
        among JAX's other primitives, then by the primitive's own name, as in
        ``"remat2"``; ``"pjit"`` and ``"checkpoint"`` name `jit` and `checkpoint`), a
        `Primitive`, or a list of either.
      precedence: breaks ties between equally specific handlers (higher wins).

    Returns:
      A decorator that registers the function and returns it unchanged.

    Raises:
      ValueError: for an unknown primitive name (close names are suggested).
    """
    if isinstance(primitives, (str, Primitive)) or not isinstance(primitives, Iterable):
        primitives = [primitives]
    resolved = [resolve_primitive(p) for p in primitives]

    def decorator(fn: Callable) -> Callable:
        for primitive in resolved:
            _function_for(primitive).register(fn, precedence=precedence)
        _cache.clear()
        generation[0] += 1
        return fn

    return decorator


class Declined:
    """What `decline` returns: a handler passing, with the reason (see `decline`)."""

    __slots__ = ("reason",)

    def __init__(self, reason: str):
        self.reason = reason

    def __repr__(self) -> str:
        return f"qax.decline({self.reason!r})"


def decline(reason: str) -> Declined:
    """What a handler returns to pass, as `NotImplemented` does, saying why.

    qax then falls back as for `NotImplemented` (the class's `default_handler`, or
    materializing the operands); a materialization that follows shows ``reason``
    instead of the standard "was not handled" text, in the `MaterializationWarning`
    and in a `MaterializationError`. Use it where a handler covers some cases of a
    primitive and the user can do something about the others.

    Examples:
        >>> @qax.primitive_handler("slice")
        ... def slice_blocks(primitive, w: Blocked, **params):
        ...     if params["start_indices"][-1] % w.block_size:
        ...         return qax.decline(
        ...             "Blocked: a slice that cuts a block decodes the weight; "
        ...             "slice on multiples of block_size."
        ...         )
        ...     ...

    Args:
      reason: what the handler could not do and what the user can do instead.

    Returns:
      A marker for the interpreter; return it from the handler.
    """
    return Declined(str(reason))


_accepted: dict[Callable, frozenset[str] | None] = {}


def params_for(handler: Callable, primitive: Primitive, params: dict) -> dict:
    """The primitive's params that `handler` accepts as keywords.

    Handlers written without ``**params`` (as in the original Qax docs) still work when
    JAX adds a parameter to a primitive, as long as the new parameter is unset (None).
    """
    try:
        accepted = _accepted[handler]
    except KeyError:
        accepted = _accepted[handler] = _keyword_names(handler)
    if accepted is None:
        return params
    kept = {}
    for name, value in params.items():
        if name in accepted:
            kept[name] = value
        elif value is not None:
            raise _errors.HandlerError(
                f"Handler {describe_handler(handler)} for primitive `{primitive.name}` "
                f"does not accept the parameter `{name}={value!r}`. Add `**params` to "
                "its signature to receive every parameter."
            )
    return kept


def _keyword_names(fn: Callable) -> frozenset[str] | None:
    """Names `fn` accepts as keywords, or None if it takes ``**kwargs``."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    return frozenset(
        p.name
        for p in parameters
        if p.kind
        in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    )


def dispatch_type(x: Any) -> type:
    return type(x) if isinstance(x, ImplicitBase) else jax.Array


def lookup(primitive: Primitive, types: tuple[type, ...]) -> Callable | None:
    """The handler for `primitive` on operands of `types` (already `dispatch_type`d)."""
    key = (primitive, types)
    try:
        return _cache[key]
    except KeyError:
        pass
    function = _functions.get(primitive)
    handler = None
    if function is not None:
        signature = plum.Signature(type(primitive), *types)
        try:
            handler, _ = function.resolve_method(signature)
        except plum.NotFoundLookupError:
            handler = None
        except plum.AmbiguousLookupError:
            raise _ambiguity_error(primitive, function, signature, types) from None
    _cache[key] = handler
    return handler


def clear_caches() -> None:
    """Empty the handler cache, the accepted-keywords cache and the table of JAX's
    primitive names; registered handlers stay. Bumps `generation`, so that a body
    cached anywhere under the old one is not reused."""
    _cache.clear()
    _accepted.clear()
    _known_primitives.cache_clear()
    generation[0] += 1


def candidates(primitive: Primitive, types: tuple[type, ...]) -> list[Any]:
    """Every registered plum method that accepts operands of `types`."""
    function = _functions.get(primitive)
    if function is None:
        return []
    signature = plum.Signature(type(primitive), *types)
    function._resolve_pending_registrations()
    return [m for m in function.methods if signature <= m.signature]


def describe_handler(fn: Callable) -> str:
    try:
        file = inspect.getsourcefile(fn)
        line = inspect.getsourcelines(fn)[1]
        where = f" ({file}:{line})"
    except (OSError, TypeError):
        where = ""
    return f"{getattr(fn, '__qualname__', repr(fn))}{where}"


def _ambiguity_error(primitive, function, signature, types) -> _errors.HandlerError:
    found = candidates(primitive, types)
    lines = "\n".join(
        f"  - {_describe_signature(m)}{_location(m.implementation)}" for m in found
    )
    type_names = ", ".join(t.__name__ for t in types)
    return _errors.HandlerError(
        _errors.AMBIGUOUS_HANDLER.format(
            primitive=primitive.name, types=type_names, candidates=lines
        )
    )


def _describe_signature(method: Any) -> str:
    """``name(primitive, a: LoraMatrix, b: qax.ArrayValue)`` for a plum method."""
    fn = method.implementation
    try:
        names = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        names = []
    types = method.signature.types[1:]  # the first is the primitive
    args = [names[0] if names else "primitive"]
    for i, t in enumerate(types, start=1):
        name = names[i] if i < len(names) else f"arg{i}"
        args.append(f"{name}: {_type_name(t)}")
    if method.signature.has_varargs:
        args.append(f"*args: {_type_name(method.signature.varargs)}")
    return f"{getattr(fn, '__name__', 'handler')}({', '.join(args)})"


def _location(fn: Callable) -> str:
    try:
        return f" at {inspect.getsourcefile(fn)}:{inspect.getsourcelines(fn)[1]}"
    except (OSError, TypeError):
        return ""


def _type_name(t: Any) -> str:
    if t == ArrayValue:
        return "qax.ArrayValue"
    if t is Any:
        return "Any"
    args = getattr(t, "__args__", None)
    if args and getattr(t, "__origin__", None) is Union:
        return " | ".join(_type_name(a) for a in args)
    if t is jax.Array:
        return "jax.Array"
    return getattr(t, "__name__", repr(t))


def default_handler(primitive: Primitive | str, *args: Any, **params: Any) -> Any:
    """Bind `primitive` on `args` the ordinary way (no handler lookup for this call).

    Use it inside a handler to run the primitive on plain arrays, e.g. the `x @ w` part of
    a LoRA matmul. Implicit operands are *not* allowed here: materialize them first or call
    `jnp` functions, which are routed through handlers again.
    """
    primitive = resolve_primitive(primitive)
    for arg in args:
        if isinstance(arg, ImplicitBase):
            raise TypeError(
                f"`qax.default_handler({primitive.name}, ...)` got an implicit "
                f"{type(arg).__name__}; it binds the primitive on plain arrays only. "
                "Call `jnp`/`lax` functions on it instead (they dispatch to handlers) or "
                "pass `x.materialize()`."
            )
    return primitive.bind(*args, **primitive.get_bind_params(params))


# ----------------------------------------------------------------------------------------
# Rule tables
#
# How the interpreter runs a primitive that carries a function (`jit`, `scan`, `cond`,
# ...) or only annotates a value (`pvary`, `name`, ...): rules that work on the implicit
# values as wholes, never materializing them. Declared here, filled by `qax._rules`
# beside each rule. One signature per table:

PrimitiveRule = Callable[..., Any]
"""``rule(trace, primitive, vals, params) -> out``: a primitive bound with `bind`."""
FunctionRule = Callable[..., list]
"""``rule(trace, primitive, fun, vals, params) -> outs``: a primitive that JAX hands its
body as a function (`call` on JAX 0.10, `shard_map`)."""
CustomJvpRule = Callable[..., list]
"""``rule(trace, primitive, fun, jvp, vals, *, symbolic_zeros) -> outs``."""
CustomVjpRule = Callable[..., list]
"""``rule(trace, primitive, fun, fwd, bwd, vals, *, out_trees, symbolic_zeros) -> outs``."""

primitive_rules: dict[Primitive, PrimitiveRule] = {}
function_rules: dict[Primitive, FunctionRule] = {}
custom_jvp_rules: dict[Primitive, CustomJvpRule] = {}
custom_vjp_rules: dict[Primitive, CustomVjpRule] = {}
