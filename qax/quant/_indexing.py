"""Indexing handlers of the quantized weight types: ``slice``, ``dynamic_slice``,
``squeeze`` and ``gather`` on the codes and scales (see `qax.quant`).

Every array field of a quantized weight has the weight's rank, and along each axis it
runs one of three ways: as the weight (codes, and scales along a channel axis or a
non-block axis), broadcast (a per-channel scale of size 1), or in blocks (the blocks'
axis of a block format: packed codes, one scale per block). Indexing slices each field
along its axes accordingly; along the blocks' axis it applies when it keeps whole
blocks (whole bytes of packed codes), and otherwise declines with the reason.

This module uses qax's public API only.
"""

from __future__ import annotations

from typing import Any, Final

import jax
import jax.numpy as jnp
from jax import lax

import qax

from ._types import Int4Weight, IntKWeight, QuantizedWeight, _PackedFourBits

UNALIGNED_SLICE: Final = (
    "{cls}: {what} of a weight of shape {shape} cuts the blocks along {axis} (axis "
    "{dim}: {detail}), so the weight is decoded whole. Its codes{packed} and scales "
    "come in blocks of {what_size}={size} along that axis: a slice that starts and "
    "ends on multiples of {size} (stride 1) stays quantized, as does any slice along "
    "another axis. Slice on block boundaries, or quantize with block_axis= on an axis "
    "you do not slice."
)
_PACKED: Final = " (packed {bits} bits a number)"


def _blocks(w: QuantizedWeight) -> tuple[int, int, str] | None:
    """The blocks' axis of ``w`` (counted from the start), the numbers per block and
    the option's name; ``None`` for per-channel scales."""
    if isinstance(w, (Int4Weight, IntKWeight)):
        size, name = w.group_size, "group_size"
    elif getattr(w, "block_size", None) is not None:  # nf4, block fp8, the FP4s
        size, name = w.block_size, "block_size"
    else:
        return None
    return w.ndim + w.block_axis, size, name


def _decline(w: QuantizedWeight, what: str, dim: int, detail: str) -> Any:
    """Decline with the reason: the indexing cuts ``w``'s blocks along ``dim``."""
    _, size, name = _blocks(w)
    if isinstance(w, IntKWeight):
        packed = _PACKED.format(bits=w.bits)
    elif isinstance(w, _PackedFourBits):
        packed = _PACKED.format(bits=4)
    else:
        packed = ""
    words = "the last axis" if w.block_axis == -1 else f"block_axis={w.block_axis}"
    return qax.decline(
        UNALIGNED_SLICE.format(
            cls=type(w).__name__,
            what=what,
            shape=tuple(w.shape),
            axis=words,
            dim=dim,
            detail=detail,
            packed=packed,
            what_size=name,
            size=size,
        )
    )


def _grouped(w: QuantizedWeight) -> dict[int, tuple[str, int]]:
    """The axes along which a field has one entry per several numbers (other than the
    blocks of the block formats: the groups of `NF4DQWeight`'s absmax scales), with
    that field and the numbers per entry."""
    blocks = _blocks(w)
    out = {}
    for name in w._ARRAYS[1:]:
        shape = getattr(w, name).shape
        for d, (n, m) in enumerate(zip(shape, w.shape, strict=True)):
            per = m // n
            if n not in (1, m) and (
                blocks is None or per != blocks[1] or d != blocks[0]
            ):
                out[d] = (name, max(per, out.get(d, ("", 0))[1]))
    return out


def _decline_groups(
    w: QuantizedWeight, what: str, dim: int, detail: str, field: str, per: int
) -> Any:
    return qax.decline(
        f"{type(w).__name__}: {what} of a weight of shape {tuple(w.shape)} cuts the "
        f"groups of its {field} along axis {dim} ({detail}): each entry of {field} "
        f"covers {per} numbers along that axis, so the weight is decoded whole. Slice "
        f"on multiples of {per} along it (stride 1), or quantize to a format without "
        "such groups (nf4 rather than nf4_dq)."
    )


@qax.primitive_handler("slice")
def _slice(
    primitive, w: QuantizedWeight, *, start_indices, limit_indices, strides
) -> Any:
    """``w[a:b]``, ``w[i]`` (then squeezed), ``w[:, a:b:s]``: each field sliced along
    its axes; along the blocks' axis only on block boundaries."""
    starts, limits = tuple(start_indices), tuple(limit_indices)
    steps = tuple(strides) if strides is not None else (1,) * w.ndim
    blocks = _blocks(w)
    if blocks is not None:
        k, size, _ = blocks
        whole = starts[k] == 0 and limits[k] == w.shape[k] and steps[k] == 1
        aligned = steps[k] == 1 and starts[k] % size == 0 and limits[k] % size == 0
        if not (whole or aligned):
            detail = f"{starts[k]}:{limits[k]}" + (
                f":{steps[k]}" if steps[k] != 1 else ""
            )
            return _decline(w, "a slice", k, detail)
    for d, (field, per) in _grouped(w).items():
        whole = starts[d] == 0 and limits[d] == w.shape[d] and steps[d] == 1
        if not (whole or (steps[d] == 1 and starts[d] % per == limits[d] % per == 0)):
            detail = f"{starts[d]}:{limits[d]}:{steps[d]}"
            return _decline_groups(w, "a slice", d, detail, field, per)
    fields = {}
    for name in w._ARRAYS:
        leaf = getattr(w, name)
        lo, hi, st = [], [], []
        for d in range(w.ndim):
            n, m = leaf.shape[d], w.shape[d]
            if n == m:
                lo.append(starts[d]), hi.append(limits[d]), st.append(steps[d])
            elif n == 1:  # a scale broadcast along this axis
                lo.append(0), hi.append(1), st.append(1)
            else:  # the blocks' axis, on block boundaries
                lo.append(starts[d] * n // m), hi.append(limits[d] * n // m)
                st.append(1)
        fields[name] = lax.slice(leaf, lo, hi, st)
    return w._rescaled(**fields)


@qax.primitive_handler("dynamic_slice")
def _dynamic_slice(
    primitive, w: QuantizedWeight, *starts: jax.Array, slice_sizes
) -> Any:
    """``w[i]`` with a traced ``i`` (one layer of a stack inside a loop), or
    ``lax.dynamic_slice``: each field sliced at the same starts; along the blocks' axis
    only when the slice keeps the whole axis (a traced start cannot be checked)."""
    sizes = tuple(int(s) for s in slice_sizes)
    blocks = _blocks(w)
    if blocks is not None:
        k = blocks[0]
        if sizes[k] != w.shape[k]:
            return _decline(
                w, "a dynamic slice", k, f"{sizes[k]} numbers from a traced start"
            )
    for d, (field, per) in _grouped(w).items():
        if sizes[d] != w.shape[d]:
            detail = f"{sizes[d]} numbers from a traced start"
            return _decline_groups(w, "a dynamic slice", d, detail, field, per)
    zero = jnp.zeros((), jnp.int32)
    fields = {}
    for name in w._ARRAYS:
        leaf = getattr(w, name)
        at, size = [], []
        for d in range(w.ndim):
            if leaf.shape[d] == w.shape[d]:
                at.append(starts[d]), size.append(sizes[d])
            else:  # broadcast, or the blocks' axis kept whole
                at.append(zero), size.append(leaf.shape[d])
        at = [jnp.asarray(s).astype(jnp.int32) for s in at]
        fields[name] = lax.dynamic_slice(leaf, at, size)
    return w._rescaled(**fields)


@qax.primitive_handler("squeeze")
def _squeeze(primitive, w: QuantizedWeight, *, dimensions) -> Any:
    """Dropping axes of size 1 (``w[i]`` after its slice) drops them from every field;
    a dropped stacked axis leaves ``weight_ndim`` as it is."""
    dims = sorted(d % w.ndim for d in dimensions)
    blocks = _blocks(w)
    if blocks is not None and blocks[0] in dims:
        return NotImplemented  # the blocks' axis itself has size 1: nothing to keep
    fields = {n: lax.squeeze(getattr(w, n), dims) for n in w._ARRAYS}
    changes: dict[str, Any] = {}
    if w.weight_ndim is not None:
        batch = w.ndim - w.weight_ndim
        changes["weight_ndim"] = w.weight_ndim - sum(d >= batch for d in dims)
    if blocks is not None:
        changes["block_axis"] = w.block_axis + sum(d > blocks[0] for d in dims)
    return w._rescaled(**fields, **changes)


def _indexed(dn: Any) -> set[int]:
    return {*dn.collapsed_slice_dims, *dn.start_index_map, *dn.operand_batching_dims}


def _kept(dn: Any, ndim: int) -> list[int]:
    """The operand dimensions that appear in a gather's output, in order (its
    ``offset_dims``)."""
    gone = {*dn.collapsed_slice_dims, *dn.operand_batching_dims}
    return [d for d in range(ndim) if d not in gone]


@qax.primitive_handler("gather")
def _gather(
    primitive, w: QuantizedWeight, indices: jax.Array, *, dimension_numbers, **params
) -> Any:
    """Gather the codes and scales, then: layers of a stack (``stack[ids]``: only
    stacked axes indexed, each weight whole) stay quantized; rows of a weight
    (``table[ids]``, an embedding lookup) are decoded, and only those rows.

    Applies when the blocks' axis (if any) is not indexed and is taken whole; a
    lookup along it decodes the weight inside the lookup (rows there share bytes and
    scales).
    """
    dn, sizes = dimension_numbers, tuple(params.pop("slice_sizes"))
    indexed = _indexed(dn)
    blocks = _blocks(w)
    k = None if blocks is None else blocks[0]
    grouped = [d for d in _grouped(w) if d in indexed or sizes[d] != w.shape[d]]
    if grouped or (k is not None and (k in indexed or sizes[k] != w.shape[k])):
        # Rows along the blocks' axis share bytes and scales: decoded in the lookup.
        return primitive.bind(
            w.dequantize(), indices, dimension_numbers=dn, slice_sizes=sizes, **params
        )
    fill = params.get("mode") == lax.GatherScatterMode.FILL_OR_DROP
    fill_value = params.pop("fill_value", None)
    fields = {}
    for name in w._ARRAYS:
        leaf = getattr(w, name)
        broadcast = [d for d in range(w.ndim) if leaf.shape[d] == 1 and w.shape[d] != 1]
        if any(d in broadcast for d in dn.operand_batching_dims):
            return NotImplemented
        idx = indices
        for j, d in enumerate(dn.start_index_map):
            if d in broadcast:  # one scale for every index along this axis
                idx = idx.at[..., j].set(0)
        field_sizes = [
            s if leaf.shape[d] == w.shape[d] else leaf.shape[d]
            for d, s in enumerate(sizes)
        ]
        fields[name] = primitive.bind(
            leaf,
            idx,
            dimension_numbers=dn,
            slice_sizes=tuple(field_sizes),
            fill_value=0 if fill else None,  # filled after decoding (the codes: no NaN)
            **params,
        )
    out_ndim = indices.ndim - 1 + len(dn.offset_dims)
    kept = _kept(dn, w.ndim)
    batch = 0 if w.weight_ndim is None else w.ndim - w.weight_ndim
    # Layers of a stack: only stacked axes indexed, the weights' own axes whole and
    # last in the output, in order.
    layers = (
        w.weight_ndim is not None
        and all(d < batch for d in indexed)
        and all(sizes[d] == w.shape[d] for d in range(batch, w.ndim))
        and tuple(dn.offset_dims[-w.weight_ndim :] if w.weight_ndim else ())
        == tuple(range(out_ndim - w.weight_ndim, out_ndim))
    )
    changes: dict[str, Any] = {}
    if blocks is not None:
        changes["block_axis"] = dn.offset_dims[kept.index(blocks[0])] - out_ndim
    if layers and not fill:
        return w._rescaled(**fields, **changes)
    rows = w._rescaled(**fields, **changes, weight_ndim=None)
    out = rows._decode(**{n: getattr(rows, n) for n in rows._ARRAYS})
    if fill:  # ``jnp.take``'s default: out-of-bounds lookups read `fill_value`
        out = _filled(out, w.shape, indices, dn, sizes, fill_value)
    return out


def _filled(out, shape, indices, dn, sizes, fill_value) -> jax.Array:
    """``out`` with the lookups out of bounds replaced by ``fill_value`` (NaN if
    ``None``), as a ``FILL_OR_DROP`` gather of the decoded weight reads them."""
    upper = jnp.asarray([shape[d] - sizes[d] for d in dn.start_index_map])
    ok = jnp.all((indices >= 0) & (indices <= upper.astype(indices.dtype)), axis=-1)
    batch = [i for i in range(out.ndim) if i not in dn.offset_dims]
    ok = lax.broadcast_in_dim(ok, out.shape, batch)
    value = jnp.nan if fill_value is None else fill_value
    return jnp.where(ok, out, jnp.asarray(value, out.dtype))
