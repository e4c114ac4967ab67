"""`qax.quant`: slicing, indexing, ``squeeze``, ``dynamic_slice`` and ``gather`` keep
the codes and scales (issue 36, 3; issue 42, 3, the quantized half).

The oracle is the same indexing of the decoded weight; the proof that nothing was
decoded is the type of the result (a quantized weight), `strict()` (materializing is
an error) and the jaxpr (no float array of the weight's size).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import qax
from qax.lora import LoraWeight
from qax.quant import (
    FP8Weight,
    Int4Weight,
    Int8Weight,
    IntKWeight,
    NF4DQWeight,
    NF4Weight,
    NVFP4Weight,
)
from qax.testing import check_handler
from tests.helpers import all_eqns, find_eqn

# Every format, and the block formats with their blocks along the other axis.
FORMATS = {
    "int8": (Int8Weight, {}),
    "int4": (Int4Weight, {"group_size": 16}),
    "nf4": (NF4Weight, {"block_size": 16}),
    "nf4-axis-2": (NF4Weight, {"block_size": 16, "block_axis": -2}),
    "fp8": (FP8Weight, {}),
    "fp8-block": (FP8Weight, {"block_size": 16}),
    "int3": (IntKWeight, {"bits": 3, "group_size": 16}),
    "int6-axis-2": (IntKWeight, {"bits": 6, "group_size": 16, "block_axis": -2}),
    "nvfp4": (NVFP4Weight, {}),  # blocks of 16 by the format
    "nf4_dq": (NF4DQWeight, {"block_size": 16}),
}
IDS = list(FORMATS)
CLASSES = (Int8Weight, Int4Weight, NF4Weight, FP8Weight, IntKWeight, LoraWeight)
CLASSES += (NVFP4Weight, NF4DQWeight)


def normal(shape, seed=0):
    return jax.random.normal(jax.random.PRNGKey(seed), shape)


def make(name, w, **kw):
    cls, options = FORMATS[name]
    return cls.from_array(w, **options, **kw)


def strict():
    import contextlib

    stack = contextlib.ExitStack()
    for cls in CLASSES:
        stack.enter_context(qax.materialization_policy(cls, "error"))
    return stack


def float_sizes(jaxpr, dtype=jnp.float32):
    """The sizes of the arrays of ``dtype`` (what the weights decode to; not fp8
    codes) a program computes."""
    return [
        int(np.prod(v.aval.shape))
        for e in all_eqns(jaxpr.jaxpr)
        for v in e.outvars
        if v.aval.dtype == dtype
    ]


# Indexing of a stack of 3 weights of (32, 32): every case keeps whole blocks along
# either blocks' axis (multiples of 16), so it stays quantized in every format.
CASES = {
    "layer": lambda p, i: p[1],
    "last-layer": lambda p, i: p[-1],
    "traced-layer": lambda p, i: p[i],
    "layers": lambda p, i: p[1:3],
    "row": lambda p, i: p[:, 5],
    "column": lambda p, i: p[:, :, 7],
    "rows-strided": lambda p, i: p[:, 1:9:3],
    "columns-strided": lambda p, i: p[..., 2:11:4],
    "aligned-block": lambda p, i: p[:, 16:32, 16:32],
    "dynamic-slice": lambda p, i: lax.dynamic_slice(
        p, (i, i, jnp.int32(0)), (2, 5, 32)
    ),
    "dynamic-index": lambda p, i: lax.dynamic_index_in_dim(p, i, 0, keepdims=False),
    "layers-gather": lambda p, i: p[jnp.array([2, 0, 2])],
    "swapaxes": lambda p, i: jnp.swapaxes(p, -1, -2),
}
# Cases that index along the blocks' axis of a format, and are not aligned there:
# they do not belong to the table above.
_ALONG = {
    "rows-strided": -2,
    "columns-strided": -1,
    "row": -2,
    "column": -1,
    "dynamic-slice": -2,
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name", IDS)
def test_indexing_a_stack_stays_quantized(name, case):
    p = make(name, normal((3, 32, 32)), batch_ndim=1)
    block_axis = getattr(p, "block_axis", None)
    block_size = getattr(p, "block_size", None) or getattr(p, "group_size", None)
    if block_size is not None and _ALONG.get(case) == block_axis:
        pytest.skip("cuts the blocks: test_unaligned_slices_decode_with_the_reason")
    fn = CASES[case]
    i = jnp.int32(2)
    with strict():
        got = qax.use_implicit_args(fn)(p, i)
        jitted = jax.jit(qax.use_implicit_args(fn))(p, i)
    assert type(got) is type(p), type(got)
    want = fn(p.dequantize(), i)
    assert got.shape == want.shape
    np.testing.assert_array_equal(got.dequantize(), want)
    np.testing.assert_array_equal(jitted.dequantize(), want)
    # The codes are indexed as stored (uint8 / int8 / fp8), not decoded first.
    codes = p._ARRAYS[0]
    assert getattr(got, codes).dtype == getattr(p, codes).dtype


@pytest.mark.parametrize("name", IDS)
def test_a_layer_of_the_stack_is_a_weight_again(name):
    # `p[i]` is one weight (weight_ndim kept, the stacked axis gone); `p[1:3]` a stack.
    p = make(name, normal((3, 32, 32)), batch_ndim=1)
    with strict():
        layer = qax.use_implicit_args(lambda p: p[1])(p)
        two = qax.use_implicit_args(lambda p: p[1:3])(p)
        swapped = qax.use_implicit_args(lambda p: jnp.swapaxes(p, -1, -2))(p)
    assert layer.weight_ndim == 2 and qax.utils.batch_ndim(layer) == 0
    assert two.weight_ndim == 2 and qax.utils.batch_ndim(two) == 1
    assert swapped.weight_ndim == 2 and qax.utils.batch_ndim(swapped) == 1
    dense = p.dequantize()
    for ours, theirs in ((layer, dense[1]), (two, dense[1:3])):
        np.testing.assert_array_equal(ours.dequantize(), theirs)


@pytest.mark.parametrize("name", IDS)
def test_layers_in_a_loop_and_a_transposed_stack(name):
    # `fori_loop` (a static trip count is a scan, a traced one a while loop) taking
    # `p[i]`, `lax.scan` over a transposed stack and `w.T` under `vmap`: the numbers of
    # the decoded stack, value and gradient, with no weight decoded whole.
    ws = normal((3, 32, 32)) * 0.2
    p = make(name, ws, batch_ndim=1)
    x = normal((2, 32), seed=1)

    def static(p, x):  # one layer at a time: no float array of the stack's size
        h = lax.fori_loop(0, 3, lambda i, h: jnp.tanh(h @ p[i]), x)
        t = jnp.swapaxes(p, -1, -2)
        return lax.scan(lambda h, w: (jnp.tanh(h @ w), None), h, t)[0]

    def mapped(p, x):  # every layer in one product (decoded inside it, as any product)
        return jax.vmap(lambda w: x @ w.T)(p).sum(0)

    def traced(p, x, n):  # a while loop (forward only, as in JAX)
        return lax.fori_loop(0, n, lambda i, h: jnp.tanh(h @ p[i]), x)

    def loss(p, x):
        return jnp.sum((static(p, x) + mapped(p, x)) ** 2)

    n = jnp.int32(3)
    grad = jax.value_and_grad(loss, argnums=1)
    with strict():
        value, g = jax.jit(jax.value_and_grad(qax.use_implicit_args(loss), 1))(p, x)
        out = jax.jit(qax.use_implicit_args(traced))(p, x, n)
        jaxprs = [
            jax.make_jaxpr(qax.use_implicit_args(static))(p, x),
            jax.make_jaxpr(qax.use_implicit_args(traced))(p, x, n),
        ]
    want, g_want = grad(p.dequantize(), x)
    np.testing.assert_allclose(value, want, rtol=1e-5)
    np.testing.assert_allclose(g, g_want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(out, traced(p.dequantize(), x, n), rtol=1e-5, atol=1e-6)
    for jaxpr in jaxprs:
        assert max(float_sizes(jaxpr)) < 3 * 32 * 32, "a whole stack was decoded"


@pytest.mark.parametrize(
    ("name", "fn", "where"),
    [
        ("nf4", lambda p: p[..., 3:7], "3:7"),
        ("int4", lambda p: p[..., ::2], "0:32:2"),
        ("nf4-axis-2", lambda p: p[:, 5], "5:6"),
        ("int3", lambda p: p[:, :, 8:24], "8:24"),
        ("fp8-block", lambda p: p[..., 1:17], "1:17"),
        (
            "nf4",
            lambda p: lax.dynamic_slice_in_dim(p, jnp.int32(16), 16, axis=-1),
            "16 numbers from a traced start",
        ),
    ],
    ids=["nf4", "int4-strided", "nf4-axis-2", "int3", "fp8-block", "dynamic"],
)
def test_unaligned_slices_decode_with_the_reason(name, fn, where):
    # A slice that cuts the blocks (the bytes of packed codes) cannot keep them: the
    # weight is decoded, and the warning (or the error under the "error" policy) says
    # why and what would stay quantized.
    p = make(name, normal((3, 32, 32)), batch_ndim=1)
    cls = type(p).__name__
    with pytest.warns(qax.MaterializationWarning, match="cuts the blocks") as record:
        got = qax.use_implicit_args(fn)(p)
    np.testing.assert_array_equal(got, fn(p.dequantize()))
    message = str(record[0].message)
    assert cls in message and where in message and "=16" in message, message
    with strict(), pytest.raises(qax.MaterializationError) as info:
        qax.use_implicit_args(fn)(p)
    error = str(info.value)
    assert "cuts the blocks" in error and '"error"' in error and cls in error, error


@pytest.mark.parametrize("name", ["int8", "nf4", "nf4-axis-2", "fp8", "int6-axis-2"])
def test_rows_of_one_weight_are_decoded_alone(name):
    # `jnp.take` along any axis the blocks do not run along: only the gathered rows
    # are decoded (a table stored (d, vocab), blocks along d, looked up by column).
    table = make(name, normal((32, 48)))
    along_blocks = getattr(table, "block_axis", None)
    axis = 0 if along_blocks == -1 else 1
    ids = jnp.array([[3, 31, 0], [7, 7, 1]])
    fn = lambda w, i: jnp.take(w, i, axis=axis)  # noqa: E731
    with strict():
        got = jax.jit(qax.use_implicit_args(fn))(table, ids)
        jaxpr = jax.make_jaxpr(qax.use_implicit_args(fn))(table, ids)
    np.testing.assert_array_equal(got, fn(table.dequantize(), ids))
    rows = ids.size * table.shape[1 - axis]
    assert max(float_sizes(jaxpr)) <= rows, float_sizes(jaxpr)


@pytest.mark.parametrize("fill_value", [None, 7.0], ids=["nan", "seven"])
@pytest.mark.parametrize("name", ["int8", "nf4", "int6-axis-2", "fp8"])
def test_out_of_bounds_lookups_read_the_fill_value(name, fill_value):
    # `jnp.take`'s default mode fills lookups out of bounds (NaN, or `fill_value`):
    # the codes have no such number, so the rows are filled after decoding.
    table = make(name, normal((32, 48)))
    ids = jnp.array([[0, 40], [-40, 31]])
    axis = 0 if getattr(table, "block_axis", -1) == -1 else 1
    fn = lambda w, i: jnp.take(w, i, axis=axis, fill_value=fill_value)  # noqa: E731
    with strict():
        got = jax.jit(qax.use_implicit_args(fn))(table, ids)
    np.testing.assert_array_equal(got, fn(table.dequantize(), ids))


@pytest.mark.parametrize("name", ["int8", "nf4-axis-2", "int3", "fp8-block"])
def test_indexing_handlers_pass_check_handler(name):
    # Eagerly, under jit, vmap and grad (the scales' gradients), as the decoded oracle.
    p = make(name, normal((3, 32, 32)), batch_ndim=1)
    free = 1 if getattr(p, "block_axis", -1) == -1 else 2  # an axis without blocks
    strides = tuple(3 if d == free else 1 for d in range(3))
    checks = [
        check_handler(
            "slice", p, start_indices=(1, 0, 16), limit_indices=(3, 32, 32), strides=None
        ),
        check_handler(
            "slice", p, start_indices=(0, 1, 1), limit_indices=(3, 32, 32),
            strides=strides,
        ) if name == "int8" else check_handler(
            "slice", p, start_indices=(0, 0, 0), limit_indices=(3, 32, 32),
            strides=strides,
        ),
        check_handler(
            "dynamic_slice", p, jnp.int32(1), jnp.int32(0), jnp.int32(0),
            slice_sizes=(2, 32, 32),
        ),
    ]  # fmt: skip
    with strict():
        row = qax.use_implicit_args(lambda w: w[:, 3:4] if free == 1 else w[..., 3:4])(
            p
        )
    checks.append(check_handler("squeeze", row, dimensions=(free,)))
    dense = p.dequantize()
    eqn = find_eqn(
        jax.make_jaxpr(lambda w: w[jnp.array([2, 0])])(dense).jaxpr, "gather"
    )
    checks.append(check_handler("gather", p, jnp.array([[2], [0]]), **eqn.params))
    for report in checks:
        assert not report.materializations, report


@pytest.mark.parametrize("name", ["int8", "nf4", "int3"])
def test_qlora_conv_taps_stay_quantized(name):
    # Griffin's Conv1D reads its taps as `w[k]` and multiplies activations by them: a
    # QLoRA weight (LoRA over a quantized base) sliced by rows keeps the base's codes.
    base = make(name, normal((4, 32)))
    lora = LoraWeight(
        w=base, a=normal((4, 2), seed=1) * 0.1, b=normal((2, 32), seed=2) * 0.1
    )
    x = normal((2, 6, 32), seed=3)

    def conv(w, x):
        return sum(x[:, k : k + 3] * w[k] for k in range(4))

    with strict():
        got = jax.jit(qax.use_implicit_args(conv))(lora, x)
        jaxpr = jax.make_jaxpr(qax.use_implicit_args(conv))(lora, x)
    dense = base.dequantize() + lora.a @ lora.b
    np.testing.assert_allclose(got, conv(dense, x), rtol=1e-5, atol=1e-6)
    assert 4 * 32 not in float_sizes(jaxpr), "the base was decoded whole"
