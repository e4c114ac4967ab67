"""Eager (un-jitted) calls: the fast paths give what the ordinary paths give.

Outside `jax.jit`, qax skips JAX's Python staging where it can: operators on implicit
tracers bind the `jit` remembered for their operand types, `jnp` calls on plain arrays
run a compiled copy of their jaxpr, and bodies that only forward values skip XLA. These
tests compare every fast path with the computation on materialized arrays, and check
that nothing is cached that must not be (scalar values, JAX's configuration, handler
registrations, Python side effects, warnings).
"""

import gc
import operator
import pathlib
import sys
import threading
import warnings
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qax
from qax import _compat, _interpreter
from qax.symbols import SymbolicConstant
from tests.helpers import Zeros, assert_close, make_lora

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


def _twice(f, *args):
    """`f(*args)` twice: the first call fills the caches, the second uses them."""
    first = f(*args)
    second = f(*args)
    return first, second


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
    for got in _twice(f, c, X):
        assert_close(qax.materialize_nested(got, full=True), expected)
    if side == "implicit_left":  # the second call took the remembered `jit`
        assert any(key[0] == name for key in _interpreter._operator_binds)


@pytest.mark.parametrize("name", ["neg", "abs", "pos"])
def test_unary_operators_match_dense(name):
    op = getattr(operator, name)
    c = SymbolicConstant(-3.0, shape=(2,), dtype=jnp.float32)
    f = qax.use_implicit_args(op)
    for got in _twice(f, c):
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
    _twice(f, z, row)
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
        for got in _twice(f, t, X):
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
    for got in _twice(f, Zeros(shape=(3, 4)), X):
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
    sizes = (len(_interpreter._eager_jits), len(_interpreter._operator_binds))
    for _ in range(20):
        f_implicit(lora, x, z)
    assert (len(_interpreter._eager_jits), len(_interpreter._operator_binds)) == sizes


def test_effects_inside_jits_run_on_every_call(capsys):
    g = jax.jit(lambda a: (jax.debug.print("seen {}", a.sum()), a * 2.0)[1])
    f = qax.use_implicit_args(lambda z, x: g(x) + z)
    for _ in range(3):
        assert_close(f(Zeros(shape=(3, 4)), X), 2.0 * X)
    jax.effects_barrier()
    assert capsys.readouterr().out.count("seen") == 3


def test_warm_jit_caches_do_not_bypass_implicit_operands():
    """The eager trace keys `jit` caches as the eval trace does (`share_jit_key`).

    Calls compiled at top level are then reused inside for plain operands; a call with
    an implicit operand of the same shape must still reach its handler.
    """
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


def test_eager_trace_shares_the_top_level_jit_key():
    """Plain `jnp` calls inside an eager call hit what the same calls compiled outside.

    A jitted function's C++ cache holds one entry per (signature, `jit` key): calls
    inside add none. (With tracer-leak checking on, each eager call gets a trace of its
    own, so the harness's setting is turned off here.)
    """
    h = jax.jit(lambda a: jnp.sin(a) * 2.0)
    with jax.check_tracer_leaks(False):
        h(X)
        assert h._cache_size() == 1
        f = qax.use_implicit_args(lambda z, x: h(x) + z)
        for _ in range(3):
            assert_close(f(Zeros(shape=(3, 4)), X), jnp.sin(X) * 2.0)
        assert h._cache_size() == 1


# -- first `jit` calls inside an eager call are made at top level ----------------------
#
# JAX's C++ `jit` cache marks an entry "stage in Python" for good when its first call is
# made under a trace. With the eager trace sharing the eval trace's `jit` key, that would
# slow down the same calls at top level too; qax makes such first calls at top level
# (`qax._compat.run_jit_at_top_level`). These tests count the calls that JAX stages in
# Python (its C++ path missed) per jitted function. Tracer-leak checking (on in this
# suite) gives each eager call a trace of its own, which shares nothing: it is off here.


class _StagedCalls:
    """Counts, per function, the `jit` calls that JAX stages in Python."""

    def __init__(self):
        self.counts: dict = {}
        self.plain: list[str] = []  # functions staged with plain operands only

    def _profile(self, frame, event, arg):
        if event == "call" and frame.f_code is _compat._RUN_PYTHON_JIT:
            fun = frame.f_locals["fun"]
            self.counts[fun] = self.counts.get(fun, 0) + 1
            if not any(
                isinstance(a, jax.core.Tracer) for a in frame.f_locals["args_flat"]
            ):
                self.plain.append(getattr(fun, "__name__", repr(fun)))

    def __enter__(self):
        assert _compat._RUN_PYTHON_JIT is not None, "JAX's staging function moved"
        self.counts.clear()
        self.plain.clear()
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)

    def of(self, jitted) -> int:
        return self.counts.get(jitted.__wrapped__, 0)


def _fresh_jit(scale):
    # A new function per test: the C++ cache is keyed on the function object.
    return jax.jit(lambda a, b: a * scale + b)


def test_plain_jit_calls_inside_an_eager_call_take_the_fast_path():
    g = _fresh_jit(2.0)
    y = jnp.ones((3, 4))
    f = qax.use_implicit_args(lambda z, x, y: g(x, y) + z)
    with jax.check_tracer_leaks(False):
        assert_close(f(Zeros(shape=(3, 4)), X, y), 2.0 * X + 1.0)
        with _StagedCalls() as staged:
            for _ in range(3):
                assert_close(f(Zeros(shape=(3, 4)), X, y), 2.0 * X + 1.0)
        assert staged.of(g) == 0


def test_eager_calls_leave_top_level_jit_calls_fast():
    """The first call of `g` for a signature happens inside: at top level it stays on
    JAX's C++ path afterwards (it was staged in Python on every call before)."""
    g = _fresh_jit(3.0)
    y = jnp.ones((3, 4))
    f = qax.use_implicit_args(lambda z, x, y: g(x, y) + z)
    with jax.check_tracer_leaks(False):
        f(Zeros(shape=(3, 4)), X, y)
        with _StagedCalls() as staged:
            for _ in range(3):
                assert_close(g(X, y), 3.0 * X + 1.0)
        assert staged.of(g) == 0
        assert g._cache_size() == 1


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


def test_alternating_signatures_all_stay_on_the_fast_path():
    """Making a first call at top level drops the function's other C++ entries; those
    qax made before are made again (with stand-in arguments), inside and outside."""
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
        with _StagedCalls() as staged:
            for _ in range(2):
                outs = f_implicit(Zeros(shape=()), calls)
                for out, want in zip(outs, expected, strict=True):
                    assert_close(out, want)
            for (a, b), want in zip(calls, expected, strict=True):
                assert_close(g(a, b), want)
        assert staged.of(g) == 0


def test_jnp_functions_that_make_a_jit_per_call_stay_fast():
    """`jnp.einsum` makes a new `jit` of one function per call: its signatures share
    one C++ cache, and alternating them inside an eager call keeps them all."""
    a, b = jnp.ones((2, 3, 4)), jnp.ones((2, 4, 5))

    def f(z, a, b):
        return (
            jnp.einsum("bij,bjk->bik", a, b) + z,
            jnp.einsum("bij,bij->b", a, a),
            jnp.einsum("bjk,bjk->bk", b, b),
        )

    f_implicit = qax.use_implicit_args(f)
    with jax.check_tracer_leaks(False):
        f_implicit(Zeros(shape=(2, 3, 5)), a, b)
        with _StagedCalls() as staged:
            outs = f_implicit(Zeros(shape=(2, 3, 5)), a, b)
        assert_close(outs[0], a @ b)
        assert_close(outs[1], jnp.full((2,), 12.0))
        assert_close(outs[2], jnp.full((2, 5), 4.0))
        staged_fns = {getattr(fn, "__name__", "") for fn in staged.counts}
        assert "_einsum" not in staged_fns, staged.counts


def test_jit_calls_with_effects_run_once_per_call_with_a_shared_key(capsys):
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


def test_first_calls_at_top_level_keep_nothing_alive_and_do_not_grow():
    """What qax keeps of a function's first calls holds no argument array and not the
    function (JAX's C++ cache holds it weakly too), and stops growing."""
    g = _fresh_jit(1.0)
    f = qax.use_implicit_args(lambda z, x, g: g(x, x) + z)
    with jax.check_tracer_leaks(False):
        x = jnp.ones((3, 4)) * 2.0
        ref = weakref.ref(x)
        assert_close(f(Zeros(shape=(3, 4)), x, g), 2.0 * x)
        del x
        gc.collect()
        assert ref() is None

        made = _compat._made[g.__wrapped__]
        counts = [len(m.signatures) for m in made.values()]
        assert counts == [1]
        for _ in range(5):
            f(Zeros(shape=(3, 4)), jnp.ones((3, 4)), g)
        assert [len(m.signatures) for m in made.values()] == counts

        fun = weakref.ref(g.__wrapped__)
        del g, made
        gc.collect()
        assert fun() is None


def test_eager_calls_in_threads_share_the_top_level_calls():
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


def test_eager_lora_model_stages_only_calls_with_implicit_operands():
    """A GPT with LoRA weights (`benchmarks/bench_lora.py`, sizes of its own) run eagerly:
    the same loss as hand-written LoRA, and from the second call on JAX stages in Python
    only the calls that have an implicit operand (the LoRA matmuls)."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_lora

    cfg = bench_lora.Config(
        n_layers=1, d_model=32, n_heads=2, d_ff=32, vocab=32, seq=8, batch=2, rank=4
    )
    variants, tokens = bench_lora.build_variants(cfg, scan=False)
    qax_variant, hand = variants["qax"], variants["hand"]
    with jax.check_tracer_leaks(False):
        # (qax first: the hand-written loss would make the plain calls at top level)
        first = qax_variant.loss(qax_variant.params, tokens)
        with _StagedCalls() as staged:
            second = qax_variant.loss(qax_variant.params, tokens)
    want = jax.jit(hand.loss)(hand.params, tokens)
    assert_close(first, want)
    assert_close(second, want)
    assert staged.plain == []
    assert 0 < sum(staged.counts.values()) <= 2 * (cfg.n_layers * 6 + 1)


def test_jits_made_before_clear_caches_are_left_to_jax():
    """After `jax.clear_caches()`, `jit` objects made before keep a C++ cache of their
    own that qax cannot reach: after a few misses qax leaves them to JAX (one Python
    staging per call, as without the fast path), and `jit`s made after still share."""
    before = _fresh_jit(4.0)
    y = jnp.ones((3, 4))
    f = qax.use_implicit_args(lambda z, x, y, g: g(x, y) + z)
    with jax.check_tracer_leaks(False):
        f(Zeros(shape=(3, 4)), X, y, before)
        jax.clear_caches()
        after = _fresh_jit(5.0)
        for _ in range(_compat._MAX_REPEATS + 2):
            assert_close(f(Zeros(shape=(3, 4)), X, y, before), 4.0 * X + 1.0)
            assert_close(f(Zeros(shape=(3, 4)), X, y, after), 5.0 * X + 1.0)
        with _StagedCalls() as staged:
            assert_close(f(Zeros(shape=(3, 4)), X, y, before), 4.0 * X + 1.0)
            assert_close(f(Zeros(shape=(3, 4)), X, y, after), 5.0 * X + 1.0)
        assert staged.of(before) == 1
        assert staged.of(after) == 0


def test_jits_with_many_signatures_are_left_to_jax():
    """Past `_MAX_SIGNATURES` signatures of one `jit` (a growing shape, say), qax leaves
    it to JAX: results stay right and each call is staged once, not more."""
    g = _fresh_jit(3.0)
    f = qax.use_implicit_args(lambda z, x: g(x, x) + z)
    sizes = range(1, _compat._MAX_SIGNATURES + 3)
    with jax.check_tracer_leaks(False):
        for n in sizes:
            x = jnp.arange(float(n))
            assert_close(f(Zeros(shape=(n,)), x), 4.0 * x)
        (made,) = _compat._made[g.__wrapped__].values()
        assert made.off
        with _StagedCalls() as staged:
            for n in sizes:
                x = jnp.arange(float(n))
                assert_close(f(Zeros(shape=(n,)), x), 4.0 * x)
        assert staged.of(g) <= len(sizes)
