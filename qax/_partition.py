"""How an implicit array's leaves are partitioned when the array it represents is.

A `PartitionSpec` written for a dense array (``w [m, n]`` as ``P(None, "model")``)
says nothing directly about the leaves of an implicit array standing for it: LoRA's
``a [m, r]`` and ``b [n, r]``, int8 codes ``[m, n]`` and scales ``[n]``. Each field's
dimensions follow dimensions of the represented array as its type *declares*
(``qax.array_field(ndim=k, follows=...)`` or a ``field_dims()`` method), never as its
shape happens to suggest (a square LoRA with ``r == n`` has ``a`` and ``w`` of the
same shape, but ``a``'s second dimension is the rank).

Batch dimensions (leading dimensions beyond each field's declared ``ndim``) lead every
leaf and take the spec's leading entries. A field that declares nothing may only be
replicated along the array's own dimensions; when the spec partitions one of those,
the caller decides (`qax.sharding` raises, the structural rules fall back and warn).

Used by `qax.sharding` (placement) and by the rules for `jit` shardings,
`with_sharding_constraint`, `device_put` and `shard_map` (`qax/_rules/`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.sharding import PartitionSpec

from . import _errors
from ._base import NB, ImplicitBase
from ._fields import FOLLOWS, fields_of, rebuild


def field_dims(x: ImplicitBase) -> dict[str, tuple[int | None, ...]]:
    """Which dimension of the represented array each dimension of each field runs along.

    Read from ``x.field_dims()`` when the type defines it, else from the ``follows=``
    declarations of its fields (`qax.array_field`). Fields that declare nothing are
    absent.

    Examples:
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


class Undeclared:
    """The spec of a field that declares nothing, where the spec needs a declaration.

    Attributes:
      message: why (names the field and how to declare it).
    """

    def __init__(self, message: str):
        self.message = message

    def __repr__(self) -> str:
        return "Undeclared()"


def child_specs(x: ImplicitBase, spec: PartitionSpec) -> dict[str, Any]:
    """The spec of each child field of `x` when the array `x` represents gets `spec`.

    Args:
      x: an implicit array.
      spec: a `PartitionSpec` for an array of shape ``x.shape``.

    Returns:
      A dict from child field name to a `PartitionSpec` (for a field holding an
      implicit array: the spec of the array it represents), or an `Undeclared` when
      the field declares nothing and `spec` partitions one of the array's own
      (non-batch) dimensions.

    Raises:
      ValueError: `spec` is longer than the array's rank, or a declaration names a
        dimension the array does not have.
    """
    shape = tuple(x.shape)
    if len(spec) > len(shape):
        raise ValueError(
            _errors.SPEC_TOO_LONG.format(
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
    out = {}
    for name in fields_of(type(x)).children:
        follows = dims.get(name)
        if follows is None:
            if any(e is not None for e in inner):
                out[name] = Undeclared(
                    _errors.UNDECLARED_FIELD.format(
                        spec=spec, cls=type(x).__name__, shape=shape, field=name
                    )
                )
            else:
                out[name] = PartitionSpec(*batch)
            continue
        if any(d is not None and d >= len(inner) for d in follows):
            raise ValueError(
                _errors.BAD_FOLLOWS.format(
                    cls=type(x).__name__,
                    field=name,
                    follows=follows,
                    leaf_ndim=len(follows),
                    nb=nb,
                    ndim=len(inner),
                )
            )
        out[name] = PartitionSpec(
            *batch, *(None if d is None else inner[d] for d in follows)
        )
    return out


def is_spec_leaf(x: Any) -> bool:
    """The leaves of a tree of specs (`None` included, as JAX's shardings treat it)."""
    return x is None or isinstance(x, (PartitionSpec, Undeclared))


def expand_spec(x: Any, spec: Any) -> Any:
    """`spec` for a plain value; for an implicit array, a copy holding its leaves' specs.

    The copy has the type and tree structure of `x` with a `PartitionSpec` (or an
    `Undeclared`, for every leaf of an undeclared field) in place of each leaf, so
    ``jax.tree_util.tree_leaves(copy, is_leaf=is_spec_leaf)`` lines up with
    ``jax.tree_util.tree_leaves(x)``.
    """
    if not isinstance(x, ImplicitBase):
        return spec
    children = {}
    for name, child_spec in child_specs(x, spec).items():
        child = x.__dict__[name]
        if isinstance(child_spec, Undeclared):
            children[name] = jax.tree_util.tree_map(lambda _, s=child_spec: s, child)
            continue
        children[name] = jax.tree_util.tree_map(
            lambda leaf, s=child_spec: expand_spec(leaf, s),
            child,
            is_leaf=lambda y: isinstance(y, ImplicitBase),
        )
    return rebuild(x, children, tuple(x.shape), x.__dict__.get(NB, 0))


def leaf_specs(x: ImplicitBase, spec: PartitionSpec) -> list:
    """The spec of each leaf of `x` (in `tree_leaves` order), `Undeclared` included."""
    return jax.tree_util.tree_leaves(
        expand_spec(x, spec),
        is_leaf=lambda s: isinstance(s, (PartitionSpec, Undeclared)),
    )


def first_undeclared(specs: list) -> Undeclared | None:
    """The first `Undeclared` among `specs`, if any."""
    return next((s for s in specs if isinstance(s, Undeclared)), None)
