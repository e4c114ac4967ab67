"""The route of a primitive is written once (`qax/_route.py`) and agrees with what runs.

`qax.explain` reports the steps of the route that act on given operands
(`Explanation.route`, `decides`, `then`); here each case runs the primitive under
`qax.use_implicit_args`, eagerly and jitted, and reads which steps ran from what they
leave behind: a `jax.debug.callback` in each handler, `default_handler` and
`materialize()` (run on every call, also when a body is reused), the materialization
warnings (a stack of examples says so in its own words) and the program's jaxpr (the
stored-field barrier, a `jit` kept as a `jit`). `apply_primitive`'s code and
docs/architecture.md name the same steps, in the same order.
"""

from __future__ import annotations

import dataclasses
import inspect
import pathlib
import re
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import qax
from qax import _interpreter, _route

ROOT = pathlib.Path(__file__).resolve().parent.parent
SEEN: list[str] = []


def note(name: str) -> None:
    """Record `name` on every run of the program that holds this call."""
    jax.debug.callback(lambda: SEEN.append(name))


def note_handler(implicit_first: bool) -> None:
    """Record that a handler ran, and whether it takes the implicit operand first."""
    note("handler")
    if implicit_first:
        note("implicit first")


class RouteEx(qax.ImplicitArray):
    default_dtype = jnp.float32

    def materialize(self):
        note("materialize")
        return jnp.full(self.shape, 2.0, self.dtype)


class RouteDefault(RouteEx):
    @classmethod
    def default_handler(cls, primitive, *args, params):
        note("default_handler")
        dense = [
            jnp.full(a.shape, 2.0, a.dtype) if isinstance(a, qax.ImplicitArray) else a
            for a in args
        ]
        return primitive.bind(*dense, **params)


@dataclasses.dataclass
class RouteStored(qax.ImplicitArray):
    """int8 codes (stored: they reach a product in their stored form) and a scale."""

    codes: qax.ArrayValue = qax.array_field(ndim=2, stored=True)
    scale: qax.ArrayValue = qax.array_field(ndim=0)

    def materialize(self):
        note("materialize")
        return self.codes.astype(jnp.float32) * self.scale


@dataclasses.dataclass
class RouteUndeclared(qax.ImplicitArray):
    """`x * s`; declares no batch axes, so a stack of examples skips its handlers."""

    x: qax.ArrayValue
    s: qax.ArrayValue

    def materialize(self):
        note("materialize")
        return self.x * self.s


@qax.primitive_handler("atan2")
def _route_atan2(primitive, a: RouteEx, b: jax.Array):
    note_handler(implicit_first=True)
    return jnp.full(jnp.broadcast_shapes(a.shape, b.shape), 1.0, a.dtype)


@qax.primitive_handler("mul")
def _route_mul(primitive, a: RouteEx, b: jax.Array):  # implicit first: swapped to
    note_handler(implicit_first=True)
    return 2.0 * b


@qax.primitive_handler("rem")
def _route_rem_declines(primitive, a: RouteEx, b: jax.Array):
    note_handler(implicit_first=True)
    return NotImplemented


@qax.primitive_handler("dot_general")
def _route_stored_dot(primitive, x: jax.Array, w: RouteStored, **params):
    note_handler(implicit_first=False)
    return qax.default_handler(
        primitive, x, w.codes.astype(jnp.float32) * w.scale, **params
    )


@qax.primitive_handler("mul")
def _route_undeclared_mul(primitive, a: RouteUndeclared, b: jax.Array):
    note_handler(implicit_first=True)  # right for one example only
    return a.x * a.s * b


X = jnp.linspace(0.5, 1.5, 3)
CODES = jnp.arange(12, dtype=jnp.int8).reshape(3, 4)
STACK = jax.vmap(RouteUndeclared)(jnp.ones((2, 3)), jnp.array([2.0, 3.0]))


def _dot(x, w):
    return lax.dot_general(x, w, (((1,), (0,)), ((), ())))


@dataclasses.dataclass(frozen=True)
class Case:
    """A primitive on implicit operands, and the operands `qax.explain` is asked
    about (in the order bound)."""

    name: str
    primitive: str
    operands: Callable[[], tuple]
    run: Callable
    declines: bool = False  # the handler chosen passes (returns NotImplemented)


CASES = [
    Case("handler", "atan2", lambda: (RouteEx(shape=(3,)), X), lax.atan2),
    Case("swapped handler", "mul", lambda: (X, RouteEx(shape=(3,))), lax.mul),
    Case(
        "NotImplemented falls back",
        "rem",
        lambda: (RouteEx(shape=(3,)), X),
        lax.rem,
        declines=True,
    ),
    Case(
        "structural rule", "jit", lambda: (RouteEx(shape=(3,)),), jax.jit(lambda w: w)
    ),
    Case("default handler", "cos", lambda: (RouteDefault(shape=(3,)),), lax.cos),
    Case("materialization", "cos", lambda: (RouteEx(shape=(3,)),), lax.cos),
    Case(
        "stored-field arrival",
        "dot_general",
        lambda: (jnp.ones((2, 3)), RouteStored(CODES, jnp.float32(0.5))),
        _dot,
    ),
    Case(
        "stacked examples",
        "mul",
        lambda: (STACK, jnp.ones((2, 3))),
        lax.mul,
    ),
]


def _observed(case: Case, jit: bool) -> tuple[str, ...]:
    """The steps that ran for `case`, read from what they leave behind."""
    args = case.operands()
    f = qax.use_implicit_args(case.run)
    if jit:
        f = jax.jit(f)
    SEEN.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", qax.MaterializationWarning)
        out = f(*args)
        jax.block_until_ready(jax.tree_util.tree_leaves(out))
        prims = set()
        if jit:  # the eqns of the program inside the outer `jit`
            (eqn,) = jax.make_jaxpr(f)(*args).jaxpr.eqns
            prims = {e.primitive.name for e in eqn.params["jaxpr"].jaxpr.eqns}
    jax.effects_barrier()
    seen = set(SEEN)
    messages = [
        str(w.message)
        for w in caught
        if issubclass(w.category, qax.MaterializationWarning)
    ]
    stacked = any("stacked by `jax.vmap`" in m for m in messages)
    materialized = any("stacked by `jax.vmap`" not in m for m in messages)
    assert materialized == ("materialize" in seen and not stacked), (messages, seen)
    steps = []
    # A handler that takes the implicit operand first ran on operands bound the other
    # way around.
    implicit = [isinstance(a, qax.ImplicitArray) for a in args]
    if implicit == [False, True] and "implicit first" in seen:
        steps.append("swap")
    if "qax_arrive" in prims:
        steps.append("arrival")
    if "handler" in seen:
        steps.append("handler")
    kept = isinstance(out, qax.ImplicitArray) and ("jit" in prims or not jit)
    if case.primitive == "jit" and kept and not seen:
        steps.append("rule")  # a `jit` of the leaves, whose result stays implicit
    if stacked:
        steps.append("stacked")
    if "default_handler" in seen:
        steps.append("default_handler")
    if materialized:
        steps.append("materialize")
    return tuple(steps)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_explain_reports_the_steps_that_run(case, jit):
    explanation = qax.explain(case.primitive, *case.operands())
    expected = explanation.route + (explanation.then if case.declines else ())
    if not jit:  # (stored fields arrive in staged programs only)
        expected = tuple(s for s in expected if s != "arrival")
    assert _observed(case, jit) == expected, str(explanation)
    assert explanation.decides == explanation.route[-1]


def test_every_step_of_the_route_is_exercised_and_reported():
    reported = set()
    for case in CASES:
        e = qax.explain(case.primitive, *case.operands())
        reported |= set(e.route) | set(e.then)
    assert reported == {s.name for s in _route.ROUTE}


def test_explain_names_steps_of_the_route_only_and_prints_them():
    names = [s.name for s in _route.ROUTE]
    e = qax.explain("rem", RouteEx, jax.Array)
    assert (e.route, e.decides, e.then) == (("handler",), "handler", ("materialize",))
    assert "Route: handler; if it passes: materialize" in str(e)
    e = qax.explain("mul", STACK, jax.Array)
    assert e.route == ("stacked",) and "No handler runs" in str(e)
    assert qax.explain("cos", jax.Array).route == ()
    for case in CASES:
        e = qax.explain(case.primitive, *case.operands())
        assert set(e.route + e.then) <= set(names)
        order = [names.index(s) for s in e.route + e.then]
        assert order == sorted(order), e.route + e.then


def test_apply_primitive_marks_the_steps_of_the_route_in_order():
    source = inspect.getsource(_interpreter.apply_primitive)
    marked = re.findall(r"# route: (\w+)", source)
    assert marked == [s.name for s in _route.ROUTE]
    assert "_route.ROUTE" in _interpreter.apply_primitive.__doc__


def test_the_architecture_page_shows_the_route():
    page = (ROOT / "docs" / "architecture.md").read_text()
    hooks = (ROOT / "docs" / "hooks.py").read_text()
    placeholder = "<!-- qax._route: steps -->"
    assert placeholder in page and repr(placeholder)[1:-1] in hooks
    # the hook's substitution, as mkdocs runs it
    namespace: dict = {}
    start = hooks.index("ROUTE_PLACEHOLDER =")
    end = hooks.index("def on_page_markdown")
    exec("import re\n" + hooks[start:end], namespace)  # noqa: S102 (our own file)
    rendered = namespace["route_markdown"](page)
    assert placeholder not in rendered
    for i, s in enumerate(_route.ROUTE, 1):
        assert f"   {i}. **{s.name}**: {s.summary}." in rendered
    # and the user's page lists as many steps
    handlers = (ROOT / "docs" / "concepts" / "handlers.md").read_text()
    section = handlers.split("## The fallback order")[1].split("\n## ")[0]
    assert len(re.findall(r"^\d+\. \*\*", section, flags=re.MULTILINE)) == len(
        _route.ROUTE
    )
