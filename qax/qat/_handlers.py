"""The handlers of `FakeQuant` (see `qax.qat`).

This module uses qax's public API only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import qax

from ._fake import (
    FakeQuant,
    _cast,
    _image,
    _quantized,
)

# ----------------------------------------------------------------------------------------
# Handlers: the product runs on the fake-quantized image (and, if asked, on
# fake-quantized activations).


def _deployed_product(
    primitive: Any, params: dict, x: jax.Array, w: FakeQuant, side: int
) -> jax.Array:
    """The product of ``x`` with the weight, computed as the deployed model computes it
    (the quantized weight's own handler: int8 products run on the codes, the scales
    applied to the output), so that the trained forward pass is the deployed one
    bitwise; its derivatives are those of the product with the image, the weight's
    straight-through (``side``: the weight's operand position)."""
    x = w.fake_activation(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        operands = (w.materialize(), x) if side == 0 else (x, w.materialize())
        return primitive.bind(*operands, **params)
    spec = w._spec()

    def bind(a: Any, b: Any) -> Any:
        return primitive.bind(a, b, **params)

    def ordered(x: Any, w: Any) -> tuple:
        return (w, x) if side == 0 else (x, w)

    @jax.custom_jvp
    def product(x: jax.Array, w: jax.Array) -> jax.Array:
        q = _cast(_quantized(w, spec)[0], spec.out_dtype)
        out = qax.use_implicit_args(bind)(*ordered(x, q))
        return qax.materialize_nested(out, full=True)

    @product.defjvp
    def product_jvp(primals: tuple, tangents: tuple) -> tuple:
        (x, w), (tx, tw) = primals, tangents
        img, mask = _image(w, spec)
        if mask is not None:
            tw = jnp.where(mask, tw, jnp.zeros_like(tw))
        tangent = bind(*ordered(tx, img)) + bind(*ordered(x, tw.astype(img.dtype)))
        return product(x, w), tangent

    return product(x, w.w)


@qax.primitive_handler(["dot_general", "conv_general_dilated"])
def _product_x_w(primitive, x: jax.Array, w: FakeQuant, **params) -> jax.Array:
    return _deployed_product(primitive, params, x, w, side=1)


@qax.primitive_handler("dot_general")
def _product_w_x(primitive, w: FakeQuant, x: jax.Array, **params) -> jax.Array:
    return _deployed_product(primitive, params, x, w, side=0)


@qax.primitive_handler("gather")
def _gather(primitive, w: FakeQuant, indices: jax.Array, **params) -> jax.Array:
    """Rows of the image (the scales span the table's channels or blocks)."""
    return primitive.bind(w.materialize(), indices, **params)


@qax.primitive_handler("convert_element_type")
def _convert(primitive, w: FakeQuant, *, new_dtype, **params) -> Any:
    """To a floating dtype: the same codes (from the full-precision ``w``), decoded in
    ``new_dtype`` as a quantized weight cast the same way decodes."""
    if not jnp.issubdtype(new_dtype, jnp.floating):
        return primitive.bind(w.materialize(), new_dtype=new_dtype, **params)
    return dataclasses.replace(w, dtype=np.dtype(new_dtype))


@qax.primitive_handler(
    [
        "transpose",
        "reshape",
        "broadcast_in_dim",
        "squeeze",
        "slice",
        "reduce_sum",
        "neg",
    ]
)
def _image_then(primitive, w: FakeQuant, **params) -> jax.Array:
    """Structural ops move elements of the image (its scales belong to ``w``'s
    layout, so the result is a plain array)."""
    return primitive.bind(w.materialize(), **params)


@qax.primitive_handler("stop_gradient")
def _stop_gradient(primitive, w: FakeQuant) -> FakeQuant:
    """Still a `FakeQuant` (a frozen one, e.g. the base of a `qax.lora.LoraWeight`),
    so that products with it still run as the deployed model runs them."""
    return dataclasses.replace(w, w=jax.lax.stop_gradient(w.w))


@qax.primitive_handler(["add", "sub", "mul"])
def _elementwise(primitive, w: FakeQuant, x: jax.Array, **params) -> jax.Array:
    return primitive.bind(w.materialize(), x, **params)


@qax.primitive_handler("sub")
def _elementwise_right(primitive, x: jax.Array, w: FakeQuant, **params) -> jax.Array:
    return primitive.bind(x, w.materialize(), **params)
