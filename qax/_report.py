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
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jaxlib
import numpy as np
import plum

from . import _errors
from ._base import quiet_materialization
from ._compat import in_backward_pass, traced_source_line


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


# Frames skipped when looking for the user's line (warnings' stacklevel, the audit's
# source column): qax, JAX, plum, the standard library, and every installed package
# (Flax, optax, ...: anything under a site-packages or dist-packages directory, wherever
# the environment keeps it; a virtualenv's is not under the standard library's).
_SKIP_DIRS = tuple(
    _package_dir(m) for m in (sys.modules[__package__], jax, jaxlib, plum, contextlib)
)
QAX_DIR = _SKIP_DIRS[0]
_INSTALLED = tuple(f"{os.sep}{d}{os.sep}" for d in ("site-packages", "dist-packages"))


# The example models (`qax.examples`) are model code, like the user's own: never skipped.
_EXAMPLES_DIR = f"{QAX_DIR}examples{os.sep}"


def _is_library_file(filename: str) -> bool:
    if filename.startswith(_EXAMPLES_DIR):
        return False
    return filename.startswith(_SKIP_DIRS) or any(d in filename for d in _INSTALLED)


def _stacklevel() -> int:
    """The `stacklevel` that points a warning at the first frame outside JAX and qax."""
    frame, level = sys._getframe(2), 2
    while frame is not None and _is_library_file(frame.f_code.co_filename):
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
    """`file:line (function)` of the user code behind a materialization.

    The first frame outside JAX and qax (where the warning points); in a backward pass,
    the user line of the forward operation being transposed, when JAX knows it.
    """
    if in_backward_pass():
        line = traced_source_line(_is_library_file)
        if line is not None:
            return line
    frame = sys._getframe(1)
    while frame is not None and _is_library_file(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return None
    return f"{frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_name})"


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
        warnings.warn(message, _errors.MaterializationWarning, stacklevel=_stacklevel())


def replay(events: list[MaterializationEvent]) -> None:
    """Report again the events of a cached body that runs again (unless quiet), with
    the source line of the code that runs it now."""
    if not events or quiet_materialization.get():
        return
    here = source_line()
    for event in events:
        report(
            dataclasses.replace(event, source=here) if event.source != here else event
        )


def report_materialization(
    primitive: str, value: Any, reason: str | None = None
) -> None:
    """`report` the materialization of implicit `value` by `primitive`, unless qax
    materializes it quietly for its own bookkeeping (`quiet_materialization`)."""
    if quiet_materialization.get():
        return
    shape = None if value.shape is None else tuple(value.shape)
    report(
        MaterializationEvent(
            primitive, type(value), shape, value.dtype, source_line(), reason
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
