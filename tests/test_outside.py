"""Implicit arrays used outside `use_implicit_args`: nothing hangs, one rule applies.

Operators, methods, indexing and iteration go through the interpreter; conversions
(`np.asarray`, `jnp.asarray`, `bool`, `float`) materialize with a warning; `jnp` and
`jax.nn` functions raise an error naming `qax.use_implicit_args`.
"""

import contextlib
import signal
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qax
from tests.helpers import LoraMatrix, assert_close, make_lora

KEY = jax.random.PRNGKey(0)


@contextlib.contextmanager
def finishes_within(seconds: float):
    """Fail (instead of hanging the suite) if the body runs longer than `seconds`."""

    def on_alarm(signum, frame):
        raise TimeoutError(f"did not finish within {seconds}s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(autouse=True)
def no_test_hangs():
    # Before the fix, conversions of implicit arrays looped forever: fail instead.
    with finishes_within(120):
        yield


def lora():
    return make_lora(KEY, 4, 3)


@pytest.mark.parametrize(
    "convert",
    [np.asarray, np.array, jnp.asarray, jnp.array, jax.jit(jnp.asarray)],
    ids=["np.asarray", "np.array", "jnp.asarray", "jnp.array", "jit(jnp.asarray)"],
)
def test_conversions_materialize_with_a_warning(convert):
    w = lora()
    with finishes_within(30), pytest.warns(qax.MaterializationWarning, match="dense"):
        out = convert(w)
    assert out.shape == w.shape
    assert_close(out, w.materialize())


def test_numpy_conversion_of_traced_values_names_the_wrapper():
    with pytest.raises(TypeError, match="qax.use_implicit_args"):
        jax.jit(lambda w: np.asarray(w))(lora())


def test_iteration_yields_len_rows():
    w = lora()
    with finishes_within(30), pytest.warns(qax.MaterializationWarning):
        rows = list(w)
    assert len(rows) == len(w) == 4
    assert_close(jnp.stack(rows), w.materialize())


class Wrapped(qax.ImplicitArray):
    """The array `x` itself, with no handlers."""

    x: qax.ArrayValue

    def materialize(self):
        return self.x


def test_iteration_over_0d_is_an_error():
    with pytest.raises(TypeError, match="0-d"):
        iter(Wrapped(jnp.ones(())))


@pytest.mark.parametrize(
    "index", [4, -5, (0, 3), (4, slice(None))], ids=["4", "-5", "(0,3)", "(4,:)"]
)
def test_index_past_the_end_raises_index_error(index):
    with pytest.raises(IndexError, match="out of bounds"):
        lora()[index]


def test_index_in_range_still_works():
    w = lora()
    with pytest.warns(qax.MaterializationWarning):
        assert_close(w[-4], w.materialize()[0])
        assert_close(w[1, 2], w.materialize()[1, 2])


@pytest.mark.parametrize(
    "fn",
    [
        jnp.sin,
        jax.nn.relu,
        jax.nn.gelu,
        jax.nn.softmax,
        lambda w: jnp.dot(jnp.ones(4), w),
    ],
    ids=["jnp.sin", "relu", "gelu", "softmax", "jnp.dot"],
)
def test_jnp_functions_name_the_type_and_the_wrapper(fn):
    with pytest.raises(TypeError, match=r"LoraMatrix.*qax\.use_implicit_args"):
        fn(lora())


def test_jnp_function_error_names_the_function():
    with pytest.raises(TypeError, match=r"`jnp\.sin` received a LoraMatrix"):
        jnp.sin(lora())


def test_operators_with_a_jax_array_on_the_left_still_use_handlers():
    # JAX's operators ask for `__jax_array__`; they must not get it, or `x @ w` would
    # densify instead of reaching the LoRA handler through `w.__rmatmul__`.
    w, x = lora(), jnp.ones((2, 4))
    with qax.materialization_policy(LoraMatrix, "error"):
        assert_close(x @ w, x @ w.materialize())
    assert not hasattr(w, "__jax_array__")


def test_scalar_conversions():
    w = lora()
    scalar = Wrapped(jnp.full((1, 1), 2.0))
    with pytest.warns(qax.MaterializationWarning):
        assert float(scalar) == 2.0
        assert int(scalar) == 2
        assert bool(scalar) is True
    with pytest.raises(ValueError, match="ambiguous"):
        bool(w)
    with pytest.raises(TypeError, match="length-1"):
        float(w)


def test_flax_linen_layer_without_the_wrapper_finishes():
    nn = pytest.importorskip("flax.linen")
    w, x = lora(), jnp.ones((2, 4))
    params = {"params": {"kernel": w, "bias": jnp.zeros(3)}}
    for apply in (nn.Dense(3).apply, jax.jit(nn.Dense(3).apply)):
        with finishes_within(60), pytest.warns(qax.MaterializationWarning):
            out = apply(params, x)
        assert_close(out, x @ w.materialize())


def test_nnx_assigning_an_implicit_array_into_a_variable_finishes():
    nnx = pytest.importorskip("flax.nnx")
    w = lora()
    layer = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    with finishes_within(60), pytest.warns(qax.MaterializationWarning):
        layer.kernel[...] = w
    assert_close(layer.kernel[...], w.materialize())


def test_policy_error_applies_to_conversions():
    with qax.materialization_policy(LoraMatrix, "error"):
        with pytest.raises(qax.MaterializationError):
            np.asarray(lora())


def test_inside_the_wrapper_nothing_changes():
    w, x = lora(), jnp.ones((2, 4))

    def f(w, x):
        return jnp.sin(x @ w)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_close(qax.use_implicit_args(f)(w, x), f(w.materialize(), x))
