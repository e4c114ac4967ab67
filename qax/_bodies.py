"""Staged bodies, cached: the one place that answers "when is a body reused".

qax stages bodies on implicit values and reuses them: the structural rules
(`qax._rules`: `jit`, `checkpoint`, `cond`, loops) re-trace a body once per signature,
and the eager paths (`qax._eager`) compile what an eager operation did. Every one of
them keeps its bodies here, which decides:

- the key: what invalidates a body. Besides what the caller names (the operand
  signature, from `signature`), every key holds the handler generation
  (`qax._dispatch.generation`: registering a handler changes what a body does) and
  quiet mode (a body traced quietly recorded no reports); an entry also holds the
  JAX configuration it was staged under (`jit_context`), and is not reused under
  another.
- the reports: a body's materialization reports are stored with it and reported
  again on every hit (`reuse` does it; no caller replays by hand), with the source
  line of the code that runs it now.
- speculative builds: reports made while staging a body that may be thrown away
  (a `cond` branch or loop body staged again with more materialized, an eager
  operation staged to be compiled) are held (`speculative`), and reported only
  when the build is committed, those the first build did not report already.
- when: a rule's body is staged on the first call of a key and reused from the
  second (`reuse`, `keep`); an eager operation runs the ordinary way on its first
  sighting, is staged and compiled on its second unless its builder refuses, and runs
  compiled from then on (`sight`, `ready`).
- the bound: at most `LIMIT` bodies per anchor (a jaxpr, whose bodies go with it),
  the oldest dropped first, and `LIMIT` eager sightings (all dropped when full).

Nothing cached holds a tracer: a body whose constants are tracers is not kept.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import jax

from . import _dispatch
from ._base import quiet_materialization
from ._compat import ArrayImpl, jit_context, typeof
from ._report import holding_reports, replay

LIMIT = 4096


class _Entry:
    """A kept body, the reports it made while staged, the JAX configuration then."""

    __slots__ = ("body", "events", "context")

    def __init__(self, body: Any, events: list, context: tuple):
        self.body = body
        self.events = events
        self.context = context


# anchor (a jaxpr) -> {key: `_Entry`}.
_staged: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# The handler generation, bumped by every registration (read on every key).
_generation = _dispatch.generation


def signature(vals: Sequence, *extra: Any) -> tuple[tuple, list]:
    """The key of a body over `vals` (with `extra`), and their flat leaves."""
    flat, tree = jax.tree_util.tree_flatten(list(vals))
    key = (*extra, tree, tuple(map(_leaf_type, flat)))
    return (*key, _generation[0], quiet_materialization.get()), flat


def eager_key(head: Any, signatures: list) -> tuple:
    """The key of an eager operation `head` on operands of `signatures`."""
    return (head, _generation[0], quiet_materialization.get(), *signatures)


def _leaf_type(x: Any) -> Any:
    """What determines `typeof(x)` (computed directly for eager arrays: cheaper)."""
    if type(x) is ArrayImpl:
        return x.aval, x.sharding
    return typeof(x)


def reuse(anchor: Any, key: tuple) -> Any:
    """The body kept for `anchor` and `key`, its reports made again; None if none."""
    entries = _staged.get(anchor)
    if entries is None:
        return None
    entry = entries.get(key)
    if entry is None:
        return None
    return _current(entry.body, entry.events, entry.context)


def _current(body: Any, events: list, context: tuple | None) -> Any:
    """`body`, its reports made again, if it was staged under the JAX configuration
    now (`context`; None: any); else None."""
    if context is not None and context != jit_context():
        return None
    if events:
        replay(events)
    return body


def keep(
    anchor: Any, key: tuple, body: Any, events: list, cacheable: bool = True
) -> None:
    """Keep `body` (which reported `events` while staged) for `anchor` and `key`."""
    if not cacheable:
        return
    entries = _staged.get(anchor)
    if entries is None:
        entries = _staged[anchor] = {}
    elif len(entries) >= LIMIT:
        del entries[next(iter(entries))]
    entries[key] = _Entry(body, events, jit_context())


@contextlib.contextmanager
def speculative() -> Iterator[list]:
    """Hold the reports made inside, in the list it gives: a build that may be thrown
    away (see `commit`)."""
    held: list = []
    with holding_reports(held):
        yield held


def commit(held: list, reported: list) -> None:
    """Report the `held` reports of a build that is kept, but those in `reported`
    (made already, by a build before it), and add them to `reported`."""
    new = [e for e in held if e not in reported]
    replay(new)
    reported += new


# ----------------------------------------------------------------------------------------
# Eager bodies: compiled on their second sighting
#
# An eager operation (`qax._eager`) runs the ordinary way the first time it is seen with
# a signature, which notes what it did. The second time, it is staged and compiled,
# unless its builder refuses (it cannot be traced, or tracing changes what it does):
# then it keeps the ordinary path. Later calls run the compiled body.


class Sighting:
    """What is known of an eager operation with one key.

    Attributes:
      note: what its first, ordinary run did (the caller's record of it).
      events: the reports of that run (the caller records them), then those of the
        compiled body, made again on every run (`ready`).
      body: the compiled body, once built; None before.
      refused: the body could not be built: the operation keeps the ordinary path.
      context: the JAX configuration the body was staged under (None: any).
    """

    __slots__ = ("note", "events", "body", "refused", "context", "anchor")

    def __init__(self, anchor: Any = None):
        self.note: Any = None
        self.events: list = []
        self.body: Any = None
        self.refused = False
        self.context: tuple | None = None
        self.anchor = anchor  # a weak reference to the object a key names by id


# key -> `Sighting`. A plain dict: eager calls look it up on every operation, and a
# `WeakKeyDictionary` lookup costs more than the rest.
_sightings: dict[Any, Sighting] = {}


def sight(key: Any, anchor: Any = None) -> tuple[Sighting | None, bool]:
    """The `Sighting` of the eager operation `key` (None if `key` is unhashable), and
    whether this is its first sighting: then the caller runs it the ordinary way.

    With an `anchor`, `key` is `id(anchor)`: the entry goes when the anchor does.
    """
    try:
        sighting = _sightings.get(key)
    except TypeError:  # unhashable parameters
        return None, False
    if sighting is not None:
        if anchor is None or sighting.anchor() is anchor:
            return sighting, False
    if len(_sightings) >= LIMIT:
        _sightings.clear()
    ref = None if anchor is None else weakref.ref(anchor, _forget(key))
    sighting = _sightings[key] = Sighting(ref)
    return sighting, True


def _forget(key: Any, sightings: dict = _sightings):
    # `sightings` is bound now: at interpreter exit module globals are already gone.
    def callback(ref):
        sighting = sightings.get(key)
        if sighting is not None and sighting.anchor is ref:
            del sightings[key]

    return callback


def ready(sighting: Sighting) -> Any:
    """The compiled body of `sighting` to run now, its reports made again; None if it
    takes the ordinary path (refused, or staged under another JAX configuration)."""
    if sighting.body is None:
        return None
    return _current(sighting.body, sighting.events, sighting.context)


def sightings() -> dict[Any, Sighting]:
    """Every eager operation's `Sighting`, by key (for tests)."""
    return dict(_sightings)


def clear_caches() -> None:
    """Forget every staged body and eager sighting."""
    _staged.clear()
    _sightings.clear()
