"""Eager (un-jitted) calls: the fast paths give what the ordinary paths give.

Outside `jax.jit`, qax skips JAX's Python staging where it can: operators on implicit
tracers bind the `jit` remembered for their operand types, `jnp` calls on plain arrays
run a compiled copy of their jaxpr, and bodies that only forward values skip XLA. These
tests compare every fast path with the computation on materialized arrays, and check
that nothing is cached that must not be (scalar values, JAX's configuration, handler
registrations, Python side effects, warnings).
"""

import operator
import pathlib
import sys
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qax
from qax import _bodies, _eager
from qax.symbols import SymbolicConstant
from tests.helpers import (
    ClosedZeros,
    Doubled,
    PeekingDoubled,
    Scaled,
    Zeros,
    assert_close,
    make_lora,
)

X = jnp.arange(12.0).reshape(3, 4) - 5.0

BINARY = {
    "add": operator.add,
    "sub": operator.sub,
    "mul": operator.mul,
    "truediv": operator.truediv,
    "pow": operator.pow,
    "lt": operator.lt,
    "ge": operator.ge,
    "eq": operator.eq,
}


def _thrice(f, *args):
    """`f(*args)` three times: the first call takes the ordinary paths, the second
    compiles the lanes of what it saw twice, the third runs them."""
    return [f(*args) for _ in range(3)]


def _lanes(head) -> list:
    """The compiled lanes whose operation is `head` (a primitive or an operator name)."""
    return [
        sighting.body
        for sighting in _states(head)
        if isinstance(sighting.body, _eager._Lane)
    ]


@pytest.mark.parametrize("name", list(BINARY), ids=list(BINARY))
@pytest.mark.parametrize("side", ["implicit_left", "implicit_right"])
def test_operators_match_dense(name, side):
    op = BINARY[name]
    c = SymbolicConstant(2.0, shape=(3, 4), dtype=jnp.float32)
    if side == "implicit_left":
        f = qax.use_implicit_args(lambda c, x: op(c, x))
        expected = op(jnp.full((3, 4), 2.0), X)
    else:
        f = qax.use_implicit_args(lambda c, x: op(x, c))
        expected = op(X, jnp.full((3, 4), 2.0))
    for got in _thrice(f, c, X):
        assert_close(qax.materialize_nested(got, full=True), expected)
    if side == "implicit_left":  # (`jax.Array`'s operator runs first on the right)
        assert _lanes(name), "the third call ran a compiled lane"


@pytest.mark.parametrize("name", ["neg", "abs", "pos"])
def test_unary_operators_match_dense(name):
    op = getattr(operator, name)
    c = SymbolicConstant(-3.0, shape=(2,), dtype=jnp.float32)
    f = qax.use_implicit_args(op)
    for got in _thrice(f, c):
        assert isinstance(got, SymbolicConstant)
        assert_close(got.materialize(), op(jnp.full((2,), -3.0)))


def test_scalar_operand_values_are_not_cached():
    """`c * 2.0` and `c * 3.0` share operand types, not results."""
    c = SymbolicConstant(1.5, shape=(2,), dtype=jnp.float32)
    f = qax.use_implicit_args(lambda c, s: c * s)
    for s in (2.0, 3.0, 2.0, -0.0, 0.0):
        got = f(c, s)
        assert isinstance(got, SymbolicConstant)
        assert got.value == 1.5 * s
        assert np.signbit(got.value) == np.signbit(1.5 * s)


def test_operator_reruns_handlers_and_python_side_effects():
    calls = []

    def f(z, x):
        calls.append(1)  # a Python side effect of the user's function
        return z * x + x

    f_implicit = qax.use_implicit_args(f)
    for _ in range(3):
        got = f_implicit(Zeros(shape=(3, 4)), X)
        assert_close(got, X)
    assert len(calls) == 3


def test_operator_follows_jax_configuration():
    """Cached under one rank-promotion mode, still refused under "raise"."""
    z = Zeros(shape=(3, 4))
    row = jnp.ones((4,))
    f = qax.use_implicit_args(lambda z, r: z * r)
    _thrice(f, z, row)
    with jax.numpy_rank_promotion("raise"):
        with pytest.raises(ValueError, match="rank_promotion"):
            f(z, row)


def test_operator_sees_new_handlers():
    """A handler registered after an operator was cached applies to the next call."""

    class Tagged(qax.ImplicitArray):
        default_dtype = jnp.float32

        def materialize(self):
            return jnp.ones(self.shape, self.dtype)

    t = Tagged(shape=(3, 4))
    f = qax.use_implicit_args(lambda t, x: t * x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qax.MaterializationWarning)
        for got in _thrice(f, t, X):
            assert_close(got, X)

    @qax.primitive_handler("mul")
    def tagged_mul(primitive, a: Tagged, b: jax.Array):
        return b * 2.0

    assert_close(f(t, X), 2.0 * X)


def test_materialization_warns_on_every_call():
    lora = make_lora(jax.random.PRNGKey(0))
    f = qax.use_implicit_args(lambda w: w + 1.0)
    for _ in range(3):
        with pytest.warns(qax.MaterializationWarning):
            got = f(lora)
        assert_close(got, lora.materialize() + 1.0)


def test_operator_on_implicit_array_outside_use_implicit_args():
    z = Zeros(shape=(3, 4))
    for _ in range(3):
        got = z * X
        assert isinstance(got, Zeros)
        assert got.shape == (3, 4)
        assert_close(z + X, X)


def test_forwarding_body_returns_the_operand():
    """`zeros + x` compiles to a body without equations: no XLA call, same values."""
    f = qax.use_implicit_args(lambda z, x: jnp.add(z, x))
    for got in _thrice(f, Zeros(shape=(3, 4)), X):
        assert_close(got, X)


def test_plain_jnp_calls_inside_match_dense():
    lora = make_lora(jax.random.PRNGKey(1))
    x = jax.random.normal(jax.random.PRNGKey(2), (4, 6))

    def model(w, x):
        h = jnp.tanh(x @ w)
        scores = jnp.einsum("ij,kj->ik", h, h)
        return jax.nn.softmax(scores, axis=-1).sum(axis=0) + jnp.mean(h)

    f = qax.use_implicit_args(model)
    expected = model(lora.materialize(), x)
    for _ in range(3):
        assert_close(f(lora, x), expected, rtol=1e-4, atol=1e-5)


def test_user_jit_with_donation_and_shardings_inside():
    """`jit`s with non-default parameters keep JAX's own eager path."""
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    g = jax.jit(lambda a, b: a * b + 1.0, out_shardings=sharding)
    h = jax.jit(lambda a: a - 1.0, donate_argnums=0)

    def f(z, x):
        return h(g(x, x)) + z

    f_implicit = qax.use_implicit_args(f)
    for _ in range(3):
        assert_close(f_implicit(Zeros(shape=(3, 4)), X), X * X)


def test_eager_caches_do_not_grow_over_calls():
    lora = make_lora(jax.random.PRNGKey(3))
    x = jnp.ones((2, 6))

    def f(w, x, z):
        return jnp.sum(jax.nn.relu(x @ w) * 2.0), z * 3.0

    f_implicit = qax.use_implicit_args(f)
    z = Zeros(shape=(3,))
    for _ in range(3):
        f_implicit(lora, x, z)
    sizes = len(_bodies.sightings())
    for _ in range(20):
        f_implicit(lora, x, z)
    assert len(_bodies.sightings()) == sizes


def test_effects_inside_jits_run_on_every_call(capsys):
    g = jax.jit(lambda a: (jax.debug.print("seen {}", a.sum()), a * 2.0)[1])
    f = qax.use_implicit_args(lambda z, x: g(x) + z)
    for _ in range(3):
        assert_close(f(Zeros(shape=(3, 4)), X), 2.0 * X)
    jax.effects_barrier()
    assert capsys.readouterr().out.count("seen") == 3


def test_warm_jit_caches_do_not_bypass_implicit_operands():
    """Calls compiled at top level, then made inside with an implicit operand of the
    same shape: the implicit operand still reaches its handler."""
    g = jax.jit(lambda a, b: a * b + b)
    x = jnp.full((3, 4), 3.0)
    assert_close(g(x, X), 4.0 * X)  # compiled for f32[3,4] at top level
    assert_close(jnp.multiply(x, X), 3.0 * X)

    def f(z, x):
        return g(z, x), jnp.multiply(z, x), g(x, x), jnp.multiply(x, x)

    f_implicit = qax.use_implicit_args(f)
    with qax.materialization_policy(Zeros, "error"):
        for _ in range(3):
            via_jit, product, plain_jit, plain = f_implicit(Zeros(shape=(3, 4)), x)
            assert isinstance(product, Zeros)
            assert_close(via_jit, x)
            assert_close(plain_jit, x * x + x)
            assert_close(plain, x * x)


# -- plain `jit` calls at top level are not slowed down by eager qax calls ----------------
#
# JAX's C++ `jit` cache keeps, per signature and current trace, a compiled call or a mark
# "stage in Python" (for a call first made under a trace). The eager `ImplicitTrace` has
# a key of its own: its calls must never mark the entries that top-level calls use.
# These tests count the calls that JAX stages in Python (its C++ path missed) per jitted
# function, by watching JAX's staging function: the only private name the tests rely on.
# Tracer-leak checking (on in this suite) gives each eager call a trace of its own: it is
# off here, as in users' programs.


def _staging_code():
    from jax._src import pjit

    code = getattr(getattr(pjit, "_run_python_pjit", None), "__code__", None)
    assert code is not None, "JAX's staging function moved: update _StagedCalls"
    return code


class _StagedCalls:
    """Counts, per function, the `jit` calls that JAX stages in Python."""

    def __init__(self):
        self.counts: dict = {}
        self.code = _staging_code()

    def _profile(self, frame, event, arg):
        if event == "call" and frame.f_code is self.code:
            fun = frame.f_locals["fun"]
            self.counts[fun] = self.counts.get(fun, 0) + 1

    def __enter__(self):
        self.counts.clear()
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)

    def of(self, jitted) -> int:
        return self.counts.get(jitted.__wrapped__, 0)


def _fresh_jit(scale):
    # A new function per test: the C++ cache is keyed on the function object.
    return jax.jit(lambda a, b: a * scale + b)


def test_staged_calls_counter_counts():
    """The counter sees a first call (so that the tests below cannot pass vacuously)."""
    g = _fresh_jit(2.0)
    with _StagedCalls() as staged:
        g(X, X)
        g(X, X)
    assert staged.of(g) == 1


def test_eager_calls_leave_top_level_jit_calls_fast():
    """The first call of `g` for a signature happens inside an eager call: at top level
    it takes JAX's C++ path from its first top-level call on."""
    g = _fresh_jit(3.0)
    y = jnp.ones((3, 4))
    f = qax.use_implicit_args(lambda z, x, y: g(x, y) + z)
    with jax.check_tracer_leaks(False):
        for _ in range(2):
            assert_close(f(Zeros(shape=(3, 4)), X, y), 3.0 * X + 1.0)
        assert_close(g(X, y), 3.0 * X + 1.0)  # the first call at top level
        with _StagedCalls() as staged:
            for _ in range(3):
                assert_close(g(X, y), 3.0 * X + 1.0)
                f(Zeros(shape=(3, 4)), X, y)  # eager calls in between
        assert staged.of(g) == 3  # the eager calls' only


def _signatures():
    """Arguments of one function, with different C++ signatures each."""
    device = jax.devices()[0]
    return [
        (X, jnp.ones((3, 4))),
        (jnp.arange(5.0), 1.0),  # a Python scalar
        (jnp.arange(5.0), np.float32(2.0)),  # a NumPy scalar
        (np.ones((2, 2), np.float32), jnp.ones((2, 2))),  # a NumPy array
        (jax.device_put(X, device), jnp.zeros((3, 4))),  # a committed array
        (jnp.asarray(1.5, dtype=jnp.float32) + 1, jnp.ones(())),
        (jax.lax.full((2,), 4.0, jnp.float32), 0.5),
    ]


def test_alternating_signatures_inside_and_outside():
    """Signatures first seen inside eager calls: right results inside and at top level,
    and top-level calls stay on the C++ path."""
    g = _fresh_jit(0.5)
    calls = _signatures()
    weak = jnp.asarray(2.0) * 1  # a weakly typed array (from a Python scalar)
    assert weak.weak_type
    calls.append((weak, jnp.ones(())))

    def f(z, calls):
        return [g(a, b) + z for a, b in calls]

    f_implicit = qax.use_implicit_args(f)
    with jax.check_tracer_leaks(False):
        expected = [0.5 * np.asarray(a) + np.asarray(b) for a, b in calls]
        for call in calls:  # each signature first seen alone, in its own eager call
            f_implicit(Zeros(shape=()), [call])
        for a, b in calls:
            g(a, b)  # first top-level calls
        for _ in range(2):
            outs = f_implicit(Zeros(shape=()), calls)
            for out, want in zip(outs, expected, strict=True):
                assert_close(out, want)
        with _StagedCalls() as staged:
            for (a, b), want in zip(calls, expected, strict=True):
                assert_close(g(a, b), want)
        assert staged.of(g) == 0


def test_jit_calls_with_effects_run_once_per_call_with_a_shared_trace(capsys):
    g = jax.jit(lambda a: (jax.debug.print("seen {}", a.sum()), a * 2.0)[1])
    f = qax.use_implicit_args(lambda z, x: g(x) + z)
    with jax.check_tracer_leaks(False):
        for _ in range(3):
            assert_close(f(Zeros(shape=(3, 4)), X), 2.0 * X)
        jax.effects_barrier()
    assert capsys.readouterr().out.count("seen") == 3


def test_donating_jit_calls_inside_an_eager_call():
    g = jax.jit(lambda a, b: a * 2.0 + b, donate_argnums=0)
    f = qax.use_implicit_args(lambda z, x: g(x + 1.0, x) + z)
    with jax.check_tracer_leaks(False):
        for _ in range(3):
            assert_close(f(Zeros(shape=(3, 4)), X), 3.0 * X + 2.0)
        assert_close(g(X + 1.0, X), 3.0 * X + 2.0)


def test_jit_errors_inside_an_eager_call_are_raised_unchanged():
    g = jax.jit(lambda a, b: a @ b)
    f = qax.use_implicit_args(lambda z, x: g(x, x) + z)
    with jax.check_tracer_leaks(False), pytest.raises(TypeError, match="dot_general"):
        f(Zeros(shape=(3, 4)), X)


def test_eager_calls_in_threads():
    """Threads make first calls of one function (several signatures) at the same time:
    all results right, nobody waits forever on another thread's compile."""
    g = _fresh_jit(-1.0)
    calls = _signatures()
    expected = [-np.asarray(a) + np.asarray(b) for a, b in calls]
    f_implicit = qax.use_implicit_args(lambda z, calls: [g(a, b) + z for a, b in calls])
    failures = []

    def work(order):
        try:
            with jax.check_tracer_leaks(False):
                for i in order * 3:
                    out = f_implicit(Zeros(shape=()), [calls[i]])[0]
                    np.testing.assert_allclose(out, expected[i], rtol=1e-6)
        except Exception as e:  # noqa: BLE001 (reported below)
            failures.append(e)

    indices = list(range(len(calls)))
    threads = [
        threading.Thread(target=work, args=(order,), daemon=True)
        for order in (indices, indices[::-1], indices[1::2] + indices[::2])
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "a thread hangs"
    assert not failures, failures


def test_eager_lora_model_leaves_the_hand_written_model_fast():
    """A GPT with LoRA weights (`benchmarks/bench_lora.py`, sizes of its own) run eagerly:
    the same loss as hand-written LoRA, and the hand-written model run eagerly afterwards
    at top level stages nothing in Python from its second call on (its first calls are
    made after qax's, with the same `jnp` functions and signatures)."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_lora

    cfg = bench_lora.Config(
        n_layers=1, d_model=32, n_heads=2, d_ff=32, vocab=32, seq=8, batch=2, rank=4
    )
    variants, tokens = bench_lora.build_variants(cfg, scan=False)
    qax_variant, hand = variants["qax"], variants["hand"]
    with jax.check_tracer_leaks(False):
        first = qax_variant.loss(qax_variant.params, tokens)
        second = qax_variant.loss(qax_variant.params, tokens)
        hand.loss(hand.params, tokens)
        with _StagedCalls() as staged:
            plain = hand.loss(hand.params, tokens)
    want = jax.jit(hand.loss)(hand.params, tokens)
    assert_close(first, want)
    assert_close(second, want)
    assert_close(plain, want)
    assert sum(staged.counts.values()) == 0, staged.counts


def test_nested_user_jit_keeps_donation_on_implicit_operands():
    """A user's `jit` with donation, called eagerly on an implicit operand, donates on
    every call (it must not be taken for an inlined `jnp` wrapper: JAX > 0.10 keeps
    `inline` as an always-truthy enum)."""
    g = jax.jit(lambda z, x: z * x + 1.0, donate_argnums=1)
    f = qax.use_implicit_args(lambda z, x: g(z, x))
    c = SymbolicConstant(2.0, shape=(3, 4), dtype=jnp.float32)
    for _ in range(3):
        x = jnp.ones((3, 4)) * 2.0
        assert_close(f(c, x), jnp.full((3, 4), 5.0))
        assert x.is_deleted()


_SWITCHED_OFF = """
import warnings
import jax, jax.numpy as jnp, numpy as np
import qax
from qax import _bodies, _compat, _eager
from tests.helpers import LoraMatrix, make_lora

warnings.simplefilter("error", qax.MaterializationWarning)
assert not _eager.ENABLED
lora = make_lora(jax.random.key(0), 6, 5, 2, cls=LoraMatrix)
x = jnp.arange(12.0).reshape(2, 6)
seen = []

def f(w, x):
    seen.append(type(_compat.current_trace()).__name__)
    return jnp.sin(x @ w) * 2.0 + x.sum()

got = qax.use_implicit_args(f)(lora, x)
want = f(lora.materialize(), x)
np.testing.assert_allclose(got, want, rtol=1e-5)
assert seen[0] == "ImplicitTrace", seen
assert not _bodies.sightings()
print("ok")
"""


def test_the_fast_paths_switch_off():
    """`QAX_EAGER_FAST_PATHS=0`: eager calls run on a plain `ImplicitTrace` (as under a
    transformation), nothing is cached, and the answers are the same."""
    import os
    import subprocess

    root = pathlib.Path(__file__).parent.parent
    env = {**os.environ, "QAX_EAGER_FAST_PATHS": "0", "PYTHONPATH": str(root)}
    done = subprocess.run(
        [sys.executable, "-c", _SWITCHED_OFF],
        capture_output=True,
        text=True,
        env=env,
        cwd=root,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


# ----------------------------------------------------------------------------------------
# Lanes: an operation seen a second time with the same signature is traced and compiled


def _states(head) -> list:
    """The sightings of the operation `head` (its lanes, compiled or not)."""
    return [
        sighting
        for key, sighting in _bodies.sightings().items()
        if isinstance(key, tuple) and key[0][0] == head
    ]


def test_primitive_lane_matches_dense_and_stays_implicit():
    f = qax.use_implicit_args(lambda d, x: jax.lax.mul(jax.lax.mul(d, x), x))
    for got in _thrice(f, Doubled(X), X):
        assert isinstance(got, Doubled)
        assert_close(got.materialize(), 2 * X * X * X)
    assert _lanes(jax.lax.mul_p)


def test_lane_results_feed_the_next_lane_and_everything_else():
    """A lane's result goes to the next lane as leaves; a `jnp` function, a primitive
    that materializes and the function's output see the value it stands for."""

    def f(d, x):
        y = (d * x) * x
        return y, jnp.multiply(d * x, x), jax.lax.mul(y, x), -y

    f_implicit = qax.use_implicit_args(f)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qax.MaterializationWarning)  # (-y)
        results = _thrice(f_implicit, Doubled(X), X)
    for got, product, z, neg in results:
        assert isinstance(got, Doubled) and isinstance(z, Doubled)
        assert isinstance(product, Doubled)
        assert_close(got.materialize(), 2 * X**3)
        assert_close(product.materialize(), 2 * X**3)
        assert_close(z.materialize(), 2 * X**4)
        assert_close(neg, -2 * X**3)


def test_handler_that_reads_values_keeps_the_ordinary_path():
    """A handler that reads concrete values cannot be traced: no lane, and every call
    answers for its own values (implicit for non-negative ones, else materialized)."""
    f = qax.use_implicit_args(lambda d, x: jax.lax.mul(d, x))
    d = PeekingDoubled(X)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qax.MaterializationWarning)
        for x in (jnp.abs(X), X, jnp.abs(X), X, jnp.abs(X)):
            got = f(d, x)
            assert isinstance(got, PeekingDoubled) == bool(jnp.all(x >= 0))
            assert_close(qax.materialize_nested(got, full=True), 2 * X * x)
    assert any(sighting.refused for sighting in _states(jax.lax.mul_p))


def test_lane_refused_where_tracing_changes_what_handlers_do():
    """`max(zeros, c)` stays symbolic for a known `c <= 0`; traced, the handler cannot
    see `c` and would materialize. Such a lane is refused: no warning on any call."""
    z = ClosedZeros(shape=(3, 4))
    f = qax.use_implicit_args(lambda z, c: jax.lax.max(z, c))
    with warnings.catch_warnings():
        warnings.simplefilter("error", qax.MaterializationWarning)
        for got in _thrice(f, z, jnp.full((3, 4), -1.0)):
            assert isinstance(got, ClosedZeros)
    assert not _lanes(jax.lax.max_p)


def test_lane_reports_its_materializations_on_every_call():
    lora = make_lora(jax.random.PRNGKey(4))
    f = qax.use_implicit_args(jax.lax.sin)
    for _ in range(4):
        with qax.materialization_audit() as audit:
            with pytest.warns(qax.MaterializationWarning):
                got = f(lora)
        assert len(audit.records) == 1
        assert_close(got, jnp.sin(lora.materialize()))
    assert _lanes(jax.lax.sin_p)
    with qax.materialization_policy(type(lora), "error"):
        with pytest.raises(qax.MaterializationError):
            f(lora)


def test_python_scalar_leaves_are_traced_not_baked():
    """A Python float inside an implicit operand is a leaf: calls with other values
    share the lane and still get their own answers."""
    f = qax.use_implicit_args(lambda s, x: jax.lax.mul(s, x))
    x = jnp.float32(4.0)
    for scale in (1.5, 2.5, -0.5, 3.0):
        got = f(Scaled(jnp.float32(2.0), scale), x)
        assert isinstance(got, Scaled)
        assert_close(got.materialize(), 2.0 * scale * 4.0)


def test_primitive_lane_sees_new_handlers():
    class Halved(Doubled):
        def materialize(self):
            return self.x / 2

    f = qax.use_implicit_args(lambda h, x: jax.lax.mul(h, x))
    for got in _thrice(f, Halved(X), X):  # the `Doubled` handler: a new `Halved`
        assert_close(got.materialize(), X * X / 2)

    @qax.primitive_handler("mul")
    def halved_mul(primitive, a: Halved, b: jax.Array):
        return jax.lax.mul(a.x, b) / 2

    got = f(Halved(X), X)
    assert not isinstance(got, Halved)
    assert_close(got, X * X / 2)


def test_no_lanes_without_jit():
    f = qax.use_implicit_args(lambda d, x: jax.lax.mul(d * x, x))
    with jax.disable_jit():
        for got in _thrice(f, Doubled(X), X):
            assert_close(got.materialize(), 2 * X**3)
    for got in _thrice(f, Doubled(X), X):  # and lanes afterwards
        assert_close(got.materialize(), 2 * X**3)
    assert _lanes(jax.lax.mul_p)
