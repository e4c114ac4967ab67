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

Across processes (JAX's multi-controller runtime: one process per host,
``jax.distributed.initialize``, a mesh over every host's devices) the same shardings
describe global arrays of which each process holds its own shards. `from_process_local`
builds such implicit arrays from each process's part of their leaves, `conform` places
the leaves that a process made alone (the LoRA factors `qax.lora.loraify` adds to a
global weight) as the type declares for the weight's spec, and `dense_spec` reads the
dense array's spec back from placed leaves. See the multi-host section of the
sharding guide for the launch recipe.

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

from ._base import NB, ImplicitBase
from ._compat import Tracer
from ._fields import fields_of
from ._partition import Undeclared, expand_spec, field_dims, is_spec_leaf
from ._tree_util import path_string

__all__ = [
    "conform",
    "dense_spec",
    "field_dims",
    "from_process_local",
    "implicit_shardings",
    "implicit_specs",
]

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


def _dense_entries(x: Any) -> tuple[Any, list | None]:
    """``(mesh, entries)``: the mesh and spec entries (one per dimension) of the dense
    array `x` stands for, read from its leaves placed with a `NamedSharding`; an entry
    no leaf says anything about is ``None``. ``(None, None)`` when no leaf is placed so."""
    if not isinstance(x, ImplicitBase):
        sharding = getattr(x, "sharding", None)
        if isinstance(x, Tracer) or not isinstance(sharding, NamedSharding):
            return None, None
        spec = list(sharding.spec)
        return sharding.mesh, spec + [None] * (len(x.shape) - len(spec))
    shape = tuple(x.shape)
    nb = x.__dict__.get(NB) or 0
    entries: list = [None] * len(shape)
    mesh = None
    dims = field_dims(x)
    for name in fields_of(type(x)).children:
        follows = dims.get(name)
        if follows is None:
            continue
        child_mesh, child = _dense_entries(x.__dict__[name])
        if child is None or len(child) != nb + len(follows):
            continue
        mesh = mesh or child_mesh
        targets = [*range(nb), *(None if d is None else nb + d for d in follows)]
        for target, entry in zip(targets, child, strict=True):
            if target is not None and entries[target] is None:
                entries[target] = entry
    return mesh, (entries if mesh is not None else None)


def dense_spec(x: Any) -> PartitionSpec | None:
    """The `PartitionSpec` of the dense array that `x` stands for, read from its leaves.

    The inverse of `implicit_specs` for one array: each leaf placed with a
    `NamedSharding` says how the dimensions of the dense array it runs along are split
    (as its type declares, see `field_dims`). A plain array gives its own spec.

    Examples:
        >>> qax.sharding.dense_spec(1.0) is None  # nothing placed on a mesh
        True

    Args:
      x: an implicit array (nested too) or an array.

    Returns:
      The spec (``None`` for dimensions no placed leaf splits), or ``None`` when no
      leaf of `x` has a `NamedSharding` (or `x` is traced).
    """
    _, entries = _dense_entries(x)
    return None if entries is None else PartitionSpec(*entries)


def conform(tree: Any) -> Any:
    """Place every leaf of each implicit array in `tree` as its placed leaves ask.

    An implicit array built from a weight that is already placed on a mesh (a global
    array of a multi-controller run, each process holding its own shards) and from
    values one process made alone (LoRA factors from a PRNG key, scales from a host
    array: on one device, or NumPy) gets those values placed with the shardings its type
    declares for the weight's spec (`dense_spec`, then `implicit_shardings` on that
    mesh). Leaves already placed on a mesh stay where they are; implicit arrays with no
    such leaf, traced ones, those with a field that declares nothing the spec needs
    (see `qax.array_field`) and plain arrays are returned as they are. Every process
    must hold the same values for what it made alone (the same key, the same data), as
    for `jax.device_put` of host data onto a global sharding.

    `qax.lora.loraify` does this for the factors it adds.

    Examples:
        With ``w`` a global array placed on a mesh, ``a`` and ``b`` made in each
        process from the same key (not run by the docstring test, one device):

        ```python
        lora = qax.sharding.conform(qax.lora.LoraWeight(w, a, b))
        lora.a.sharding  # NamedSharding(mesh, spec of w's rows)
        ```

    Args:
      tree: a pytree that may hold implicit arrays.

    Returns:
      `tree` with those leaves placed.
    """

    def one(x: Any) -> Any:
        if not isinstance(x, ImplicitBase):
            return x
        leaves, treedef = jax.tree_util.tree_flatten(x)
        if any(isinstance(leaf, Tracer) for leaf in leaves):
            return x
        placed = [
            isinstance(getattr(v, "sharding", None), NamedSharding) for v in leaves
        ]
        if all(placed) or not any(placed):
            return x
        mesh, entries = _dense_entries(x)
        if entries is None:
            return x
        try:
            shardings = jax.tree_util.tree_leaves(
                implicit_shardings(x, PartitionSpec(*entries), mesh)
            )
        except ValueError:  # a field that declares nothing: left as it was made
            return x
        out = [
            v if done else jax.device_put(v, s)
            for v, done, s in zip(leaves, placed, shardings, strict=True)
        ]
        return treedef.unflatten(out)

    return jax.tree_util.tree_map(
        one, tree, is_leaf=lambda y: isinstance(y, ImplicitBase)
    )


def from_process_local(like: Any, local: Any, shardings: Any) -> Any:
    """Global implicit arrays from each process's part of their leaves.

    In a multi-controller run, each process loads (or computes) only the rows of the
    codes, scales and factors that its devices hold; this puts them together into
    global arrays (`jax.make_array_from_process_local_data`, leaf by leaf), with the
    types, static metadata and shapes of `like`. Nothing is gathered: each process
    passes only its own part.

    Examples:
        Each of two processes holding half the rows of an int8 weight (not run by the
        docstring test, one process):

        ```python
        like = jax.eval_shape(lambda: qax.quant.Int8Weight.from_array(w_global_shape))
        shardings = qax.sharding.implicit_shardings(like, P("data"), mesh)
        local = {"q": q_rows, "scale": scale}  # this process's part of each leaf
        weight = qax.sharding.from_process_local(like, local, shardings)
        ```

    Args:
      like: a pytree holding implicit arrays of the global shapes (its leaves give the
        global shapes only: ``jax.ShapeDtypeStruct``s from `jax.eval_shape`, or
        arrays).
      local: this process's part of each leaf of `like`, in the order of
        ``jax.tree.leaves(like)`` (any pytree with those leaves in that order: a tree
        like `like`, a list, a dict of a type's fields in field order), as NumPy or
        JAX arrays; a leaf replicated over the processes is passed whole.
      shardings: `NamedSharding`s for the leaves of `like` (a tree like `like`, as
        `implicit_shardings` returns).

    Returns:
      `like` with global arrays as leaves.

    Raises:
      ValueError: `local` or `shardings` has another number of leaves than `like`.
    """
    target, treedef = jax.tree_util.tree_flatten(like)
    parts = jax.tree_util.tree_leaves(local)
    placements = jax.tree_util.tree_leaves(
        shardings, is_leaf=lambda s: isinstance(s, jax.sharding.Sharding)
    )
    if not len(target) == len(parts) == len(placements):
        raise ValueError(
            f"qax.sharding.from_process_local: `like` has {len(target)} leaves, "
            f"`local` {len(parts)} and `shardings` {len(placements)}; pass one part "
            "and one sharding per leaf of `like`, in the order of jax.tree.leaves(like)."
        )
    out = [
        jax.make_array_from_process_local_data(s, part, tuple(t.shape))
        for t, part, s in zip(target, parts, placements, strict=True)
    ]
    return treedef.unflatten(out)
