"""Exceptions, warnings and the long texts of their messages."""

from __future__ import annotations

from typing import Any


class MaterializationWarning(UserWarning):
    """An implicit array was turned into a dense array because no handler applied.

    Filter it by category, e.g. ``warnings.simplefilter("error", qax.MaterializationWarning)``
    to make any densification a failing test.
    """


class UninitializedAval(Exception):
    """The shape or dtype of an implicit array could not be determined."""

    def __init__(self, kind: str, cls_name: str = "ImplicitArray", cause: str = ""):
        self.kind = kind
        ways = UNINITIALIZED_AVAL.format(kind=kind, cls=cls_name)
        if cause:
            # The cause first: usually the fields themselves are wrong (LoRA factors
            # of mismatched shapes), and passing `shape=` would only hide that.
            ways = (
                UNINITIALIZED_AVAL_CAUSE.format(kind=kind, cls=cls_name, cause=cause)
                + ways.split("\n", 1)[1]
            )
        super().__init__(ways)


class MaterializationError(RuntimeError):
    """An implicit array was materialized where `qax.materialization_policy` says "error".

    Attributes:
      primitive: name of the primitive that had no handler.
      cls: the implicit class that was materialized.
      source: ``file:line (function)`` of the user's code that triggered it, if known.
      phase: ``"forward"``, or ``"backward"`` inside a backward (transpose) pass.
    """

    def __init__(self, event: Any, rule: str, phase: str = "forward"):
        self.primitive = event.primitive
        self.cls = event.cls
        self.source = event.source
        self.phase = phase
        super().__init__(
            MATERIALIZATION_FORBIDDEN.format(
                primitive=event.primitive,
                cls=event.cls.__name__,
                aval=f"{event.dtype}{list(event.shape)}",
                source=event.source or "an unknown line",
                phase=phase,
                rule=rule,
            )
        )


class HandlerError(TypeError):
    """A primitive handler was ambiguous or returned something of the wrong type."""


# Shown as `qax.HandlerError` (where users catch them), not `qax._errors.HandlerError`.
for _cls in (
    MaterializationWarning,
    UninitializedAval,
    MaterializationError,
    HandlerError,
):
    _cls.__module__ = "qax"

MATERIALIZE_WARNING = (
    "Primitive {primitive} was not handled by class {cls}, so implicit args will be "
    "materialized."
)

MATERIALIZATION_FORBIDDEN = """\
Primitive {primitive} was not handled by class {cls}, so a {cls} ({aval}) would be \
materialized at {source} (in the {phase} pass), but its materialization policy is \
"error" ({rule}). Register a handler with `@qax.primitive_handler("{primitive}")` \
(`qax.explain("{primitive}", ...)` shows which ones exist), or allow it, e.g. in a \
`with qax.materialization_policy({cls}, "allow"):` block."""

UNINITIALIZED_AVAL = """\
Could not determine the {kind} of this {cls}. Provide it in one of these ways:
  - pass it when constructing: {cls}(..., {kind}=...)
  - override `compute_{kind}(self)` to derive it from the other fields
  - set the class attribute `default_{kind} = ...`
  - make `materialize()` work on the fields alone, so that it can be inferred with
    `jax.eval_shape`"""

UNINITIALIZED_AVAL_CAUSE = """\
Could not determine the {kind} of this {cls}: `materialize()` fails on its fields with
  {cause}
Check the fields (their shapes must fit together in `materialize()`). If they are right,
provide the {kind} in one of these ways:
"""

AMBIGUOUS_HANDLER = """\
Handlers for primitive `{primitive}` are ambiguous for operand types ({types}):
{candidates}
Fix it by giving one of them `precedence=` (e.g. `@qax.primitive_handler("{primitive}", \
precedence=1)`), by registering a handler for exactly this combination, or by applying \
`qax.use_implicit_args` in two nested steps so that one type is handled first. \
`qax.explain("{primitive}", {types})` shows how each candidate was ranked."""

BAD_HANDLER_RESULT = """\
Handler `{handler}` for primitive `{primitive}` returned {got}, but `{primitive}` on these \
operands produces {expected}. A handler must return arrays (or implicit arrays) of exactly \
the shape and dtype of the primitive's result."""

UNKNOWN_PRIMITIVE = """\
Unknown primitive name {name!r}: JAX has no primitive of that name (looked up as \
`jax.lax.{name}_p`, among JAX's other primitives, and by primitive names).{suggestion} \
Pass a name from `qax.constants` or the JAX `Primitive` object itself (e.g. \
`jax.lax.dot_general_p`)."""

OUTSIDE_WRAPPER = """\
`{function}` received a {cls}, which is an implicit array, outside \
`qax.use_implicit_args`. JAX functions (`jnp.*`, `jax.nn.*`) see implicit arrays only in \
a function wrapped with `qax.use_implicit_args`, where handlers apply: call \
`qax.use_implicit_args(f)(...)` instead of `f(...)`, or pass `x.materialize()` to work on \
the dense array."""

CONVERTED = """\
A {cls} was converted to a dense array by `{how}` outside `qax.use_implicit_args`, so it \
was materialized."""

TRACED_TO_NUMPY = """\
This {cls} holds traced values (it is used inside `jax.jit`, `jax.grad`, ...), so it \
cannot become a NumPy array. Use it inside a function wrapped with \
`qax.use_implicit_args`, or call `x.materialize()` for the dense JAX array."""

HALF_BUILT = """\
{fields} {verb} None: an implicit array with missing fields (as `eqx.partition` \
leaves them) reached `qax.use_implicit_args`. Pass the complete value, e.g. \
`eqx.combine(params, static)`, or give the field a value. (The call failed with \
{error}.)"""

FIELD_OF_TRACER = """\
Inside a function wrapped with `qax.use_implicit_args`, a {cls} is seen as the array it \
represents (a JAX tracer of its shape and dtype), so its field `{name}` cannot be read \
here. Fields are readable outside the wrapped function, and inside handlers \
(`@qax.primitive_handler`) and `materialize()`, which receive the {cls} itself: read \
`x.{name}` before the call and pass it as an argument, or write a handler for the \
operation."""

STACKED_UNDECLARED = (
    "This {cls} holds {n} examples stacked by `jax.vmap`, and {cls} does not declare "
    "how its fields carry batch axes, so its handlers (written for one example) cannot "
    "take it: it is materialized, one example at a time. Declare batch axes with "
    "`qax.array_field(ndim=...)` to keep it implicit, or apply the `vmap` around "
    "`qax.use_implicit_args` (`jax.vmap(qax.use_implicit_args(f))`) so that `f` sees "
    "one example."
)

CONSTRUCTED_CARRY = (
    "qax: an implicit array in this loop carry (or `cond` branch output) was built inside "
    "the function wrapped with `qax.use_implicit_args` (or outside it), so JAX's loop "
    "and `cond` functions see it as a plain pytree, whose structure must stay the same. "
    "Pass it to the wrapped function as an argument instead (or compute it from one): "
    "qax then materializes the parts of a carry whose implicit structure changes, with a "
    "`MaterializationWarning`, as it does for `cond` branches."
)
