"""Shardings for pytrees that hold implicit arrays, derived from the dense weights' specs.

A sharded model is described by one `PartitionSpec` per dense weight (``w [m, n]`` as
``P(None, "model")``, say). When ``w`` becomes an implicit array, its leaves have other
shapes: LoRA's ``a [m, r]`` and ``b [n, r]``, int8 codes ``[m, n]`` and scales
``[1, n]``. Each leaf is partitioned along the dimensions of the dense array it runs
along, and replicated along dimensions of its own (the rank, a size-1 scale axis).
Which dimension a field's dimension runs along is declared by the type, never guessed
from shapes:

- per field, with ``qax.array_field(ndim=k, follows=(...))``: ``follows[i]`` is the
  dimension of the represented (unbatched) array that the field's dimension ``i`` runs
  along, or ``None``;
- or per instance, with a method ``field_dims(self) -> dict[str, tuple]`` returning the
  same tuples by field name (for types whose ranks vary, e.g. a weight ``(*A, *B)``);
  it takes precedence over the field declarations.

Batch dimensions (leading dimensions beyond each field's declared ``ndim``, see
`qax.array_field`) lead every leaf and take the spec's leading entries. A field that
declares nothing is replicated when the spec partitions only batch dimensions, and is
an error otherwise. Fields holding implicit arrays (QLoRA: a LoRA whose ``w`` is
quantized) get the spec of the array they hold, and their own leaves follow from it.

Fields declared ``qax.array_field(..., stored=True)`` (the `qax.quant` types' codes and
scales) are moved between devices as stored: in a staged program, a product that takes
the implicit array reshards those leaves to the layout it needs before the handler
decodes them, so FSDP gathers int8 / uint8 codes, not the floats they decode to. Inside
`shard_map`, `jax.lax.all_gather` of an implicit array gathers the leaves that run along
the gathered dimension (as stored) and keeps the others.

Examples:
    On 8 devices, with `params` holding implicit arrays, `specs` the dense weights'
    `PartitionSpec`s and a `train_step` of your own (not run by the docstring test,
    which has one device):

    ```python
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    shardings = qax.sharding.implicit_shardings(params, specs, mesh)
    params = jax.device_put(params, shardings)
    step = jax.jit(train_step, in_shardings=(shardings, ...), out_shardings=...)
    ```
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Final

import jax
from jax.sharding import NamedSharding, PartitionSpec

from ._base import ImplicitBase
from ._partition import Undeclared, expand_spec, field_dims, is_spec_leaf
from ._tree_util import path_string

__all__ = ["field_dims", "implicit_shardings", "implicit_specs"]

_EXPLICIT = "; or pass an explicit sharding for each leaf."

INDIVISIBLE_LEAF: Final = (
    "qax.sharding: the field {field!r} of the {cls} at {path!r} has shape {shape}; its "
    "dimension {dim} (size {n}) cannot be split {ways} ways along mesh axis {axis!r} "
    "(the spec of the dense array asks for that split of the dimension it runs along; "
    "block scales have one entry per block). That dimension of the field is "
    "replicated instead; the other leaves keep the spec. To split it, choose a block "
    "size that leaves a multiple of {ways} blocks, or a spec along another axis."
)


def _expand(x: Any, spec: PartitionSpec) -> Any:
    """`expand_spec`, raising where a field declares nothing that `spec` needs."""

    def check(s: Any) -> Any:
        if isinstance(s, Undeclared):
            raise ValueError(s.message + _EXPLICIT)
        return s

    return jax.tree_util.tree_map(check, expand_spec(x, spec), is_leaf=is_spec_leaf)


def implicit_specs(tree: Any, specs: Any) -> Any:
    """A `PartitionSpec` for every leaf of `tree`, from the specs of the dense arrays.

    `specs` has the structure of `tree` down to its arrays, with implicit arrays counted
    as arrays: one `PartitionSpec` (or `None`: replicated) where `tree` holds an array or
    an implicit array, or at any subtree to apply to all of it (a prefix, as for
    `jax.jit`'s shardings). Each implicit array's spec is the spec of the dense array it
    represents; its leaves get specs as its type declares (see the module docstring).

    Examples:
        >>> specs = qax.sharding.implicit_specs({"w": lora}, {"w": P(None, "model")})
        >>> specs["w"].a, specs["w"].b
        (PartitionSpec(None, None), PartitionSpec('model', None))

    Args:
      tree: a pytree that may hold implicit arrays (at any depth, nested too).
      specs: a prefix of `tree` (implicit arrays as leaves) of `PartitionSpec`s.

    Returns:
      A pytree with the structure of `tree` (implicit arrays included, as instances of
      their own types) whose leaves are `PartitionSpec`s; with a mesh, shardings (see
      `implicit_shardings`). For `shard_map`, call it inside `qax.use_implicit_args`
      and give it the dense specs: qax splits the leaves as here and hands the body
      implicit arrays of the local shape. (A `shard_map` outside the wrapper, given
      these specs, splits the leaves but keeps each implicit array's global shape.)

    Raises:
      ValueError: a spec is longer than its array's rank, or partitions a dimension
        that a field of an implicit array does not declare (see `qax.array_field`).
    """

    def expand_subtree(spec: Any, subtree: Any) -> Any:
        spec = PartitionSpec() if spec is None else spec
        return jax.tree_util.tree_map(
            lambda x: _expand(x, spec),
            subtree,
            is_leaf=lambda y: isinstance(y, ImplicitBase),
        )

    return jax.tree_util.tree_map(expand_subtree, specs, tree, is_leaf=is_spec_leaf)


def implicit_shardings(tree: Any, specs: Any, mesh: jax.sharding.Mesh) -> Any:
    """A `NamedSharding` on `mesh` for every leaf of `tree` (see `implicit_specs`).

    The result has the structure of `tree`, so it serves `jax.device_put(tree, ...)`,
    `jax.jit(..., in_shardings=..., out_shardings=...)` and orbax restore targets.

    Examples:
        On 8 devices, with `params` and `specs` as in `implicit_specs` (not run by the
        docstring test, which has one device):

        ```python
        mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
        shardings = qax.sharding.implicit_shardings(params, specs, mesh)
        params = jax.device_put(params, shardings)
        ```

    Args:
      tree: a pytree that may hold implicit arrays.
      specs: a prefix of `tree` (implicit arrays as leaves) of `PartitionSpec`s for the
        dense arrays.
      mesh: the device mesh.

    Returns:
      The pytree of `NamedSharding`s. A dimension of an implicit array's leaf that
      the mesh cannot split evenly (an NF4 weight of 2 blocks along a dimension split
      4 ways: its scales have 2 rows) is replicated in that leaf, with a warning that
      names the weight, the field and the mesh axis; the other leaves keep the spec.

    Raises:
      ValueError: as `implicit_specs`.
    """
    notes: list[str] = []
    fitted = _fit_to_mesh(tree, implicit_specs(tree, specs), mesh, notes)
    for note in notes:
        warnings.warn(note, stacklevel=2)
    return jax.tree_util.tree_map(
        lambda spec: NamedSharding(mesh, spec), fitted, is_leaf=is_spec_leaf
    )


def _fit_to_mesh(
    tree: Any, specs: Any, mesh: jax.sharding.Mesh, notes: list[str]
) -> Any:
    """`specs` with each dimension of an implicit array's leaf that the mesh cannot
    split evenly (the block scales of a weight with fewer blocks than devices along
    the split) replicated; `notes` gets a message naming each."""
    sizes = dict(mesh.shape)

    def ways(entry: Any) -> tuple[int, Any]:
        names = entry if isinstance(entry, tuple) else (entry,)
        return math.prod(sizes.get(n, 1) for n in names), entry

    def one(path: Any, spec_node: Any, x: Any) -> Any:
        if not isinstance(x, ImplicitBase):
            return spec_node
        leaves = jax.tree_util.tree_flatten_with_path(x)[0]
        leaf_specs, treedef = jax.tree_util.tree_flatten(
            spec_node, is_leaf=is_spec_leaf
        )
        out = []
        for (where, leaf), spec in zip(leaves, leaf_specs, strict=True):
            entries = list(spec)
            for dim, entry in enumerate(entries):
                n = jax.numpy.shape(leaf)[dim]
                k, axis = ways(entry)
                if entry is None or n % k == 0:
                    continue
                entries[dim] = None
                notes.append(
                    INDIVISIBLE_LEAF.format(
                        field=path_string(where),
                        cls=type(x).__name__,
                        path=path_string(path),
                        shape=tuple(jax.numpy.shape(leaf)),
                        dim=dim,
                        n=n,
                        ways=k,
                        axis=axis,
                    )
                )
            out.append(PartitionSpec(*entries))
        return treedef.unflatten(out)

    return jax.tree_util.tree_map_with_path(
        one,
        specs,
        tree,
        is_leaf=lambda y: isinstance(y, ImplicitBase) or is_spec_leaf(y),
    )
