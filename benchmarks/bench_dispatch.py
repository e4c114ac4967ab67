"""Per-op eager dispatch cost of qax, and tracing a model whose biases are symbolic zeros.

Part 1, eager ops: each op runs as ``qax.use_implicit_args(op)(implicit, ...)`` outside any
`jax.jit` and is compared with the same computation written on dense arrays (what a user
would write without qax), and, where that differs, with the bare dense op:

- ``x @ lora``: the `dot_general` handler (three matmuls) vs ``x @ w + (x @ a) @ b.T``;
- ``lora + 1``: no handler, so the LoRA is materialized (the warning is part of the cost);
- ``jnp.sum(zeros + x)``: an `add` handler returning ``x``;
- ``zeros * x``: a `mul` handler returning a new `Zeros` (no array op at all);
- ``jnp.exp(x)``: no implicit argument, i.e. the bare cost of the wrapper.

Part 2, symbolic zeros while tracing: `jax.make_jaxpr` of the GPT-style model of
`bench_lora.py` (dense weights) whose biases are all `Zeros` (with `add`, `mul` and
`broadcast_in_dim` handlers defined here) vs the same model with dense zero biases.

Run from the repository root:

    PYTHONPATH=. python benchmarks/bench_dispatch.py [--quick]
"""

from __future__ import annotations

import argparse
import operator
import os
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import (  # noqa: E402
    fmt_seconds,
    interleaved,
    markdown_table,
    median,
    paired_ratio,
)
from bench_lora import (  # noqa: E402
    Config,
    LoraMatrix,
    dense_linear,
    fresh,
    init_params,
    make_loss,
)

import qax  # noqa: E402
from qax._compat import (  # noqa: E402 (benchmark-only diagnostic)
    Trace,
    bind_with_trace,
    current_trace,
    set_current_trace,
)

# ----------------------------------------------------------------------------------------
# A symbolic zero type (public qax API only)


class Zeros(qax.ImplicitArray):
    """An all-zero array that is never stored."""

    default_dtype = jnp.float32

    def materialize(self):
        return jnp.zeros(self.shape, self.dtype)


# Handlers see `lax` primitives, whose operands already share one shape and dtype
# (`jnp` broadcasts and promotes before binding), so they need not compute either
# (`jnp.result_type` alone costs about as much as a small eager op).


@qax.primitive_handler("add")
def zeros_add(primitive, a: Zeros, b: qax.ArrayValue):
    return b


@qax.primitive_handler("mul")
def zeros_mul(primitive, a: Zeros, b: qax.ArrayValue):
    return Zeros(shape=a.shape, dtype=a.dtype)


@qax.primitive_handler("broadcast_in_dim")
def zeros_broadcast(primitive, a: Zeros, *, shape, broadcast_dimensions, sharding):
    return Zeros(shape=shape, dtype=a.dtype)


class Doubled(qax.ImplicitArray):
    """``2 * x``, never formed: one array field, its shape derived from `materialize()`."""

    x: qax.ArrayValue

    def materialize(self):
        return self.x * 2


class DoubledShaped(Doubled):
    """`Doubled` that computes its shape and dtype itself."""

    def compute_shape(self):
        return self.x.shape

    def compute_dtype(self):
        return self.x.dtype


@qax.primitive_handler("mul")
def doubled_mul(primitive, a: Doubled, b: jax.Array):
    return type(a)(lax.mul(a.x, b))  # (2x) * b = 2 (x * b): a new one-field value


# ----------------------------------------------------------------------------------------
# Part 1: eager ops


class PassThroughTrace(Trace):
    """A trace that forwards every primitive to its parent unchanged.

    Not part of qax: it measures the floor that *any* interpreter built on JAX's stackless
    traces pays in eager mode (a `jax.jit`-ed function called under a non-eval trace
    takes JAX's Python dispatch path instead of its C++ fast path).
    """

    def __init__(self, parent):
        super().__init__()
        self.parent_trace = parent
        self.requires_low = False

    def process_primitive(self, primitive, tracers, params):
        return bind_with_trace(self.parent_trace, primitive, tracers, params)


def pass_through(f):
    """`f` run under a new pass-through trace per call (grows JAX's jit cache)."""

    def run(*args):
        with set_current_trace(PassThroughTrace(current_trace())):
            return f(*args)

    return run


_shared_pass_through: dict[int, PassThroughTrace] = {}


def floor(f):
    """`f` run under one shared pass-through trace (as qax shares its eager trace)."""

    def run(*args):
        parent = current_trace()
        trace = _shared_pass_through.get(id(parent))
        if trace is None or trace.parent_trace is not parent:
            trace = _shared_pass_through[id(parent)] = PassThroughTrace(parent)
        with set_current_trace(trace):
            return f(*args)

    return run


def _ready(f):
    return lambda: jax.block_until_ready(f())


def _warm_up(fn, warmup: int = 3):
    # Every call of a jitted function under a new trace adds an entry to JAX's C++ jit
    # cache (keyed on the trace); see `drift_rows`. The caches are not cleared first:
    # after `jax.clear_caches()`, `jit` objects made before (every `jnp` function) no
    # longer share their C++ cache with new ones, which is not what a program sees.
    for _ in range(warmup):
        fn()


def eager_rows(reps: int, inner: int) -> list[list[str]]:
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    n, d, r = 8, 64, 4
    x = jax.random.normal(keys[0], (n, d))
    w = jax.random.normal(keys[1], (d, d))
    a = jax.random.normal(keys[2], (d, r))
    b = jax.random.normal(keys[3], (d, r))
    lora = LoraMatrix(w, a, b)
    zeros, zeros_dense = Zeros(shape=(n, d)), jnp.zeros((n, d))
    implicit = qax.use_implicit_args

    # name -> (qax call, the same computation on dense arrays)
    cases = {
        "x @ lora": (
            lambda: implicit(lambda x, m: x @ m)(x, lora),
            lambda x, w, a, b: x @ w + (x @ a) @ b.T,
        ),
        "lora + 1 (materializes)": (
            lambda: implicit(lambda m: m + 1)(lora),
            lambda x, w, a, b: (w + a @ b.T) + 1,
        ),
        "jnp.sum(zeros + x)": (
            lambda: implicit(lambda z, x: jnp.sum(z + x))(zeros, x),
            lambda x, w, a, b: jnp.sum(zeros_dense + x),
        ),
        "zeros * x": (
            lambda: implicit(lambda z, x: z * x)(zeros, x),
            lambda x, w, a, b: zeros_dense * x,
        ),
        "jnp.exp(x) (no implicit arg)": (
            lambda: implicit(jnp.exp)(x),
            lambda x, w, a, b: jnp.exp(x),
        ),
    }
    rows = []
    for name, (with_qax, dense) in cases.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            expected = dense(x, w, a, b)
            got = qax.materialize_nested(with_qax(), full=True)
            np.testing.assert_allclose(
                got, expected, rtol=1e-4, atol=1e-4, err_msg=name
            )
        materializes = any(
            issubclass(c.category, qax.MaterializationWarning) for c in caught
        )
        fns = {
            "qax": _ready(with_qax),
            "dense": _ready(lambda f=dense: f(x, w, a, b)),
            "floor": _ready(lambda f=dense: floor(f)(x, w, a, b)),
        }
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", qax.MaterializationWarning)
            times = interleaved(fns, reps, warmup=3, inner=inner)
        rows.append(
            [
                name,
                fmt_seconds(median(times["qax"])),
                fmt_seconds(median(times["dense"])),
                f"{paired_ratio(times, 'qax', 'dense'):.2f}",
                fmt_seconds(median(times["floor"])),
                f"{paired_ratio(times, 'floor', 'dense'):.2f}",
                f"{paired_ratio(times, 'qax', 'floor'):.2f}",
                "yes" if materializes else "no",
            ]
        )
    return rows


def sequential_rows(reps: int, n_ops: int) -> list[list[str]]:
    """`n_ops` dependent ops on a symbolic zero inside one eager call, per op.

    The implicit operand stays a `Zeros` from op to op; the dense version runs the same
    ops on `jnp.zeros`. This is the per-op cost of eager code (one trace entry for the
    whole loop), without the entry cost of `use_implicit_args` that the table above
    includes.
    """
    x = jax.random.normal(jax.random.PRNGKey(0), (8, 64))
    zeros, zeros_dense = Zeros(shape=x.shape), jnp.zeros(x.shape)

    def chain(op):
        def run(z, x):
            for _ in range(n_ops):
                z = op(z, x)
            return z

        return run

    one = jnp.ones(x.shape)
    cases = {
        "lax.mul(z, x)": (lax.mul, zeros, zeros_dense, Zeros),
        "z * x": (operator.mul, zeros, zeros_dense, Zeros),
        "lax.mul(d, x), d one-field, shape from materialize": (
            lax.mul,
            Doubled(one),
            2 * one,
            Doubled,
        ),
        "d * x, d one-field, shape from materialize": (
            operator.mul,
            Doubled(one),
            2 * one,
            Doubled,
        ),
        "lax.mul(d, x), d one-field, compute_shape": (
            lax.mul,
            DoubledShaped(one),
            2 * one,
            DoubledShaped,
        ),
        "d * x, d one-field, compute_shape": (
            operator.mul,
            DoubledShaped(one),
            2 * one,
            DoubledShaped,
        ),
    }
    rows = []
    for name, (op, implicit, dense, cls) in cases.items():
        f = chain(op)
        got = qax.use_implicit_args(f)(implicit, x)
        assert type(got) is cls, name  # stayed implicit
        # (atol: compiled and eager code differ in flushing denormals to zero)
        np.testing.assert_allclose(
            got.materialize(), f(dense, x), rtol=1e-5, atol=1e-30
        )
        fns = {
            "qax": _ready(lambda f=f, i=implicit: qax.use_implicit_args(f)(i, x)),
            "dense": _ready(lambda f=f, d=dense: f(d, x)),
            "floor": _ready(lambda f=f, d=dense: floor(f)(d, x)),
        }
        times = interleaved(fns, reps, warmup=3)
        rows.append(
            [
                name,
                fmt_seconds(median(times["qax"]) / n_ops),
                fmt_seconds(median(times["dense"]) / n_ops),
                f"{paired_ratio(times, 'qax', 'dense'):.2f}",
                fmt_seconds(median(times["floor"]) / n_ops),
                f"{paired_ratio(times, 'floor', 'dense'):.2f}",
            ]
        )
    return rows


def drift_rows(calls: int) -> list[list[str]]:
    """An eager op timed on fresh caches, and again after `calls` earlier calls."""
    x = jnp.ones((8, 64))
    zeros = Zeros(shape=x.shape)
    cases = {
        "use_implicit_args(jnp.exp)(x)": lambda: qax.use_implicit_args(jnp.exp)(x),
        "use_implicit_args(z * x + x)": lambda: qax.use_implicit_args(
            lambda z, x: z * x + x
        )(zeros, x),
        "new pass-through trace per call, jnp.exp(x)": lambda: pass_through(jnp.exp)(x),
        "jnp.exp(x)": lambda: jnp.exp(x),
    }

    def per_call(fn, k):
        start = time.perf_counter()
        for _ in range(k):
            jax.block_until_ready(fn())
        return (time.perf_counter() - start) / k

    rows = []
    for name, fn in cases.items():
        _warm_up(fn)
        first = per_call(fn, 200)
        per_call(fn, calls)
        later = per_call(fn, 200)
        rows.append(
            [name, fmt_seconds(first), fmt_seconds(later), f"{later / first:.2f}"]
        )
    jax.clear_caches()
    return rows


# ----------------------------------------------------------------------------------------
# Part 2: tracing with symbolic-zero biases

BIASES = ("bias", "b1", "b2")


def zero_biases(params: dict, symbolic: bool) -> dict:
    def convert(path, leaf):
        if getattr(path[-1], "key", None) not in BIASES:
            return leaf
        return (
            Zeros(shape=leaf.shape, dtype=leaf.dtype)
            if symbolic
            else jnp.zeros_like(leaf)
        )

    return jax.tree_util.tree_map_with_path(convert, params)


def tracing_rows(cfg: Config, reps: int) -> list[list[str]]:
    params = init_params(cfg, jax.random.PRNGKey(0), stacked=False)
    tokens = jax.random.randint(
        jax.random.PRNGKey(1), (cfg.batch, cfg.seq + 1), 0, cfg.vocab
    )
    loss = make_loss(cfg, dense_linear, scan=False)
    qax_loss = qax.use_implicit_args(loss)
    dense_p, zeros_p = zero_biases(params, False), zero_biases(params, True)

    def weights_only(p):
        return {k: v for k, v in p.items() if k in ("wte", "wpe", "head")}

    def grad_of(f, p):
        # Gradient wrt a few dense weights; the biases are closed over.
        return lambda: jax.make_jaxpr(fresh(jax.grad(lambda w: f({**p, **w}, tokens))))(
            weights_only(p)
        )

    with warnings.catch_warnings():
        warnings.simplefilter("error", qax.MaterializationWarning)
        np.testing.assert_allclose(
            jax.jit(qax_loss)(zeros_p, tokens),
            jax.jit(loss)(dense_p, tokens),
            rtol=1e-5,
        )
        jaxprs = {
            "dense": jax.make_jaxpr(loss)(dense_p, tokens),
            "Zeros": jax.make_jaxpr(qax_loss)(zeros_p, tokens),
        }
    rows = []
    cases = {
        "make_jaxpr forward": {
            "dense": lambda: jax.make_jaxpr(fresh(loss))(dense_p, tokens),
            "Zeros": lambda: jax.make_jaxpr(fresh(qax_loss))(zeros_p, tokens),
            "wrapper": lambda: jax.make_jaxpr(fresh(qax_loss))(dense_p, tokens),
        },
        "make_jaxpr grad (weights)": {
            "dense": grad_of(loss, dense_p),
            "Zeros": grad_of(qax_loss, zeros_p),
            "wrapper": grad_of(qax_loss, dense_p),
        },
    }
    for label, fns in cases.items():
        with warnings.catch_warnings():
            warnings.simplefilter("error", qax.MaterializationWarning)
            times = interleaved(fns, reps)
        rows.append(
            [
                label,
                fmt_seconds(median(times["dense"])),
                fmt_seconds(median(times["Zeros"])),
                f"{paired_ratio(times, 'Zeros', 'dense'):.3f}",
                fmt_seconds(median(times["wrapper"])),
                f"{paired_ratio(times, 'wrapper', 'dense'):.3f}",
            ]
        )
    n_eqns = {k: len(j.jaxpr.eqns) for k, j in jaxprs.items()}
    rows.append(
        [
            "top-level jaxpr equations (forward)",
            str(n_eqns["dense"]),
            str(n_eqns["Zeros"]),
            "",
            "",
            "",
        ]
    )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few repetitions")
    args = parser.parse_args(argv)
    if args.quick:
        cfg, eager_reps, inner, drift, trace_reps = (
            Config(n_layers=2, seq=32, batch=4),
            5,
            10,
            500,
            5,
        )
        n_ops = 50
    else:
        cfg, eager_reps, inner, drift, trace_reps = Config(), 15, 20, 3000, 15
        n_ops = 200

    print(
        f"JAX {jax.__version__} on {jax.devices()[0].platform}, {os.cpu_count()} CPUs"
    )
    print(
        "times: medians; ratios: medians of per-repetition ratios "
        f"(eager: {eager_reps} x {inner} calls after warm-up calls; "
        f"tracing: {trace_reps} repetitions)\n"
    )
    print("### eager per-op dispatch (x: 8x64, lora: 64x64 rank 4, zeros: 8x64)\n")
    print(
        "`dense`: the same computation written on dense arrays; `floor`: that dense code "
        "run under a do-nothing pass-through trace (what any stackless interpreter "
        "pays).\n"
    )
    print(
        markdown_table(
            [
                "op",
                "qax",
                "dense",
                "qax/dense",
                "floor",
                "floor/dense",
                "qax/floor",
                "materializes",
            ],
            eager_rows(eager_reps, inner),
        )
    )
    print(
        f"\n### eager, {n_ops} sequential ops in one call, per op (the handler returns "
        "a new implicit array each time)\n"
    )
    print(
        markdown_table(
            ["op", "qax", "dense", "qax/dense", "floor", "floor/dense"],
            sequential_rows(eager_reps, n_ops),
        )
    )
    print("\n### eager cost drift: JAX's jit cache grows by one entry per call\n")
    print(
        markdown_table(
            ["op", "first 200 calls", f"200 calls after {drift} more", "later/first"],
            drift_rows(drift),
        )
    )
    print(f"\n### tracing with symbolic-zero biases (model: {cfg})\n")
    print(
        markdown_table(
            [
                "measurement",
                "dense zero biases",
                "Zeros biases (qax)",
                "Zeros/dense",
                "qax wrapper, dense biases",
                "wrapper/dense",
            ],
            tracing_rows(cfg, trace_reps),
        )
    )
    print()


if __name__ == "__main__":
    main()
