"""Knowing what was materialized: `materialization_audit` and `materialization_policy`.

Every time an implicit operand is densified because nothing handled a primitive, the
interpreter calls `qax._report.report` with a `MaterializationEvent`. This module
listens to those events (the audit) and decides what each one does (the policies).

How a materialization is treated, "allow" | "warn" | "error", is decided per event:

1. rules set in `with qax.materialization_policy(...)` blocks, innermost block first: the
   first one whose target matches decides;
2. otherwise rules set globally (`qax.materialization_policy(...)` called as a
   statement): a rule for the primitive beats a rule for a class, and a rule for a class
   beats a rule for one of its base classes;
3. otherwise the class keyword: "warn", or "allow" for ``warn_on_materialize=False``.
"""

from __future__ import annotations

import contextvars
import dataclasses
import os
import re
import sys
import threading
from collections.abc import Iterator
from typing import Any, Literal

import numpy as np

from . import _report
from ._base import ImplicitBase
from ._compat import Primitive, in_backward_pass
from ._dispatch import resolve_primitive
from ._report import MaterializationEvent

Policy = Literal["allow", "warn", "error"]
_POLICIES = ("allow", "warn", "error")


# ----------------------------------------------------------------------------------------
# Policies


@dataclasses.dataclass(frozen=True)
class _Rule:
    """One policy for one target: a primitive name or an implicit class."""

    target: str | type
    policy: str

    def matches(self, event: MaterializationEvent) -> bool:
        if isinstance(self.target, str):
            return event.primitive == self.target
        return issubclass(event.cls, self.target)

    def describe(self) -> str:
        target = self.target
        name = f'"{target}"' if isinstance(target, str) else target.__name__
        return f'set by qax.materialization_policy({name}, "{self.policy}")'


# Rules set as statements (keyed by target), and rules of the `with` blocks now open.
_global_rules: dict[str | type, _Rule] = {}
_global_lock = threading.Lock()
_scoped_rules: contextvars.ContextVar[tuple[_Rule, ...]] = contextvars.ContextVar(
    "qax_policy_rules", default=()
)


def _specificity(rule: _Rule, event: MaterializationEvent) -> int:
    """Lower is more specific: the primitive, then the class, then its bases."""
    if isinstance(rule.target, str):
        return -1
    return event.cls.__mro__.index(rule.target)


def decide(event: MaterializationEvent) -> tuple[str, str]:
    """The policy for `event` and where it comes from; see the module docstring."""
    scoped = _scoped_rules.get()
    if scoped or _global_rules:
        for rule in reversed(scoped):
            if rule.matches(event):
                return rule.policy, rule.describe()
        matching = [r for r in list(_global_rules.values()) if r.matches(event)]
        if matching:
            rule = min(matching, key=lambda r: _specificity(r, event))
            return rule.policy, rule.describe()
    return _report.keyword_policy(event)


_report.set_policy(decide)


def _target_key(target: Any) -> str | type:
    if isinstance(target, type) and issubclass(target, ImplicitBase):
        return target
    if isinstance(target, (str, Primitive)):
        return resolve_primitive(target).name
    raise TypeError(
        "The target of `qax.materialization_policy` must be an implicit array class "
        "(e.g. `LoraMatrix`, or `qax.ImplicitArray` for all of them), a primitive name "
        f"(e.g. 'dot_general') or a `Primitive`; got {type(target).__name__}: {target!r}."
    )


class materialization_policy:  # lower case: it is used like a function
    """Decide what happens when `target` is materialized: "allow", "warn" or "error".

    A materialization happens when a primitive reaches an implicit array that no handler
    covers: qax then densifies it (``materialize()``) and runs the primitive normally.
    With "warn" (the default) that emits a `qax.MaterializationWarning`; "allow" does it
    silently; "error" raises `qax.MaterializationError` naming the primitive, the class
    and the line of your code instead. All three are still recorded by
    `qax.materialization_audit`.

    Called as a statement, the rule holds for the rest of the program, in every thread
    (until another call for the same target, or `undo()`). Used in a ``with`` statement,
    it holds only inside the block (and only for the current thread or async task).

    Which rule wins when several match: the innermost ``with`` block first; then global
    rules, where a rule for the primitive beats one for the class and a rule for a class
    beats one for its base classes; then the class keyword ``warn_on_materialize``
    (``False`` means "allow"). So an explicit policy always beats the class keyword.

    Examples:
        >>> qax.materialization_policy(LoraMatrix, "error")   # never form W + A @ B.T
        >>> with qax.materialization_policy("transpose", "allow"):
        ...     y = f(x, lora)   # a transpose may materialize here, silently

    Args:
      target: an implicit array class (its subclasses included), a primitive name such
        as ``"dot_general"``, or a JAX `Primitive` object (``jax.lax.dot_general_p``).
      policy: ``"allow"``, ``"warn"`` or ``"error"``.

    Raises:
      TypeError: if `target` is not one of the above.
      ValueError: for an unknown primitive name or policy.
    """

    def __init__(self, target: type | str | Primitive, policy: Policy):
        if policy not in _POLICIES:
            raise ValueError(
                f"Unknown materialization policy {policy!r}; use one of "
                f"{', '.join(map(repr, _POLICIES))}."
            )
        key = _target_key(target)
        self.rule = _Rule(key, policy)
        with _global_lock:
            self._previous = _global_rules.get(key)
            _global_rules[key] = self.rule
        self._token = None

    def undo(self) -> None:
        """Remove this rule if it was set globally, restoring the one it replaced."""
        with _global_lock:
            if _global_rules.get(self.rule.target) is self.rule:
                if self._previous is None:
                    del _global_rules[self.rule.target]
                else:
                    _global_rules[self.rule.target] = self._previous

    def __enter__(self) -> materialization_policy:
        # Used as a context manager: the rule is scoped to the block, not global.
        if self._token is not None:
            raise RuntimeError(f"{self!r} is already active; create a new one.")
        self.undo()
        self._token = _scoped_rules.set((*_scoped_rules.get(), self.rule))
        return self

    def __exit__(self, *exc_info: Any) -> None:
        _scoped_rules.reset(self._token)
        self._token = None

    def __repr__(self) -> str:
        target = self.rule.target
        name = target if isinstance(target, str) else target.__name__
        return f"materialization_policy({name!r}, {self.rule.policy!r})"


# ----------------------------------------------------------------------------------------
# Audit


@dataclasses.dataclass(frozen=True)
class MaterializationRecord:
    """One implicit operand that was materialized, as seen by an audit.

    Attributes:
      primitive: name of the primitive that no handler covered.
      cls: the implicit class that was materialized.
      shape, dtype: of the materialized array.
      nbytes: its size in bytes.
      source: ``file:line (function)`` of the model code that triggered it (the line a
        warning points at): the innermost frame outside qax and JAX, in an installed
        library too (a layer's own line), or None.
      phase: ``"forward"``, or ``"backward"`` if it happened while JAX ran a backward
        (transpose) pass, e.g. inside `jax.grad` applied within `qax.use_implicit_args`.
      policy: what it did: ``"allow"``, ``"warn"`` or ``"error"`` (it raised).
      weight: where the materialized value is among the arguments of
        `qax.use_implicit_args` (``"fc1/kernel of argument 0"``: its key path), when
        qax knows it (a value computed inside, or one of a body qax reused, has none).
      caller: the user's own line that reached `source` (the first frame outside every
        installed package), when it is another line; otherwise None.
    """

    primitive: str
    cls: type
    shape: tuple[int, ...]
    dtype: np.dtype
    nbytes: int
    source: str | None
    phase: Literal["forward", "backward"]
    policy: Policy
    weight: str | None = None
    caller: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """The record as a plain dict (the class as its name), e.g. for a DataFrame."""
        d = dataclasses.asdict(self)
        d["cls"] = self.cls.__name__
        d["dtype"] = np.dtype(self.dtype).name
        return d


class MaterializationAudit:
    """The materializations seen while a `materialization_audit` block was open.

    A sequence of `MaterializationRecord` (``len``, iteration, indexing, falsy when
    empty); ``print(audit)`` shows them as a table.
    """

    def __init__(self) -> None:
        self._records: list[MaterializationRecord] = []
        self._listening = None

    # -- recording ---------------------------------------------------------------------

    def _on_event(self, event: MaterializationEvent) -> None:
        policy, _ = decide(event)
        self._records.append(
            MaterializationRecord(
                primitive=event.primitive,
                cls=event.cls,
                shape=tuple(event.shape),
                dtype=np.dtype(event.dtype),
                nbytes=event.nbytes,
                source=event.source,
                phase="backward" if in_backward_pass() else "forward",
                policy=policy,
                weight=event.weight,
                caller=event.caller,
            )
        )

    def __enter__(self) -> MaterializationAudit:
        if self._listening is not None:
            raise RuntimeError("This audit is already open; start a new one instead.")
        self._listening = _report.listen(self._on_event)
        self._listening.__enter__()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        listening, self._listening = self._listening, None
        listening.__exit__(*exc_info)

    # -- as data -----------------------------------------------------------------------

    @property
    def records(self) -> tuple[MaterializationRecord, ...]:
        """Every record, in the order the materializations happened."""
        return tuple(self._records)

    @property
    def total_bytes(self) -> int:
        """Bytes materialized in all, counting every record."""
        return sum(r.nbytes for r in self._records)

    def filter(
        self,
        primitive: str | None = None,
        cls: type | None = None,
        phase: str | None = None,
    ) -> list[MaterializationRecord]:
        """The records for this primitive name, class (or subclass) and/or phase."""
        return [
            r
            for r in self._records
            if (primitive is None or r.primitive == primitive)
            and (cls is None or issubclass(r.cls, cls))
            and (phase is None or r.phase == phase)
        ]

    def as_dicts(self) -> list[dict[str, Any]]:
        """Every record as a plain dict, e.g. ``pandas.DataFrame(audit.as_dicts())``."""
        return [r.as_dict() for r in self._records]

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[MaterializationRecord]:
        return iter(list(self._records))

    def __getitem__(self, index: int) -> MaterializationRecord:
        return self._records[index]

    # -- as text -----------------------------------------------------------------------

    def __str__(self) -> str:
        if not self._records:
            return "Materialization audit: nothing was materialized."
        n = len(self._records)
        header = (
            f"Materialization audit: {n} materialization{'s' if n != 1 else ''}, "
            f"{_format_bytes(self.total_bytes)}"
        )
        rows = [
            ("#", "pass", "primitive", "class", "array", "bytes", "policy", "source")
        ]
        for i, r in enumerate(self._records, 1):
            rows.append(
                (
                    str(i),
                    r.phase,
                    r.primitive,
                    r.cls.__name__,
                    f"{np.dtype(r.dtype).name}{list(r.shape)}",
                    f"{r.nbytes:,}",
                    r.policy,
                    _short_source(r.source),
                )
            )
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        right = {0, 5}
        lines = [header]
        for row in rows:
            cells = [
                c.rjust(w) if i in right else c.ljust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=True))
            ]
            lines.append("  " + "  ".join(cells).rstrip())
        return "\n".join(lines)

    __repr__ = __str__


def materialization_audit() -> MaterializationAudit:
    """Record every materialization of an implicit array while the block runs.

    A materialization happens when a primitive reaches an implicit array that no handler
    covers, so the array is densified (``materialize()``) and the primitive runs on the
    dense value. The audit records each one: primitive, implicit class, shape, dtype,
    bytes, your source line, forward or backward pass, and the policy that applied
    (allowed materializations are recorded too; see `qax.materialization_policy`).

    Materializations happen while JAX *traces*: a call answered from a `jax.jit` cache
    runs no Python and reports nothing (bodies of ``jit`` calls inside
    `qax.use_implicit_args`, which qax caches itself, are reported again on reuse).

    Examples:
        >>> with qax.materialization_audit() as audit:
        ...     y = qax.use_implicit_args(model)(x, lora)
        >>> print(audit)          # a table; `audit.records` holds the data
        >>> assert not audit      # nothing was materialized

    Returns:
      A `MaterializationAudit`, filled while the ``with`` block runs.
    """
    return MaterializationAudit()


def _format_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} bytes"


def short_path(path: str) -> str:
    """`path` relative to the working directory if it lies inside it, else relative to
    the `sys.path` entry it was imported from (``qax/examples/models.py`` wherever qax is
    installed), else as it is."""
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive on Windows
        return path
    if not rel.startswith(".."):
        return rel
    full = os.path.abspath(path)
    roots = [os.path.abspath(p) + os.sep for p in sys.path if p]
    inside = [root for root in roots if full.startswith(root)]
    return full[len(max(inside, key=len)) :] if inside else path


def _short_source(source: str | None) -> str:
    if source is None:
        return "?"
    match = re.fullmatch(r"(.*):(\d+ \(.*\))", source)
    if match is None:
        return source
    return f"{short_path(match[1])}:{match[2]}"
