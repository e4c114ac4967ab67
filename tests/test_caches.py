"""`qax.clear_caches`: every module-level cache is empty afterwards, handlers registered
before it still apply, and a body staged before it is not reused."""

import functools
import importlib
import pkgutil
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import qax
from qax import _implicit_array, _report
from qax.symbols import SymbolicConstant
from tests.helpers import Scaled, assert_close, make_lora, materializations

# Module-level containers that are not caches: registries, rule tables, constants.
# `qax.clear_caches` must leave them as they are.
NOT_CACHES = {
    ("qax._compat", "primitive_jvps"): "JAX's own JVP table",
    ("qax._compat", "PARAM_LAYOUTS"): "a constant",
    ("qax._audit", "_global_rules"): "policies the user set",
    ("qax._base", "enter_built"): "a hook filled at import",
    ("qax._dispatch", "_ALIASES"): "a constant",
    ("qax._dispatch", "_HINTS"): "a constant",
    ("qax._dispatch", "_functions"): "the registered handlers",
    ("qax._dispatch", "generation"): "a counter (bumped, not emptied)",
    ("qax._dispatch", "primitive_rules"): "a rule table",
    ("qax._dispatch", "function_rules"): "a rule table",
    ("qax._dispatch", "custom_jvp_rules"): "a rule table",
    ("qax._dispatch", "custom_vjp_rules"): "a rule table",
    ("qax._explain", "_MARKS"): "a constant",
    ("qax._explain", "_OUTCOME_ORDER"): "a constant",
    ("qax._integrations", "_waiting"): "registrations waiting for a library",
    ("qax._layout", "_CALLS"): "a constant",
    ("qax._integrations", "classes"): "registered classes",
    ("qax._integrations", "dataclasses_by_type"): "registered classes",
    ("qax._rules.sharding", "_SINGLE"): "a constant",
    ("qax._rules.sharding", "_MULTI"): "a constant",
    ("qax.quant._params", "_FORMATS"): "the registered formats",
    ("qax.quant._calibrate", "_SINKS"): "the calibrations running now",
    ("qax.symbols", "_LOSSLESS"): "a constant",
    ("qax.symbols", "_FOLDED_UNARY"): "a constant",
    ("qax.symbols", "_MOVING"): "a constant",
    ("qax.symbols", "_nans"): "interns NaNs: equal constants keep equal treedefs",
    ("qax.testing", "_DEFAULT_TOLERANCE"): "a constant",
}
_CONTAINERS = (
    dict,
    list,
    set,
    weakref.WeakKeyDictionary,
    weakref.WeakValueDictionary,
    weakref.WeakSet,
)


def _qax_modules() -> list:
    modules = [qax]
    for info in pkgutil.walk_packages(qax.__path__, "qax."):
        try:
            modules.append(importlib.import_module(info.name))
        except ImportError:  # an optional dependency (Flax, orbax) is missing
            continue
    return modules


def _module_caches() -> dict[str, object]:
    """Every module-level container and `functools` cache of the package, by the
    name it has where it is defined (imported aliases of one object count once)."""
    allowed = set()
    found = {}
    modules = _qax_modules()
    for module in modules:
        for name, value in vars(module).items():
            if (module.__name__, name) in NOT_CACHES:
                allowed.add(id(value))
    for module in modules:
        for name, value in vars(module).items():
            if name.startswith("__") or id(value) in allowed:
                continue
            if isinstance(value, (*_CONTAINERS, functools._lru_cache_wrapper)):
                found.setdefault(id(value), (f"{module.__name__}.{name}", value))
    return dict(found.values())


def _size(cache) -> int:
    if isinstance(cache, functools._lru_cache_wrapper):
        return cache.cache_info().currsize
    return len(cache)


def _class_caches() -> dict[str, dict]:
    """The per-class caches of `materialize()`'s shape."""
    found = {}
    classes = [qax.ImplicitArray]
    while classes:
        cls = classes.pop()
        classes += cls.__subclasses__()
        cache = cls.__dict__.get(_implicit_array._SHAPES)
        if cache is not None:
            found[cls.__qualname__] = cache
    return found


class Tripled(qax.ImplicitArray):
    """``3 * x``, never formed while a handler covers `mul`."""

    x: qax.ArrayValue

    def materialize(self):
        return 3 * self.x


@qax.primitive_handler("mul")
def _tripled_mul(primitive, a: Tripled, b: jax.Array):
    return Tripled(lax.mul(a.x, b))


def _warm_up():
    """Calls that fill qax's caches: eager lanes and `jit`s, re-traced bodies, folded
    constants, batching, and the built-in types."""
    lora = make_lora(jax.random.PRNGKey(0))
    x = jnp.ones((3, 6))

    def model(w, x):
        y = x @ w
        y = lax.cond(y.sum() > 0, lambda v: v * 2.0, lambda v: v, y)
        return lax.scan(lambda c, r: (c + r, r), jnp.zeros(5), y)[0]

    for _ in range(3):
        qax.use_implicit_args(model)(lora, x)
        qax.use_implicit_args(lambda t, y: t * y)(Tripled(jnp.ones(3)), jnp.ones(3))
    jax.jit(qax.use_implicit_args(model))(lora, x)
    jax.grad(lambda w: qax.use_implicit_args(model)(w, x).sum())(lora)
    jax.vmap(qax.use_implicit_args(lambda w, x: x @ w), in_axes=(None, 0))(
        lora, jnp.ones((2, 3, 6))
    )
    c = SymbolicConstant(2.0, shape=(3,), dtype=jnp.float32)
    qax.use_implicit_args(lambda c: jnp.exp(c) * 3 + c)(c)
    w = jnp.asarray(np.random.default_rng(0).normal(size=(64, 64)), jnp.float32)
    fq = qax.qat.fake_quantize({"w": w}, "int8")["w"]
    jax.grad(lambda w: qax.use_implicit_args(lambda w: (jnp.ones(64) @ w).sum())(w))(fq)


def test_clear_caches_empties_every_module_level_cache():
    _warm_up()
    caches = _module_caches()
    full = {name for name, cache in caches.items() if _size(cache)}
    # The warm-up reaches the caches that matter (the test is not vacuous).
    for name in (
        "qax._dispatch._cache",
        "qax._interpreter._expected_cache",
        "qax._bodies._sightings",
        "qax._eager._signatures",
        "qax._bodies._staged",
        "qax.symbols._avals",
    ):
        assert name in full, f"the warm-up did not fill {name}"
    assert any(map(len, _class_caches().values()))

    qax.clear_caches()

    left = {name: _size(c) for name, c in _module_caches().items() if _size(c)}
    assert not left, (
        f"qax.clear_caches() left {left}: clear them in qax/_caches.py's _CLEARS, or "
        "name them in NOT_CACHES with the reason they are not caches"
    )
    shapes = {name: len(c) for name, c in _class_caches().items() if c}
    assert not shapes, f"materialize() shape caches left: {shapes}"


def test_clear_caches_calls_nothing_of_jax(monkeypatch):
    def refuse():
        raise AssertionError("qax.clear_caches() called JAX's clear_caches")

    monkeypatch.setattr(jax, "clear_caches", refuse)
    _warm_up()
    qax.clear_caches()


def _tripled_product(t, y):
    return t * y


def test_handlers_registered_before_clear_caches_still_apply():
    t, y = Tripled(jnp.arange(3.0)), jnp.full(3, 2.0)
    f = qax.use_implicit_args(_tripled_product)
    for _ in range(3):
        f(t, y)
    jax.jit(f)(t, y)
    qax.clear_caches()
    # "error": a materialization (no handler found) would raise.
    with qax.materialization_policy(Tripled, "error"):
        for _ in range(3):  # the ordinary path, then the lane's compilation and run
            assert_close(f(t, y).x, t.x * y)
        fresh = qax.use_implicit_args(lambda t, y: t * y)
        assert_close(jax.jit(fresh)(t, y).x, t.x * y)
        jaxpr = jax.make_jaxpr(qax.use_implicit_args(lambda t, y: t * y))(t, y)
    assert [e.primitive.name for e in jaxpr.eqns] == ["convert_element_type", "mul"]


class Scaled3(Tripled):
    """A type of its own for the re-registration below (other tests keep theirs)."""


@qax.primitive_handler("mul")
def _scaled3_mul(primitive, a: Scaled3, b: jax.Array):
    return Scaled3(lax.mul(a.x, b))


def test_no_body_staged_before_clear_caches_runs_after_it():
    t, y = Scaled3(jnp.arange(3.0)), jnp.full(3, 2.0)
    f = qax.use_implicit_args(_tripled_product)
    inner = jax.jit(_tripled_product)  # a nested jit: a re-traced, cached body
    g = qax.use_implicit_args(lambda t, y: inner(t, y))
    for _ in range(3):  # lanes and bodies staged with the first handler
        assert_close(f(t, y).x, t.x * y)
        assert_close(g(t, y).x, t.x * y)

    @qax.primitive_handler("mul", precedence=1)
    def _scaled3_mul_plus_one(primitive, a: Scaled3, b: jax.Array):
        return Scaled3(lax.mul(a.x, b) + 1)

    qax.clear_caches()
    with qax.materialization_policy(Scaled3, "error"):
        for _ in range(3):
            assert_close(f(t, y).x, t.x * y + 1)
            assert_close(g(t, y).x, t.x * y + 1)
        # A function JAX has not traced yet (JAX's own caches keep a traced one).
        fresh = qax.use_implicit_args(lambda t, y: inner(t, y))
        assert_close(jax.jit(fresh)(t, y).x, t.x * y + 1)


@pytest.mark.parametrize("name", ["clear_caches"])
def test_clear_caches_is_public(name):
    assert name in qax.__all__
    assert getattr(qax, name).__doc__


# ----------------------------------------------------------------------------------------
# The staged-body cache (`qax._bodies`): what a reused body does


def _sin_everywhere(w, x):
    y = jax.jit(jnp.sin)(w) + x  # `Scaled` has no `sin` handler: materialized
    y = lax.cond(x.sum() > 0, jnp.cos, jnp.sin, w) + y
    return lax.scan(lambda c, r: (c + jnp.sin(r), None), x, w)[0] + y


def test_reused_bodies_report_on_every_call():
    # Eagerly, the jit, cond and scan bodies are staged once and then reused (the jit
    # compiled); their materializations are reported on every call all the same.
    w = Scaled(jnp.arange(6.0).reshape(2, 3), 2.0)
    x = jnp.arange(3.0)
    dense = _sin_everywhere(w.materialize(), x)
    f = qax.use_implicit_args(_sin_everywhere)
    counts = []
    for _ in range(4):
        with materializations() as found:
            assert_close(f(w, x), dense)
        counts.append(len(found))
    assert counts[0] >= 3, counts  # one per body at least
    assert counts == [counts[0]] * 4, counts


def test_a_body_staged_quietly_reports_when_reused_loudly():
    # Quiet mode (qax's own bookkeeping) is part of a body's key: a body staged quietly
    # recorded no reports, and is not the one a later, reported call reuses.
    w = Scaled(jnp.arange(3.0), 2.0)
    g = jax.jit(lambda w: jnp.sin(w) * 2.0)
    f = qax.use_implicit_args(g)
    with _report.quietly(), materializations() as found:
        assert_close(f(w), jnp.sin(w.materialize()) * 2.0)
    assert not found
    for _ in range(3):
        with materializations() as found:
            assert_close(f(w), jnp.sin(w.materialize()) * 2.0)
        assert len(found) == 1, found
