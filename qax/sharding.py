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

>>> mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
>>> shardings = qax.sharding.implicit_shardings(params, specs, mesh)
>>> params = jax.device_put(params, shardings)
>>> step = jax.jit(train_step, in_shardings=(shardings, ...), out_shardings=...)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from ._base import ImplicitBase
from ._batching import FOLLOWS, NB, fields_of, rebuild

__all__ = ["field_dims", "implicit_shardings", "implicit_specs"]

_UNDECLARED = (
    "The partition spec {spec} for a {cls} of shape {shape} partitions dimensions of "
    "the array, but its field `{field}` does not declare which of them it runs along, so "
    "qax cannot say how to partition it. Declare it on the type: "
    "`{field}: qax.ArrayValue = qax.array_field(ndim=k, follows=(...))` (for each of "
    "the field's dimensions, the dimension of the array it runs along, or None), or "
    "define `field_dims(self)` returning such tuples by field name; or pass an explicit "
    "sharding for each leaf."
)
_TOO_LONG = (
    "The partition spec {spec} has {n} entries, but the {cls} it is given for has shape "
    "{shape} ({ndim} dimensions)."
)
_BAD_DIMS = (
    "{cls}: field `{field}` declares that its dimensions follow {follows}, but it has "
    "{leaf_ndim} dimensions beyond the {nb} batch dimension(s) and the array has "
    "{ndim}; every entry must be None or a dimension of the unbatched array."
)


def field_dims(x: ImplicitBase) -> dict[str, tuple[int | None, ...]]:
    """Which dimension of the represented array each dimension of each field runs along.

    Read from ``x.field_dims()`` when the type defines it, else from the ``follows=``
    declarations of its fields (`qax.array_field`). Fields that declare nothing are
    absent.

    >>> qax.sharding.field_dims(LoraMatrix(w, a, b))
    {'w': (0, 1), 'a': (0, None), 'b': (1, None)}

    Args:
      x: an implicit array.

    Returns:
      A dict from field name to one entry per unbatched dimension of the field: a
      dimension of the (unbatched) represented array, or `None`.

    Raises:
      TypeError: `x` is not an implicit array.
    """
    if not isinstance(x, ImplicitBase):
        raise TypeError(f"field_dims takes an implicit array, got {type(x).__name__}.")
    hook = getattr(x, "field_dims", None)
    if callable(hook):
        return {name: tuple(dims) for name, dims in hook().items()}
    return {
        f.name: f.metadata[FOLLOWS]
        for f in dataclasses.fields(x)
        if FOLLOWS in f.metadata
    }


def _is_spec_leaf(x: Any) -> bool:
    return x is None or isinstance(x, PartitionSpec)


def _expand(x: Any, spec: PartitionSpec) -> Any:
    """`spec` for a plain leaf; for an implicit array, a copy holding its leaves' specs."""
    if not isinstance(x, ImplicitBase):
        return spec
    shape = tuple(x.shape)
    if len(spec) > len(shape):
        raise ValueError(
            _TOO_LONG.format(
                spec=spec,
                n=len(spec),
                cls=type(x).__name__,
                shape=shape,
                ndim=len(shape),
            )
        )
    entries = (*spec, *([None] * (len(shape) - len(spec))))
    nb = x.__dict__.get(NB) or 0
    batch, inner = entries[:nb], entries[nb:]
    dims = field_dims(x)
    children = {}
    for name in fields_of(type(x)).children:
        child = x.__dict__[name]
        follows = dims.get(name)
        if follows is None:
            if any(e is not None for e in inner):
                raise ValueError(
                    _UNDECLARED.format(
                        spec=spec, cls=type(x).__name__, shape=shape, field=name
                    )
                )
            child_spec = PartitionSpec(*batch)
        else:
            if any(d is not None and d >= len(inner) for d in follows):
                raise ValueError(
                    _BAD_DIMS.format(
                        cls=type(x).__name__,
                        field=name,
                        follows=follows,
                        leaf_ndim=len(follows),
                        nb=nb,
                        ndim=len(inner),
                    )
                )
            child_spec = PartitionSpec(
                *batch, *(None if d is None else inner[d] for d in follows)
            )
        children[name] = jax.tree_util.tree_map(
            lambda leaf, s=child_spec: _expand(leaf, s),
            child,
            is_leaf=lambda y: isinstance(y, ImplicitBase),
        )
    return rebuild(x, children, shape, x.__dict__.get(NB, 0))


def implicit_specs(tree: Any, specs: Any) -> Any:
    """A `PartitionSpec` for every leaf of `tree`, from the specs of the dense arrays.

    `specs` has the structure of `tree` down to its arrays, with implicit arrays counted
    as arrays: one `PartitionSpec` (or `None`: replicated) where `tree` holds an array or
    an implicit array, or at any subtree to apply to all of it (a prefix, as for
    `jax.jit`'s shardings). Each implicit array's spec is the spec of the dense array it
    represents; its leaves get specs as its type declares (see the module docstring).

    >>> specs = qax.sharding.implicit_specs({"w": lora}, {"w": P(None, "model")})
    >>> specs["w"].a, specs["w"].b
    (PartitionSpec(None, None), PartitionSpec('model', None))

    Args:
      tree: a pytree that may hold implicit arrays (at any depth, nested too).
      specs: a prefix of `tree` (implicit arrays as leaves) of `PartitionSpec`s.

    Returns:
      A pytree with the structure of `tree` (implicit arrays included, as instances of
      their own types) whose leaves are `PartitionSpec`s: usable as `shard_map` specs or,
      with a mesh, as shardings (see `implicit_shardings`).

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

    return jax.tree_util.tree_map(expand_subtree, specs, tree, is_leaf=_is_spec_leaf)


def implicit_shardings(tree: Any, specs: Any, mesh: jax.sharding.Mesh) -> Any:
    """A `NamedSharding` on `mesh` for every leaf of `tree` (see `implicit_specs`).

    The result has the structure of `tree`, so it serves `jax.device_put(tree, ...)`,
    `jax.jit(..., in_shardings=..., out_shardings=...)` and orbax restore targets.

    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    >>> shardings = qax.sharding.implicit_shardings(params, specs, mesh)
    >>> params = jax.device_put(params, shardings)

    Args:
      tree: a pytree that may hold implicit arrays.
      specs: a prefix of `tree` (implicit arrays as leaves) of `PartitionSpec`s for the
        dense arrays.
      mesh: the device mesh.

    Returns:
      The pytree of `NamedSharding`s.

    Raises:
      ValueError: as `implicit_specs`.
    """
    return jax.tree_util.tree_map(
        lambda spec: NamedSharding(mesh, spec),
        implicit_specs(tree, specs),
        is_leaf=_is_spec_leaf,
    )
