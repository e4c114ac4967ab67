"""Placing adapter banks on a mesh: `bank_specs`.

A `LoraBank` stands for the stack of its ``N`` merged weights, shape ``(N, *w.shape)``,
so its `PartitionSpec` is the dense weight's spec behind one entry for the *adapter
axis*: ``P(adapter_axis, *spec)``. `qax.sharding.implicit_specs` /
`implicit_shardings` take it from there (`LoraBank.field_dims`): the shared base ``w``
(dense or `qax.quant`) gets the weight's spec, the factors ``a`` and ``b`` are split
along the adapter axis as asked and along the weight's dimensions they run along.

This module uses qax's public API only.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import PartitionSpec

import qax

from ._bank import LoraBank

_SHARED_AXIS = (
    "qax.lora.bank_specs: the bank at {path} would split its adapter axis over mesh "
    "axis {axis!r}, which the weight's spec {spec} already uses. A mesh axis splits "
    "one dimension at most: shard the adapter axis over another mesh axis, or "
    "replicate it (adapter_axis=None)."
)


def _is_spec(x: Any) -> bool:
    return x is None or isinstance(x, PartitionSpec)


def _mesh_axes(entry: Any) -> tuple:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def bank_specs(params: Any, specs: Any, adapter_axis: Any = None) -> Any:
    """The dense weights' `PartitionSpec`s, turned into specs for parameters holding
    banks.

    `specs` is what you wrote for the model without banks (one spec per weight, or at
    any subtree, as `qax.sharding.implicit_specs` takes them); at every `LoraBank` of
    ``params`` the spec becomes ``P(adapter_axis, *spec)``: the weight's spec for the
    shared base, behind the placement of the adapter axis (``None``: every device holds
    every adapter; a mesh axis name, or a tuple of names: the adapters are split over
    those devices, and each example's factors are fetched from where they lie). Pass
    the result to `qax.sharding.implicit_specs` or `implicit_shardings`.

    Examples:
        >>> served = qax.lora.bank(base, [adapters, adapters])
        >>> specs = {"layers": [{"attn": {"kernel": P(None, "model")}}], "out": None}
        >>> placed = qax.lora.bank_specs(served, specs, adapter_axis="data")
        >>> placed["layers"][0]["attn"]["kernel"]
        PartitionSpec('data', None, 'model')
        >>> leaves = qax.sharding.implicit_specs(served, placed)
        >>> kernel = leaves["layers"][0]["attn"]["kernel"]
        >>> kernel.w  # the shared base: the weight's spec
        PartitionSpec(None, 'model')
        >>> kernel.a, kernel.b  # the factors: split along the adapter axis too
        (PartitionSpec('data', None, None), PartitionSpec('data', None, 'model'))

    Args:
      params: parameters holding `LoraBank`s (from `qax.lora.bank`).
      specs: a prefix of ``params`` (implicit arrays as leaves) of `PartitionSpec`s
        (or ``None``: replicated) for the dense weights, as without banks.
      adapter_axis: where the adapter axis goes: ``None`` (replicated), a mesh axis
        name, or a tuple of names.

    Returns:
      ``specs`` with ``P(adapter_axis, *spec)`` at each bank (a subtree spec that
      covers banks is spelled out for the leaves below it).

    Raises:
      ValueError: the adapter axis would use a mesh axis that the bank's weight spec
        already uses.
    """
    adapter_axes = set(_mesh_axes(adapter_axis))

    def for_bank(path: Any, spec: Any) -> PartitionSpec:
        spec = PartitionSpec() if spec is None else spec
        used = {axis for entry in spec for axis in _mesh_axes(entry)}
        shared = sorted(adapter_axes & used, key=str)
        if shared:
            raise ValueError(
                _SHARED_AXIS.format(
                    path=qax.utils.path_string(path), axis=shared[0], spec=spec
                )
            )
        return PartitionSpec(adapter_axis, *spec)

    def is_weight(x: Any) -> bool:
        return isinstance(x, qax.ImplicitArray)

    def one(prefix: Any, spec: Any, subtree: Any) -> Any:
        found = jax.tree_util.tree_flatten_with_path(subtree, is_leaf=is_weight)[0]
        if not any(isinstance(x, LoraBank) for _, x in found):
            return spec
        return jax.tree_util.tree_map_with_path(
            lambda path, x: (
                for_bank((*prefix, *path), spec) if isinstance(x, LoraBank) else spec
            ),
            subtree,
            is_leaf=is_weight,
        )

    return jax.tree_util.tree_map_with_path(one, specs, params, is_leaf=_is_spec)
