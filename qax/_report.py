"""Materialization reports: what happens when an implicit array is made dense.

Every materialization qax performs for the user is one `MaterializationEvent`, passed to
`report`, which (in this order) hands it to the recorders of traced bodies being cached,
holds it if a body is traced that may be thrown away, shows it to the listeners
(`qax.materialization_audit`), and applies its policy: nothing, a
`MaterializationWarning` pointed at the user's line, or a `MaterializationError`. The
policy comes from `decide_policy`, whose default reads the class keyword
`warn_on_materialize`; `qax._audit` installs the rules of `qax.materialization_policy`
with `set_policy`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jaxlib
import numpy as np
import plum

from . import _errors
from ._base import ImplicitBase, quiet_materialization
from ._compat import in_backward_pass, traced_source_line
from ._fields import fields_of
from ._tree_util import key_value, path_string


@dataclasses.dataclass(frozen=True)
class MaterializationEvent:
    """One implicit operand that was turned into a dense array."""

    primitive: str
    cls: type
    shape: tuple[int, ...]
    dtype: Any
    source: str | None
    # A specific explanation (e.g. "the carry of a scan changed structure"), warned
    # instead of the standard "was not handled" text.
    reason: str | None = None
    # Where the value came from, when qax knows it: its key path among the arguments
    # of `use_implicit_args` ("fc1/kernel of argument 0").
    weight: str | None = None
    # The user's own line that led there (the first frame outside every library),
    # when it is not `source` (the model's line, in an installed library).
    caller: str | None = None

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


# Listeners see every event (audits); recorders collect events of a traced body so that a
# cached body can report them again when it is reused.
_listeners: contextvars.ContextVar[
    tuple[Callable[[MaterializationEvent], None], ...]
] = contextvars.ContextVar("qax_listeners", default=())
_recorders: contextvars.ContextVar[tuple[list, ...]] = contextvars.ContextVar(
    "qax_recorders", default=()
)
# Set while a body is traced that may be thrown away (a loop traced again with another
# carry structure): its events are collected here and reported later with `replay`.
_held: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "qax_held", default=None
)


def _package_dir(module: Any) -> str:
    return os.path.dirname(os.path.abspath(module.__file__)) + os.sep


# Where a materialization happened: the model's own line, the innermost frame outside
# qax and JAX (and plum and the standard library), wherever that model's library is
# installed; and the user's line, the first frame outside every installed package too.
_MACHINERY_DIRS = tuple(
    _package_dir(m) for m in (sys.modules[__package__], jax, jaxlib, plum)
)
QAX_DIR = _MACHINERY_DIRS[0]
_STDLIB_DIR = _package_dir(contextlib)
# Installed packages live under a site-packages or dist-packages directory, wherever the
# environment keeps it (a virtualenv's is not under the standard library's; a Python
# built into /usr/local has its site-packages inside the standard library's directory).
_INSTALLED = tuple(f"{os.sep}{d}{os.sep}" for d in ("site-packages", "dist-packages"))


# The example models (`qax.examples`) are model code, like the user's own: never skipped.
_EXAMPLES_DIR = f"{QAX_DIR}examples{os.sep}"


def _is_machinery_file(filename: str) -> bool:
    """qax, JAX, plum or the standard library: never the model's line."""
    if filename.startswith(_EXAMPLES_DIR):
        return False
    if filename.startswith(_MACHINERY_DIRS):
        return True
    return filename.startswith(_STDLIB_DIR) and not _installed(filename)


def _installed(filename: str) -> bool:
    return any(d in filename for d in _INSTALLED)


def _is_library_file(filename: str) -> bool:
    """Machinery, or any installed package (Flax, a model library): not the user's."""
    if filename.startswith(_EXAMPLES_DIR):
        return False
    return _is_machinery_file(filename) or _installed(filename)


def _stacklevel() -> int:
    """The `stacklevel` that points a warning at the model's line (`source_line`)."""
    frame, level = sys._getframe(2), 2
    while frame is not None and _is_machinery_file(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    return level


@contextlib.contextmanager
def _pushed(var: contextvars.ContextVar, item: Any) -> Iterator[None]:
    token = var.set((*var.get(), item))
    try:
        yield
    finally:
        var.reset(token)


def listen(callback: Callable[[MaterializationEvent], None]):
    """Show every event reported inside to `callback` (the audit's hook)."""
    return _pushed(_listeners, callback)


def recording(into: list):
    """Append every event reported inside to `into` (a cached body's record)."""
    return _pushed(_recorders, into)


@contextlib.contextmanager
def holding_reports(into: list) -> Iterator[None]:
    """Collect the events reported inside into `into` instead of reporting them.

    Recorders opened inside still see them; the caller `replay`s the ones that count.
    """
    held, recorders = _held.set(into), _recorders.set(())
    try:
        yield
    finally:
        _recorders.reset(recorders)
        _held.reset(held)


def source_line() -> str | None:
    """`file:line (function)` of the model code behind a materialization.

    The innermost frame outside qax, JAX, plum and the standard library (where the
    warning points), in an installed library too (a model library's own line, not the
    user's one-line call into it); in a backward pass, the line of the forward
    operation being transposed, when JAX knows it.
    """
    if in_backward_pass():
        line = traced_source_line(_is_machinery_file)
        if line is not None:
            return line
    return _line(sys._getframe(1), _is_machinery_file)


def caller_line() -> str | None:
    """`file:line (function)` of the user's own code behind a materialization: the
    first frame outside every installed package."""
    return _line(sys._getframe(1), _is_library_file)


def _line(frame: Any, skip: Callable[[str], bool]) -> str | None:
    while frame is not None and skip(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return None
    return f"{frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_name})"


# The arguments of the `use_implicit_args` calls in progress (innermost last): a
# materialized value that is one of their implicit leaves (at any depth) is named by
# its key path. Searched only when something is materialized.
_arguments: contextvars.ContextVar[tuple] = contextvars.ContextVar(
    "qax_arguments", default=()
)


def arguments(args: tuple, kwargs: dict):
    """The arguments of a `use_implicit_args` call, for naming what it materializes."""
    return _pushed(_arguments, (args, kwargs))


# Bodies that qax re-traces (a `jnp` function, a `scan` or `cond` body) see values
# rebuilt from leaves: each maps its values to those of the call that binds it.
_aliases: contextvars.ContextVar[tuple[dict, ...]] = contextvars.ContextVar(
    "qax_aliases", default=()
)


@contextlib.contextmanager
def same_values(outer: Sequence, inner: Sequence) -> Iterator[None]:
    """Inside, the implicit values of `inner` (a re-traced body's inputs, at any depth)
    are named as those of `outer` at the same positions (`weight_path`)."""
    pairs: dict[int, tuple[Any, Any]] = {}
    _pair(outer, inner, pairs)
    if not pairs:
        yield
        return
    with _pushed(_aliases, pairs):
        yield


def _pair(outer: Sequence, inner: Sequence, pairs: dict) -> None:
    for o, i in zip(outer, inner, strict=False):
        if isinstance(o, ImplicitBase) and type(i) is type(o) and i is not o:
            pairs[id(i)] = (i, o)
            names = fields_of(type(o)).children
            _pair(
                [o.__dict__.get(n) for n in names],
                [i.__dict__.get(n) for n in names],
                pairs,
            )


def weight_path(value: Any) -> str | None:
    """``"fc1/kernel of argument 0"``: where `value` is among the arguments of the
    `use_implicit_args` calls in progress, or ``None`` (a value computed inside)."""
    for aliases in reversed(_aliases.get()):
        hit = aliases.get(id(value))
        if hit is not None and hit[0] is value:
            value = hit[1]
    for tree in reversed(_arguments.get()):
        found = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is value)
        for path, leaf in found[0]:
            if leaf is value:
                return _argument_words(path)
    return None


def _argument_words(path: tuple) -> str:
    """A key path into ``(args, kwargs)`` in words: ``"fc1/kernel of argument 0"``."""
    (kind, which, *rest) = path
    if rest and getattr(rest[-1], "name", None) == "value":  # a Flax NNX Variable
        rest = rest[:-1]
    where = f"argument {key_value(which)}"
    if kind == jax.tree_util.SequenceKey(1):
        where = f"argument {key_value(which)!r}"
    return f"{path_string(rest)} of {where}" if rest else where


def keyword_policy(event: MaterializationEvent) -> tuple[str, str]:
    """The class keyword's policy: "warn", or "allow" for `warn_on_materialize=False`."""
    if event.cls.warn_on_materialize:
        return "warn", "class default"
    return "allow", f"{event.cls.__name__} was created with warn_on_materialize=False"


PolicyRule = Callable[[MaterializationEvent], tuple[str, str]]
"""Decides what a materialization does: ("allow" | "warn" | "error", why)."""

_policy: PolicyRule = keyword_policy


def set_policy(rule: PolicyRule) -> None:
    """Install the rule `report` applies (`qax._audit` installs its policy rules)."""
    global _policy
    _policy = rule


def report(event: MaterializationEvent) -> None:
    """Record `event`, then apply its policy: nothing, a warning, or an error."""
    for recorder in _recorders.get():
        recorder.append(event)
    held = _held.get()
    if held is not None:
        held.append(event)
        return
    for listener in _listeners.get():
        listener(event)
    policy, why = _policy(event)
    if policy == "error":
        phase = "backward" if in_backward_pass() else "forward"
        raise _errors.MaterializationError(event, why, phase)
    if policy == "warn":
        message = event.reason or _errors.MATERIALIZE_WARNING.format(
            primitive=event.primitive, cls=event.cls.__name__
        )
        message += _errors.where_words(event)
        warnings.warn(message, _errors.MaterializationWarning, stacklevel=_stacklevel())


def replay(events: list[MaterializationEvent]) -> None:
    """Report again the events of a cached body that runs again (unless quiet), with
    the source line of the code that runs it now."""
    if not events or quiet_materialization.get():
        return
    here, caller = source_line(), caller_line()
    caller = caller if caller != here else None
    for event in events:
        # The value recorded is the one of the call that traced the body: the weight
        # it names may not be this call's.
        report(dataclasses.replace(event, source=here, caller=caller, weight=None))


def report_materialization(
    primitive: str, value: Any, reason: str | None = None
) -> None:
    """`report` the materialization of implicit `value` by `primitive`, unless qax
    materializes it quietly for its own bookkeeping (`quiet_materialization`)."""
    if quiet_materialization.get():
        return
    shape = None if value.shape is None else tuple(value.shape)
    source, caller = source_line(), caller_line()
    report(
        MaterializationEvent(
            primitive,
            type(value),
            shape,
            value.dtype,
            source,
            reason,
            weight_path(value),
            caller if caller != source else None,
        )
    )


@contextlib.contextmanager
def quietly() -> Iterator[None]:
    """Materializations inside are qax's own bookkeeping: neither reported nor warned."""
    token = quiet_materialization.set(True)
    try:
        yield
    finally:
        quiet_materialization.reset(token)
