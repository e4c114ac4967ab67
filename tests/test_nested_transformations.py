"""Implicit arrays created inside a transformation that runs inside `use_implicit_args`.

`jit`, `vmap`, `checkpoint`, `grad` and control-flow bodies that build implicit arrays
themselves: the handlers still apply, implicit outputs stay implicit, and a value that
escapes to plain JAX is materialized with a warning. Oracle: the same program on
materialized arrays.
"""

import functools

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import qax
from qax.symbols import SymbolicConstant
from tests.helpers import (
    ClosedZeros,
    Scaled,
    all_eqns,
    assert_close,
    materializations,
)


def _creates_zeros(x):
    z = ClosedZeros(shape=(3,))
    y = z * x  # a ClosedZeros, by its handler
    return jnp.sin(y) + x  # `jnp` on it must reach the handlers too


def _creates_constant(x):
    c = SymbolicConstant(2.0, shape=(3,)) * 3.0  # folded: a constant 6.0
    return jnp.sin(c) * x + jnp.cos(c)


def _returns_implicit(x):
    return jnp.sin(ClosedZeros(shape=(3,)) * x)  # a ClosedZeros, by the handlers


TRANSFORMS = {
    "jit": jax.jit,
    "vmap": jax.vmap,
    "checkpoint": jax.checkpoint,
    "grad": lambda f: jax.grad(lambda x: jnp.sum(f(x))),
}


def _input(name):
    return jnp.arange(6.0).reshape(2, 3) if name == "vmap" else jnp.arange(1.0, 4.0)


@pytest.mark.parametrize("name", list(TRANSFORMS))
@pytest.mark.parametrize("f", [_creates_zeros, _creates_constant])
def test_implicit_created_inside_nested_transformation(name, f):
    if name == "grad" and f is _creates_zeros:
        pytest.skip(
            "the derivative of sin needs cos, which ClosedZeros has no handler for"
        )
    transform, x = TRANSFORMS[name], _input(name)
    inside = qax.use_implicit_args(transform(f))(x)
    outside = transform(qax.use_implicit_args(f))(x)
    assert_close(inside, outside)
    assert_close(inside, transform(_dense_version(f))(x))


def _dense_version(f):
    """`f` with its implicit arrays replaced by the dense arrays they represent."""
    if f is _creates_zeros:
        return lambda x: jnp.sin(jnp.zeros(3) * x) + x
    return lambda x: jnp.sin(jnp.full(3, 6.0)) * x + jnp.cos(jnp.full(3, 6.0))


@pytest.mark.parametrize("name", ["jit", "checkpoint"])
def test_implicit_output_of_nested_transformation_stays_implicit(name):
    transform, x = TRANSFORMS[name], _input(name)
    inside = qax.use_implicit_args(transform(_returns_implicit))(x)
    outside = transform(qax.use_implicit_args(_returns_implicit))(x)
    assert isinstance(inside, ClosedZeros) and isinstance(outside, ClosedZeros)
    assert inside.shape == outside.shape == (3,)


def test_nested_jit_of_created_implicit_leaves_no_trace_in_jaxpr():
    jaxpr = jax.make_jaxpr(qax.use_implicit_args(jax.jit(_creates_zeros)))(
        _input("jit")
    )
    names = [e.primitive.name for e in all_eqns(jaxpr)]
    assert "qax_implicit" not in names
    assert "sin" not in names  # sin of the zeros was folded by the handler


def test_created_implicit_reaching_plain_jax_is_materialized_with_warning():
    # A jit traced inside `use_implicit_args` is reused outside of it: the value is
    # materialized there, with a warning that says so, and the numbers are right.
    f = jax.jit(_creates_zeros)
    x = _input("jit")
    assert_close(qax.use_implicit_args(f)(x), x)
    with materializations() as found:
        out = f(x)
    assert_close(out, x)
    assert any("outside of it" in msg for msg in found)


def test_created_implicit_from_differentiated_values_warns_and_is_right():
    def f(x):
        s = Scaled(x, 2.0)  # built from the differentiated input
        return jnp.sum(s * 3.0)

    x = _input("grad")
    with materializations() as found:
        got = qax.use_implicit_args(jax.grad(f))(x)
    assert_close(got, jnp.full(3, 6.0))
    assert any("jax.grad" in msg for msg in found)


def test_created_implicit_from_batched_values_warns_and_is_right():
    def f(x):
        return jnp.sum(Scaled(x, 2.0) * 3.0)

    xs = _input("vmap")
    with materializations() as found:
        got = qax.use_implicit_args(jax.vmap(f))(xs)
    assert_close(got, jnp.sum(xs, axis=1) * 6.0)
    assert any("jax.vmap" in msg for msg in found)


def _scan_creating(xs, g=_creates_zeros):
    def body(c, x):
        return c + g(x), None

    return lax.scan(body, jnp.zeros(3), xs)[0]


def _cond_creating(x, g=_creates_zeros):
    return lax.cond(x[0] > 0, g, jnp.cos, x)


def _while_creating(x, g=_creates_zeros):
    return lax.while_loop(lambda c: c[0] < 10.0, lambda c: g(c) + 1.0, x)


def _jit_of_scan_creating(xs, g=_creates_zeros):
    return jax.jit(functools.partial(_scan_creating, g=g))(xs)


@pytest.mark.parametrize(
    "f", [_scan_creating, _cond_creating, _while_creating, _jit_of_scan_creating]
)
def test_implicit_created_inside_control_flow_body(f):
    x = jnp.arange(6.0).reshape(2, 3) if "scan" in f.__name__ else jnp.arange(1.0, 4.0)
    expected = f(x, g=_dense_version(_creates_zeros))
    assert_close(qax.use_implicit_args(f)(x), expected)
    assert_close(jax.jit(qax.use_implicit_args(f))(x), expected)


_ORDER_SCRIPT = """
import sys
import jax
import jax.numpy as jnp
import numpy as np
import qax
from tests.helpers import ClosedZeros, Scaled


def creates(x):  # builds an implicit value inside a nested jit (through implicit_p)
    return jax.jit(lambda x: jnp.sin(ClosedZeros(shape=(3,)) * x) + x)(x)


def plain(w, x):  # implicit argument, nothing created inside
    return jax.jit(jnp.sin)(x) + w * x


x = jnp.arange(1.0, 4.0)
w = Scaled(jnp.arange(3.0), 2.0)
programs = {
    "creates": (creates, (x,)),
    "plain": (plain, (w, x)),
}
for name in sys.argv[1:]:
    f, args = programs[name]
    jaxpr = jax.make_jaxpr(qax.use_implicit_args(f))(*args)
    eager = qax.use_implicit_args(f)(*args)
    eager_again = qax.use_implicit_args(f)(*args)
    jitted = jax.jit(qax.use_implicit_args(f))(*args)
    print(name, jaxpr, np.asarray(eager).tolist(), np.asarray(eager_again).tolist(),
          np.asarray(jitted).tolist(), sep="\\n")
    print("--")
"""


def test_calls_behave_the_same_in_either_order():
    # Nothing a call leaves behind changes what a later call does: in fresh processes,
    # a program that creates implicit values inside a nested transformation and one
    # that does not give the same jaxprs and outputs whichever runs first.
    import json
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu"}

    def run(*order):
        proc = subprocess.run(
            [sys.executable, "-c", _ORDER_SCRIPT, *order],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        blocks = proc.stdout.split("--\n")[:-1]
        return {b.split("\n", 1)[0]: b for b in blocks}

    first = run("creates", "plain")
    second = run("plain", "creates")
    assert set(first) == {"creates", "plain"}
    assert first == second
    # and the outputs are the dense program's
    x = jnp.arange(1.0, 4.0)
    dense = {
        "creates": jnp.sin(jnp.zeros(3) * x) + x,
        "plain": jnp.sin(x) + 2.0 * jnp.arange(3.0) * x,
    }
    for name, block in first.items():
        for line in block.strip().split("\n")[-3:]:
            assert_close(jnp.array(json.loads(line)), dense[name])
