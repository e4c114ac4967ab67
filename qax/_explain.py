"""`qax.explain`: which handler a primitive dispatches to, and why the others lost."""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Callable
from types import UnionType
from typing import Any, Literal

import jax
import plum

from . import _audit, _dispatch, _interpreter
from ._arrival import PRODUCTS
from ._base import ImplicitBase
from ._compat import Primitive
from ._fields import fields_of
from ._report import MaterializationEvent

Outcome = Literal[
    "chosen", "less specific", "lower precedence", "ambiguous", "no match"
]


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One registered handler, and how it fared for the operand types explained.

    Attributes:
      handler: the registered function.
      signature: the operand types it accepts (the primitive argument left out).
      precedence: its ``precedence=``.
      outcome: ``"chosen"``, ``"less specific"``, ``"lower precedence"``,
        ``"ambiguous"`` (tied with another) or ``"no match"``.
      reason: the same in words, naming the handler it lost to or the operand that
        did not match.
    """

    handler: Callable
    signature: str
    precedence: int
    outcome: Outcome
    reason: str

    @property
    def name(self) -> str:
        return _dispatch.describe_handler(self.handler)


@dataclasses.dataclass(frozen=True)
class Explanation:
    """What qax does with one primitive on operands of given types.

    ``print()`` it for a readable account; the fields hold the same as data.

    Attributes:
      primitive: the `Primitive`.
      operand_types: the types dispatched on, after the commutative swap (plain arrays
        appear as `jax.Array`).
      swapped: whether the operands were swapped (commutative primitive, implicit
        operand second).
      candidates: every handler registered for the primitive, the chosen one first.
      chosen: the handler dispatch picks for these types, or None (it runs when
        ``"handler"`` is in `route`: a stack of examples skips it).
      ambiguous: True if the best handlers tie (dispatch would raise).
      fallback: what happens, in order, if no handler applies or the chosen one returns
        `NotImplemented`.
      policies: for each implicit class among the operands, the materialization policy
        that would apply now and where it comes from.
      route: the names of the steps of the interpreter's route (`qax._route.ROUTE`:
        ``"swap"``, ``"arrival"``, ``"handler"``, ``"rule"``, ``"stacked"``,
        ``"default_handler"``, ``"materialize"``) that act on these operands, in order,
        the last being `decides` (``"arrival"`` acts in staged programs only). Empty
        without an implicit operand.
      decides: the step that produces the result when the handler (registered or
        default) it runs returns one; ``""`` without an implicit operand.
      then: the steps that follow, in order, when that handler passes (returns
        `NotImplemented`).
    """

    primitive: Primitive
    operand_types: tuple[type, ...]
    swapped: bool
    candidates: tuple[Candidate, ...]
    chosen: Callable | None
    ambiguous: bool
    fallback: tuple[str, ...]
    policies: dict[type, tuple[str, str]]
    route: tuple[str, ...] = ()
    decides: str = ""
    then: tuple[str, ...] = ()

    def __str__(self) -> str:
        name = self.primitive.name
        types = ", ".join(_type_name(t) for t in self.operand_types)
        lines = [f"qax.explain({name!r}, {types})"]
        if not any(_is_implicit_type(t) for t in self.operand_types):
            lines.append(
                "  No implicit operand: qax does not intervene, JAX runs the primitive."
            )
            return "\n".join(lines)
        if self.swapped:
            lines.append(
                f"  {name} is commutative: the operands are swapped so that the "
                "implicit one comes first."
            )
        if self.candidates:
            lines.append(f"  Handlers registered for {name}:")
            rows = [
                (
                    _MARKS[c.outcome],
                    _qualname(c.handler),
                    f"({c.signature})",
                    f"precedence={c.precedence}",
                    _where(c.handler),
                )
                for c in self.candidates
            ]
            widths = [max(len(r[i]) for r in rows) for i in range(4)]
            indent = " " * (4 + widths[0] + 1)
            for row, c in zip(rows, self.candidates, strict=True):
                cells = [x.ljust(w) for x, w in zip(row, widths, strict=False)]
                lines.append(("    " + " ".join(cells) + "  " + row[4]).rstrip())
                lines.append(indent + c.reason)
        else:
            lines.append(f"  No handler is registered for {name}.")
        if self.ambiguous:
            lines.append("  => Ambiguous: dispatch raises `qax.HandlerError`.")
            lines.append(
                "     Give one of the tied handlers `precedence=`, or register one for "
                "exactly these types."
            )
            return "\n".join(lines)
        handler_runs = self.chosen is not None and "handler" in self.route
        if handler_runs:
            lines.append(f"  => {_qualname(self.chosen)} runs.")
        elif "stacked" in self.route:
            lines.append(
                "  => No handler runs: a stack of examples of a type that declares no "
                "batch axes (its handlers are written for one example)."
            )
        steps = " -> ".join(self.route)
        more = f"; if it passes: {' -> '.join(self.then)}" if self.then else ""
        lines.append(f"  Route: {steps}{more} (the steps of qax._route.ROUTE)")
        first = "If it returns NotImplemented" if handler_runs else "Without a handler"
        lines.append(f"  {first}:")
        lines.extend(f"    {i}. {step}" for i, step in enumerate(self.fallback, 1))
        return "\n".join(lines)

    __repr__ = __str__


_MARKS = {
    "chosen": "[chosen]",
    "less specific": "[lost]",
    "lower precedence": "[lost]",
    "ambiguous": "[tie]",
    "no match": "[n/a]",
}


def explain(primitive: str | Primitive, *operand_types: Any) -> Explanation:
    """Explain how qax dispatches `primitive` on operands of the given types.

    Lists every handler registered for the primitive with its signature and precedence,
    marks the one that is chosen, and says why each other one lost (less specific, lower
    precedence, tied, or which operand it does not accept). It then lists what happens
    if no handler applies: a structural rule, the class's `default_handler`, or
    materialization, with the materialization policy that applies now; and which steps
    of the interpreter's route (`qax._route.ROUTE`) act on such operands and which one
    decides (`Explanation.route`, `decides`, `then`). Pass an example value rather than
    a class for a stack of examples (it skips the handlers).

    Examples:
        >>> print(qax.explain("dot_general", jax.Array, LoraMatrix))
        qax.explain('dot_general', Array, LoraMatrix)
      Handlers registered for dot_general:
        [chosen] lora_matmul (Array, LoraMatrix) precedence=0  lora.py:12
                 the only handler that accepts these types
      => lora_matmul runs.
      If it returns NotImplemented:
        1. LoraMatrix is materialized (with a MaterializationWarning; policy "warn": ...)

    Args:
      primitive: a primitive name (e.g. ``"dot_general"``) or a `Primitive`.
      *operand_types: one per operand, in order: implicit array classes, `jax.Array` for
        plain arrays, or example values (their types are used).

    Returns:
      An `Explanation` (prints as text; its fields hold the same as data).

    Raises:
      ValueError: for an unknown primitive name.
    """
    primitive = _dispatch.resolve_primitive(primitive)
    stacked = any(map(_interpreter._stacked_examples, operand_types))
    types = tuple(_as_dispatch_type(t) for t in operand_types)
    swapped = _interpreter.swaps_operands(primitive, types)
    if swapped:
        types = (types[1], types[0])

    function = _dispatch._functions.get(primitive)
    methods = _all_methods(function)
    signature = plum.Signature(type(primitive), *types)
    matching = [m for m in methods if signature <= m.signature]
    chosen, ambiguous = None, False
    if function is not None and matching:
        try:
            chosen = function.resolve_method(signature)[0]
        except plum.AmbiguousLookupError:
            ambiguous = True
        except plum.NotFoundLookupError:
            pass

    judged = [_judge(m, matching, chosen, types) for m in methods]
    judged.sort(
        key=lambda c: _OUTCOME_ORDER[c.outcome]
    )  # stable: keeps registration order
    implicit = [t for t in dict.fromkeys(types) if _is_implicit_type(t)]
    policies = {cls: _policy_now(primitive, cls) for cls in implicit}
    route, then = _steps(primitive, types, swapped, chosen or ambiguous, stacked)
    return Explanation(
        primitive=primitive,
        operand_types=types,
        swapped=swapped,
        candidates=tuple(judged),
        chosen=chosen,
        ambiguous=ambiguous,
        fallback=_fallback(primitive, implicit, policies, stacked),
        policies=policies,
        route=route,
        decides=route[-1] if route else "",
        then=then,
    )


def _steps(primitive, types, swapped, handler, stacked) -> tuple[tuple, tuple]:
    """(route, then) of `Explanation`: the steps of `_route.ROUTE` that act on operands
    of `types`, as `_interpreter.apply_primitive` takes them."""
    implicit = [t for t in types if _is_implicit_type(t)]
    if not implicit:
        return (), ()
    route = ["swap"] if swapped else []
    if primitive in PRODUCTS and any(fields_of(t).stored for t in implicit):
        route.append("arrival")
    if primitive in _dispatch.primitive_rules:
        rest = ["rule"]
    elif stacked:
        rest = ["stacked"]
    elif _interpreter.has_default_rule(implicit[0]):
        rest = ["default_handler", "materialize"]
    else:
        rest = ["materialize"]
    if handler and not stacked:
        route.append("handler")
    else:
        route.append(rest.pop(0))
    return tuple(route), tuple(rest)


_OUTCOME_ORDER = {
    "chosen": 0,
    "ambiguous": 1,
    "lower precedence": 2,
    "less specific": 3,
    "no match": 4,
}


def _all_methods(function: plum.Function | None) -> list[Any]:
    if function is None:
        return []
    function._resolve_pending_registrations()
    return list(function.methods)


def _judge(method, matching, chosen, types) -> Candidate:
    """The outcome of `method` for operand `types`, with the reason in words."""
    sig = method.signature
    described = _signature_text(sig)
    precedence = sig.precedence

    def made(outcome: Outcome, reason: str) -> Candidate:
        return Candidate(method.implementation, described, precedence, outcome, reason)

    if method not in matching:
        return made("no match", _mismatch(sig, types))
    if chosen is not None and method.implementation is chosen:
        if len(matching) == 1:
            return made("chosen", "the only handler that accepts these types")
        return made("chosen", "the most specific handler that accepts these types")
    better = [m for m in matching if m.signature < sig]
    if better:
        return made("less specific", f"less specific than {_name(better[0])}")
    # Among the most specific: precedence decides.
    peers = [
        m
        for m in matching
        if m is not method and not any(o.signature < m.signature for o in matching)
    ]
    higher = [m for m in peers if m.signature.precedence > precedence]
    if higher:
        return made("lower precedence", f"lower precedence than {_name(higher[0])}")
    tied = [m for m in peers if m.signature.precedence == precedence]
    names = ", ".join(_name(m) for m in tied)
    return made("ambiguous", f"tied with {names}: as specific, same precedence")


def _mismatch(sig: plum.Signature, types: tuple[type, ...]) -> str:
    """Which operand `sig` does not accept (1-based, not counting the primitive)."""
    n = len(types) + 1
    if n < len(sig.types) or (n > len(sig.types) and not sig.has_varargs):
        takes = len(sig.types) - 1
        more = " or more" if sig.has_varargs else ""
        return f"takes {takes}{more} operand{'s' if takes != 1 else ''}, got {n - 1}"
    expected = sig.expand_varargs(n)[1:]
    for i, (got, want) in enumerate(zip(types, expected, strict=False), 1):
        if not plum.Signature(got) <= plum.Signature(want):
            return f"operand {i} is {_type_name(got)}, not {_type_name(want)}"
    return "does not accept these types"


def _signature_text(sig: plum.Signature) -> str:
    parts = [_type_name(t) for t in sig.types[1:]]
    if sig.has_varargs:
        parts.append(f"*{_type_name(sig.varargs)}")
    return ", ".join(parts)


def _name(method: Any) -> str:
    return _qualname(method.implementation)


def _qualname(fn: Callable) -> str:
    return getattr(fn, "__qualname__", repr(fn))


def _where(fn: Callable) -> str:
    """``path:line`` of `fn`'s definition, the path relative to the working directory."""
    try:
        path = inspect.getsourcefile(fn)
        line = inspect.getsourcelines(fn)[1]
    except Exception:  # noqa: BLE001 (no source, or source that does not tokenize:
        # code compiled from a string whose file name `linecache` maps to other text)
        return ""
    if path is None:
        return ""
    return f"{_audit.short_path(path)}:{line}"


def _type_name(t: Any) -> str:
    if t is jax.Array:
        return "Array"
    if t == _dispatch.ArrayValue:
        return "ArrayValue"
    args = typing.get_args(t)
    if args and typing.get_origin(t) in (typing.Union, UnionType):
        return " | ".join(_type_name(a) for a in args)
    return getattr(t, "__name__", repr(t))


def _is_implicit_type(t: Any) -> bool:
    return isinstance(t, type) and issubclass(t, ImplicitBase)


def _as_dispatch_type(t: Any) -> type:
    """An operand type as dispatch sees it: implicit classes stay, the rest is Array."""
    if isinstance(t, type):
        return t if issubclass(t, ImplicitBase) else jax.Array
    return _dispatch.dispatch_type(t)


def _policy_now(primitive: Primitive, cls: type) -> tuple[str, str]:
    event = MaterializationEvent(primitive.name, cls, (), None, None)
    return _audit.decide(event)


def _fallback(primitive, implicit, policies, stacked=False) -> tuple[str, ...]:
    if primitive in _dispatch.primitive_rules:
        return (
            f"the structural rule for {primitive.name} runs its body on the implicit "
            "values (it materializes nothing itself)",
        )
    steps = []
    if stacked:
        steps.append(
            "the stacked examples are materialized (as below), and the route starts "
            "again on the result"
        )
    if implicit and not stacked:
        first = implicit[0]
        if _interpreter.has_default_rule(first):
            steps.append(
                f"{first.__name__}.default_handler(primitive, ...) runs; if it returns "
                "NotImplemented:"
            )
    for cls in implicit:
        policy, why = policies[cls]
        name = cls.__name__
        step = {
            "allow": f"{name} is materialized silently",
            "warn": f"{name} is materialized, with a MaterializationWarning",
            "error": f"materializing {name} raises MaterializationError",
        }[policy]
        steps.append(f'{step} (policy "{policy}": {why})')
    return tuple(steps)
