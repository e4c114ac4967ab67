"""Factors that start from the weight: PiSSA, QPiSSA and LoftQ initialisation.

`loraify`'s default start (``a`` Gaussian, ``b`` zero) leaves the model unchanged, and
over a quantized base it leaves the quantization error where it is. Two initialisations
put the factors to work from the first step (``loraify(..., init=...)``):

- `PiSSA` (Meng et al. 2024): the factors hold the weight's ``rank`` principal singular
  components and the base holds the rest, ``w - s·a⊗b``: dense, or quantized
  (``PiSSA("nf4")``, QPiSSA: the residual has a smaller range than ``w``, so it
  quantizes with less error).
- `LoftQ` (Li et al. 2023): alternately quantize ``w - s·a⊗b`` and set the factors to
  the best rank-``rank`` approximation of what quantization lost, ``iterations``
  times, so that ``Q + s·a⊗b`` is close to ``w``.

Both take the dense weight (call `loraify` on the unquantized parameters: the
initialiser quantizes the base itself, with `qax.quant.quantize` and its options).
Over the weight's layout (``a_axes`` or ``split_at``) the weight is the matrix of its
``a`` axes by its ``b`` axes; stacked layers (``batch_ndim``) are decomposed each on its
own. This module uses qax's public API only.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

import qax


@dataclasses.dataclass(frozen=True)
class PiSSA:
    """PiSSA initialisation: the principal components in the factors, the rest in the base.

    With ``format=None`` the base is the dense residual ``w - s·a⊗b`` and the
    `LoraWeight` is exactly ``w`` (to float rounding). With a format (a name of
    `qax.quant.FORMATS` or a class, and its ``options``) the residual is quantized:
    QPiSSA.

    Examples:
        >>> w = jax.random.normal(jax.random.key(0), (64, 32))
        >>> p = qax.lora.loraify({"w": w}, 4, key=jax.random.key(1),
        ...                      filter=lambda *_: True, init=qax.lora.PiSSA())
        >>> bool(jnp.allclose(p["w"].materialize(), w, atol=1e-5))
        True

    Attributes:
      format: ``None`` (a dense residual) or the residual's quantized format.
      options: `qax.quant.quantize` options for that format (``block_size``...).
    """

    format: str | type | None = None
    options: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class LoftQ:
    """LoftQ initialisation: a quantized base and factors that cancel its error.

    Each iteration quantizes ``w - s·a⊗b`` into ``format`` and sets ``s·a⊗b`` to the
    best rank-``rank`` approximation of ``w - Q`` (truncated SVD). One iteration
    is PEFT's default; more trade initialisation time for a closer ``Q + s·a⊗b``.

    Examples:
        >>> w = jax.random.normal(jax.random.key(0), (64, 64))
        >>> p = qax.lora.loraify({"w": w}, 8, key=jax.random.key(1),
        ...                      filter=lambda *_: True, init=qax.lora.LoftQ("nf4"))
        >>> type(p["w"].w).__name__
        'NF4Weight'

    Attributes:
      format: the base's format (a name of `qax.quant.FORMATS` or a class).
      iterations: alternating steps (at least 1).
      options: `qax.quant.quantize` options for that format.
    """

    format: str | type = "nf4"
    iterations: int = 1
    options: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.iterations, int) or self.iterations < 1:
            raise ValueError(
                f"LoftQ: iterations must be a positive integer, got {self.iterations!r}."
            )


def check_init(init: Any) -> Any:
    """``init`` as `loraify` takes it: ``"gaussian"``, a `PiSSA` or a `LoftQ` (the
    names ``"pissa"`` and ``"loftq"`` mean their defaults)."""
    if init is None or init == "gaussian":
        return "gaussian"
    if isinstance(init, (PiSSA, LoftQ)):
        return init
    if init == "pissa":
        return PiSSA()
    if init == "loftq":
        return LoftQ()
    raise ValueError(
        f"loraify: init={init!r} is not an initialisation: use 'gaussian' (the "
        "default), qax.lora.PiSSA(format=None or a quantized format) or "
        "qax.lora.LoftQ(format, iterations=...)."
    )


def _matrix(w: jax.Array, nb: int, a_axes: tuple, b_axes: tuple) -> jax.Array:
    """One weight (or a stack: ``nb`` leading axes) as ``(..., prod A, prod B)``."""
    lead = w.shape[:nb]
    perm = (*range(nb), *(nb + i for i in a_axes), *(nb + i for i in b_axes))
    one = w.shape[nb:]
    rows = math.prod(one[i] for i in a_axes)
    return jnp.transpose(w, perm).reshape(*lead, rows, -1)


def _unmatrix(m: jax.Array, nb: int, shape: tuple, a_axes: tuple, b_axes: tuple):
    """The inverse of `_matrix` (``shape``: one weight's shape)."""
    lead = m.shape[:nb]
    ordered = tuple(shape[i] for i in (*a_axes, *b_axes))
    back = [0] * len(shape)
    for k, i in enumerate((*a_axes, *b_axes)):
        back[i] = k
    x = m.reshape(*lead, *ordered)
    return jnp.transpose(x, (*range(nb), *(nb + k for k in back)))


def _principal(m: jax.Array, rank: int, scale: float) -> tuple[jax.Array, jax.Array]:
    """``(a, b)`` as matrices with ``scale * a @ b`` the best rank-``rank``
    approximation of ``m``, the singular values split evenly between them."""
    u, s, vt = jnp.linalg.svd(m.astype(jnp.float32), full_matrices=False)
    root = jnp.sqrt(s[..., :rank] / scale)
    return u[..., :, :rank] * root[..., None, :], root[..., :, None] * vt[..., :rank, :]


def _quantize(name: str, w: jax.Array, fmt: Any, options: dict, nb: int) -> Any:
    options = {"batch_ndim": nb, **options}
    q = qax.quant.quantize(w, fmt, filter=lambda *_: True, **options)
    if not isinstance(q, qax.ImplicitArray):
        raise ValueError(
            f"loraify, the weight at {name!r}: the format {fmt!r} could not hold its "
            f"shape {w.shape} with options {options}: pass other options in the "
            "initialiser (e.g. LoftQ('nf4', options={'block_size': 32}))."
        )
    return q


def initialised(
    name: str, leaf: Any, init: Any, rank: int, scale: float, layout: tuple, dtype: Any
) -> tuple[Any, jax.Array, jax.Array]:
    """``(base, a, b)`` for the weight at ``name`` under a `PiSSA` or `LoftQ` ``init``,
    in `LoraWeight`'s factor layout (``layout``: `loraify`'s ``(lead, shape, a_axes,
    b_axes)``)."""
    if isinstance(leaf, qax.ImplicitArray) or not jnp.issubdtype(
        leaf.dtype, jnp.floating
    ):
        raise ValueError(
            f"loraify, the weight at {name!r}: {type(init).__name__} starts from the "
            f"dense weight, and this one is a {type(leaf).__name__}. Call loraify on "
            "the unquantized parameters: the initialiser quantizes the base itself "
            f"({type(init).__name__}(format, ...))."
        )
    lead, shape, a_axes, b_axes = layout
    nb = len(lead)
    m = _matrix(leaf, nb, a_axes, b_axes).astype(jnp.float32)
    if isinstance(init, PiSSA):
        a, b = _principal(m, rank, scale)
        residual = _unmatrix(m - scale * (a @ b), nb, shape, a_axes, b_axes)
        residual = residual.astype(leaf.dtype)
        base = (
            residual
            if init.format is None
            else _quantize(name, residual, init.format, dict(init.options), nb)
        )
    else:
        a = b = None
        for _ in range(init.iterations):
            target = m if a is None else m - scale * (a @ b)
            target = _unmatrix(target, nb, shape, a_axes, b_axes).astype(leaf.dtype)
            base = _quantize(name, target, init.format, dict(init.options), nb)
            decoded = _matrix(base.materialize(), nb, a_axes, b_axes)
            a, b = _principal(m - decoded.astype(jnp.float32), rank, scale)
    a = a.reshape(*lead, *(shape[i] for i in a_axes), rank).astype(dtype)
    b = b.reshape(*lead, rank, *(shape[i] for i in b_axes)).astype(dtype)
    return base, a, b
