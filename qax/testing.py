"""Testing helpers for authors of implicit array types (public API only).

`check_handler` tests a handler against the definition of correctness that qax uses
everywhere: running a primitive on implicit arrays must give what materializing them and
running the primitive gives.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import qax

__all__ = ["HandlerCheck", "HandlerCheckError", "check_handler"]


class HandlerCheckError(AssertionError):
    """A handler disagrees with "materialize, then run the primitive" (`check_handler`)."""


@dataclasses.dataclass(frozen=True)
class HandlerCheck:
    """What `check_handler` verified.

    Attributes:
      primitive: the primitive's name.
      handler: the handler that ran (name and source location).
      checks: ``(transformation, outcome)`` pairs, for ``"eager"``, ``"jit"``,
        ``"vmap"`` and ``"grad"``; the outcome is ``"passed"`` or ``"skipped: <why>"``.
      materializations: what the handler itself materialized on the eager run (other
        primitives it left to qax's fallback), as in `qax.materialization_audit`.
    """

    primitive: str
    handler: str
    checks: tuple[tuple[str, str], ...]
    materializations: tuple[Any, ...]

    def __str__(self) -> str:
        lines = [f"check_handler({self.primitive!r}): {self.handler}"]
        lines += [f"  {name:<5}  {outcome}" for name, outcome in self.checks]
        if self.materializations:
            lines.append(
                f"  (the handler materialized {len(self.materializations)} operand(s) "
                "itself; see `.materializations`)"
            )
        return "\n".join(lines)


_REFERENCE_FAILED = """\
check_handler could not run `{primitive}` on the materialized example inputs with \
params {params}: {error}
Pass every parameter of the primitive, exactly as a handler receives them; \
`jax.make_jaxpr` of the operation shows them (e.g. `jax.make_jaxpr(lambda x, y: x @ y)` \
lists `dimension_numbers`, `precision`, `preferred_element_type`, `out_sharding` for \
`dot_general`)."""


def check_handler(
    primitive: Any,
    *example_args: Any,
    rtol: float | None = None,
    atol: float | None = None,
    **params: Any,
) -> HandlerCheck:
    """Check the handler for `primitive` against "materialize, then run the primitive".

    Runs `primitive` on `example_args` through `qax.use_implicit_args` (so the registered
    handler runs) and compares the result (materialized if implicit) with the primitive
    run on the materialized arguments: shapes, dtypes and values. It does so eagerly,
    under `jax.jit`, under `jax.vmap` (a batch of two: the examples, and the examples
    with their floating-point leaves halved) and under `jax.grad` (gradients with respect
    to every floating-point leaf of the arguments, implicit ones included, of a fixed
    weighted sum of the result). A transformation that the primitive itself does not
    support is reported as skipped.

    It also fails if no handler applies to the example types, or if the handler passed
    (`NotImplemented`) so that qax materialized the operands instead.

    Examples:
        >>> qax.testing.check_handler(
        ...     "dot_general", x, lora,
        ...     dimension_numbers=(((1,), (0,)), ((), ())), precision=None,
        ...     preferred_element_type=jnp.float32, out_sharding=None,
        ... )

    Args:
      primitive: a primitive name (e.g. ``"mul"``) or a JAX `Primitive` object.
      *example_args: the operands, implicit arrays or plain arrays, as the primitive
        takes them.
      rtol: relative tolerance for floating-point results (default: by dtype, 1e-4
        for float32); the name is therefore not available as a param.
      atol: absolute tolerance (default: by dtype, 1e-5 for float32); likewise.
      **params: the primitive's parameters, all of them, as a handler receives them.

    Returns:
      A `HandlerCheck` listing what was checked (print it).

    Raises:
      HandlerCheckError: (an `AssertionError`) naming the transformation and what
        differs (shape, dtype or values, with the largest difference), or saying that
        no handler ran.
      ValueError: if no example argument is implicit, or the primitive cannot run on
        the materialized examples with these params.
    """
    explanation = qax.explain(primitive, *example_args)
    prim = explanation.primitive
    classes = tuple({type(a) for a in example_args if isinstance(a, qax.ImplicitBase)})
    if not classes:
        raise ValueError(
            "check_handler needs at least one implicit array among the example "
            "arguments: the handler under test dispatches on their types."
        )
    if explanation.chosen is None:
        why = "tie between handlers" if explanation.ambiguous else "no handler applies"
        raise HandlerCheckError(
            f"check_handler({prim.name!r}): {why} for these operand types, so there is "
            f"no handler to check.\n{explanation}"
        )
    head = f"check_handler({prim.name!r}): handler {explanation.candidates[0].name}"

    def run_primitive(*args: Any) -> list:
        out = prim.bind(*args, **params)
        return list(out) if prim.multiple_results else [out]

    def on_implicit(*args: Any) -> list:
        outs = qax.use_implicit_args(run_primitive)(*args)
        return [qax.materialize_nested(o, full=True) for o in outs]

    # The oracle runs compiled: its values are the same, without a dispatch (and a
    # compilation) per step of materializing; the handler runs eagerly as well.
    @jax.jit
    def reference(*args: Any) -> list:
        return run_primitive(*[qax.materialize_nested(a, full=True) for a in args])

    try:
        want = reference(*example_args)
    except Exception as e:  # noqa: BLE001 (any failure: report the params)
        raise ValueError(
            _REFERENCE_FAILED.format(
                primitive=prim.name, params=params, error=f"{type(e).__name__}: {e}"
            )
        ) from e

    checks = []
    with qax.materialization_audit() as audit:
        got = _run(head, "eager", on_implicit, example_args)
    fell_back = [r for r in audit if r.primitive == prim.name and r.cls in classes]
    if fell_back:
        raise HandlerCheckError(
            f"{head} did not handle the example inputs: it returned NotImplemented, so "
            f"qax materialized the operands and ran `{prim.name}` densely; the "
            f"comparison would be vacuous.\n{audit}"
        )
    _compare(head, "eager", got, want, rtol, atol)
    checks.append(("eager", "passed"))

    got = _run(head, "jit", jax.jit(on_implicit), example_args)
    _compare(head, "jit", got, want, rtol, atol)
    checks.append(("jit", "passed"))

    checks.append(_vmap_check(head, on_implicit, reference, example_args, rtol, atol))
    checks.append(
        _grad_check(head, on_implicit, reference, example_args, want, rtol, atol)
    )
    return HandlerCheck(
        primitive=prim.name,
        handler=explanation.candidates[0].name,
        checks=tuple(checks),
        materializations=tuple(audit),
    )


def _run(head: str, where: str, fn: Callable, args: Sequence) -> Any:
    """`fn(*args)`, with failures reported as a `HandlerCheckError`."""
    try:
        with warnings.catch_warnings():
            # What the handler materializes itself is not this check's business.
            warnings.simplefilter("ignore", qax.MaterializationWarning)
            return fn(*args)
    except qax.HandlerError as e:
        raise HandlerCheckError(
            f"{head} failed under {where}: it returned a result of the wrong shape, "
            f"dtype or structure.\n{e}"
        ) from e
    except Exception as e:
        raise HandlerCheckError(
            f"{head} failed under {where}: {type(e).__name__}: {e}"
        ) from e


def _vmap_check(head, on_implicit, reference, args, rtol, atol) -> tuple[str, str]:
    batched = [_batch_of_two(a) for a in args]
    try:
        want = jax.jit(jax.vmap(reference))(*batched)
    except Exception as e:  # noqa: BLE001 (the primitive itself cannot be vmapped)
        return "vmap", f"skipped: the materialized computation fails: {e}"
    got = _run(head, "vmap", jax.vmap(on_implicit), batched)
    _compare(head, "vmap", got, want, rtol, atol)
    return "vmap", "passed"


def _batch_of_two(x: Any) -> Any:
    """A batch of `x` and a copy whose floating-point leaves are halved.

    Built with `vmap`, so that implicit arrays are stacked as their types declare (a
    type that declares nothing comes out as a stack of examples, and `vmap` hands the
    handler one example at a time).
    """

    def scaled(factor: Any) -> Any:
        def scale(leaf: Any) -> Any:
            leaf = jnp.asarray(leaf)
            if not _is_inexact(leaf):
                return leaf
            # In the leaf's dtype: 8-bit floats have no implicit promotion.
            return leaf * factor.astype(leaf.dtype)

        return jax.tree_util.tree_map(scale, x)

    return jax.vmap(scaled)(jnp.array([1.0, 0.5]))


def _grad_check(head, on_implicit, reference, args, want, rtol, atol):
    leaves, tree = jax.tree_util.tree_flatten(list(args))
    wrt = [i for i, x in enumerate(leaves) if _is_inexact(x) and np.size(x) > 0]
    outs = [k for k, w in enumerate(want) if _is_inexact(w)]
    if not wrt:
        return "grad", "skipped: no floating-point input"
    if not outs:
        return "grad", "skipped: no floating-point result"
    weights = {
        k: jnp.cos(jnp.arange(want[k].size))
        .reshape(want[k].shape)
        .astype(want[k].dtype)
        for k in outs
    }

    def loss_of(fn: Callable) -> Callable:
        def loss(values: list) -> Any:
            full = list(leaves)
            for i, v in zip(wrt, values, strict=True):
                full[i] = v
            results = fn(*jax.tree_util.tree_unflatten(tree, full))
            return sum(jnp.real(jnp.sum(results[k] * weights[k])) for k in outs)

        return loss

    primal = [leaves[i] for i in wrt]
    try:
        expected = jax.jit(jax.grad(loss_of(reference)))(primal)
    except Exception as e:  # noqa: BLE001 (the primitive itself is not differentiable)
        return "grad", f"skipped: the materialized computation fails: {e}"
    got = _run(head, "grad", jax.grad(loss_of(on_implicit)), [primal])
    _compare(head, "grad", got, expected, rtol, atol, what="gradient")
    return "grad", "passed"


def _is_inexact(x: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


_DEFAULT_TOLERANCE = {
    np.dtype(jnp.bfloat16): (2e-2, 2e-2),
    np.dtype(np.float16): (1e-2, 1e-2),
    np.dtype(np.float32): (1e-4, 1e-5),
    np.dtype(np.complex64): (1e-4, 1e-5),
    np.dtype(np.float64): (1e-9, 1e-12),
    np.dtype(np.complex128): (1e-9, 1e-12),
}


def _compare(head, where, got, want, rtol, atol, what="result") -> None:
    def fail(message: str) -> None:
        raise HandlerCheckError(
            f"{head} disagrees with materialize-then-run under {where}: {message}"
        )

    if len(got) != len(want):
        fail(f"{len(got)} {what}s, expected {len(want)}")
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        label = f"{what} {i}" if len(want) > 1 else what
        g_shape, w_shape = tuple(np.shape(g)), tuple(np.shape(w))
        g_dtype, w_dtype = np.dtype(jnp.result_type(g)), np.dtype(jnp.result_type(w))
        if g_shape != w_shape:
            fail(f"the {label} has shape {g_shape}, expected {w_shape}")
        if g_dtype != w_dtype:
            fail(f"the {label} has dtype {g_dtype}, expected {w_dtype}")
        g, w = np.asarray(g), np.asarray(w)
        if not _is_inexact(w):
            if not np.array_equal(g, w):
                bad = tuple(int(j) for j in np.argwhere(g != w)[0])
                fail(f"the {label} differs at index {bad}: {g[bad]} != {w[bad]}")
            continue
        default_rtol, default_atol = _DEFAULT_TOLERANCE.get(w_dtype, (1e-4, 1e-5))
        r = default_rtol if rtol is None else rtol
        a = default_atol if atol is None else atol
        g64, w64 = g.astype(np.complex128), w.astype(np.complex128)
        close = np.isclose(g64, w64, rtol=r, atol=a, equal_nan=True)
        if not close.all():
            bad = tuple(int(j) for j in np.argwhere(~close)[0])
            err = np.abs(g64 - w64)
            fail(
                f"the {label} values differ (max abs difference {np.nanmax(err):.3g}; "
                f"first at index {bad}: {g[bad]:.6g} vs {w[bad]:.6g}; rtol={r}, atol={a})"
            )
