"""The field schema of implicit arrays: which dataclass fields are children (pytree
leaves) or aux data (static metadata), the declared rank of each child, and the batch
dimensions an instance's children carry.

A field declared with ``qax.array_field(ndim=k)`` has `k` dimensions in one unbatched
array; every further leading dimension of its leaves is a batch dimension. A stacked
`LoraMatrix` (``w [L,m,n]``, ``a [L,m,r]``, ``b [L,n,r]`` with each field declared
``ndim=2``) has one batch dimension and represents an array of shape ``(L, m, n)``:
row ``i`` is the `LoraMatrix` of ``w[i]``, ``a[i]``, ``b[i]``. All fields of one value
carry the same batch dimensions. A type *declares its batching* when every child field
has a declared `ndim` (`batchable`); nothing here is guessed from leaf shapes.

The number of batch dimensions is cached on each instance (`NB`); `None` there means
that the leaves do not fit the declaration (e.g. they were sliced through an unbatched
dimension by a `tree_map` or a `lax.scan` outside `use_implicit_args`). How `vmap` and
`scan` use the schema is `qax._batching`'s concern.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from . import _errors
from ._base import NB, ImplicitBase

AUX = "qax_aux"
NDIM = "qax_ndim"
FOLLOWS = "qax_follows"
STORED = "qax_stored"


def aux_field(metadata: dict | None = None, **kwargs: Any) -> Any:
    """A dataclass field that is static metadata (pytree aux data), not a child.

    Values must be hashable; they become part of the treedef, so `jax.jit` treats them
    as static and `jax.grad`/`jax.vmap` leave them alone.

    Examples:
        >>> @dataclass
        ... class Scaled(qax.ImplicitArray):
        ...     x: qax.ArrayValue
        ...     scale: float = qax.aux_field(default=2.0)
    """
    metadata = dict(metadata) if metadata else {}
    metadata[AUX] = True
    return dataclasses.field(metadata=metadata, **kwargs)


def array_field(
    *,
    ndim: int | str,
    follows: tuple[int | None, ...] | None = None,
    stored: bool = False,
    metadata: dict | None = None,
    **kwargs: Any,
) -> Any:
    """A child field whose leaves have `ndim` dimensions in one unbatched array.

    Declaring every array field this way lets `vmap`, `lax.scan` and `lax.map` slice and
    stack the implicit array leaf by leaf (keeping it implicit): leading dimensions of a
    leaf beyond `ndim` are batch dimensions, shared by all fields of the value, and
    `materialize()` of a batched value runs once per batch element (vmapped).

    Examples:
        >>> @dataclass
        ... class LoraMatrix(qax.ImplicitArray):
        ...     w: qax.ArrayValue = qax.array_field(ndim=2)
        ...     a: qax.ArrayValue = qax.array_field(ndim=2)
        ...     b: qax.ArrayValue = qax.array_field(ndim=2)
        ...
        ...     def materialize(self):
        ...         return self.w + self.a @ self.b.T
        >>> stacked = LoraMatrix(jnp.ones((4, 6, 5)), jnp.ones((4, 6, 2)), jnp.ones((4, 5, 2)))
        >>> stacked.shape
        (4, 6, 5)

    When the rank differs between instances (a weight type used for matrices and for
    conv kernels), `ndim` names an `aux_field` that holds it. If that field is `None`
    when an instance is constructed, the instance is unbatched: the field is set to the
    rank of this field's value.

    Examples:
        >>> @dataclass
        ... class Scaled(qax.ImplicitArray):
        ...     x: qax.ArrayValue = qax.array_field(ndim="x_ndim")
        ...     s: qax.ArrayValue = qax.array_field(ndim=0)
        ...     x_ndim: int | None = qax.aux_field(default=None)
        ...
        ...     def materialize(self):
        ...         return self.x * self.s
        >>> Scaled(jnp.ones((3, 3, 3)), jnp.ones(())).x_ndim
        3

    Args:
      ndim: the number of dimensions of this field in one unbatched array (for a field
        holding an implicit array: the rank of the array it represents), or the name
        of an `aux_field` holding that number.
      follows: optional, one entry per unbatched dimension of the field (so `ndim` must
        be a number): the dimension of the represented (unbatched) array it runs along,
        or `None` for a dimension of its own (a LoRA rank, a size-1 scale axis).
        `qax.sharding` partitions the field along the dimensions it follows (LoRA's
        ``a`` [m, r]: ``follows=(0, None)``). Types whose ranks vary per instance
        declare this with a `field_dims()` method instead (see `qax.sharding`).
      stored: the field holds compact storage that handlers decode (quantized codes,
        their scales). In a program split over devices, its leaves are moved between
        devices as stored, and handlers and `materialize()` decode them after the move
        (an FSDP all-gather of int8 codes moves int8, not the floats they decode to).
        Nothing changes on one device. See `qax.sharding`.
      metadata: extra dataclass field metadata.
      **kwargs: passed to `dataclasses.field` (e.g. `default`).

    Returns:
      A dataclass field.

    Raises:
      ValueError: `ndim` is not a non-negative integer, or `follows` does not give
        one dimension (or `None`) for each of the field's `ndim` dimensions.
    """
    if not isinstance(ndim, str) and (
        isinstance(ndim, bool) or not isinstance(ndim, int) or ndim < 0
    ):
        raise ValueError(
            "array_field(ndim=...) takes an integer >= 0 or the name of an aux_field, "
            f"got {ndim!r}."
        )
    metadata = dict(metadata) if metadata else {}
    metadata[NDIM] = ndim
    if stored:
        metadata[STORED] = True
    if follows is not None:
        follows = tuple(follows)
        if (
            isinstance(ndim, str)
            or len(follows) != ndim
            or not all(
                d is None or (isinstance(d, int) and not isinstance(d, bool) and d >= 0)
                for d in follows
            )
        ):
            raise ValueError(
                f"array_field(ndim={ndim}, follows={follows!r}): `follows` needs one "
                "entry per dimension of the field, each a dimension of the represented "
                "array (an integer >= 0) or None (a dimension of the field's own), e.g. "
                "`follows=(0, None)` for a LoRA factor `a` of shape [m, rank]. A type "
                "whose ranks vary per instance defines `field_dims()` instead."
            )
        metadata[FOLLOWS] = follows
    return dataclasses.field(metadata=metadata, **kwargs)


# ----------------------------------------------------------------------------------------
# Class-level declarations


@dataclasses.dataclass(frozen=True)
class Fields:
    """A class's child and aux field names, and the declared ranks of the children."""

    children: tuple[str, ...]
    aux: tuple[str, ...]
    ndims: tuple[int | str | None, ...]
    dynamic: bool = False  # some rank is held by an aux field
    stored: tuple[str, ...] = ()  # children declared `array_field(stored=True)`
    # Every child has a declared rank (read on every new instance: computed once).
    declared: bool = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "declared", all(n is not None for n in self.ndims))

    def ranks(self, d: dict) -> tuple:
        """The declared ranks of the children of the instance whose `__dict__` is `d`."""
        if not self.dynamic:
            return self.ndims
        return tuple(d.get(n) if isinstance(n, str) else n for n in self.ndims)


def fields_of(cls: type) -> Fields:
    cached = cls.__dict__.get("_qax_fields")
    if cached is None:
        children, aux, ndims, stored = [], [], [], []
        for f in dataclasses.fields(cls):
            if f.name in ("shape", "dtype"):
                continue
            if f.metadata.get(AUX):
                aux.append(f.name)
            else:
                children.append(f.name)
                ndims.append(f.metadata.get(NDIM))
                if f.metadata.get(STORED):
                    stored.append(f.name)
        for name, ndim in zip(children, ndims):
            if isinstance(ndim, str) and ndim not in aux:
                raise TypeError(
                    f"{cls.__name__}.{name} is declared with array_field(ndim={ndim!r}), "
                    f"but {cls.__name__} has no aux_field named {ndim!r} to hold it."
                )
        dynamic = any(isinstance(n, str) for n in ndims)
        cached = Fields(
            tuple(children), tuple(aux), tuple(ndims), dynamic, tuple(stored)
        )
        type.__setattr__(cls, "_qax_fields", cached)
    return cached


def batch_ndim(x: Any) -> int | None:
    """The number of leading batch dimensions of `x`: those its type declares
    (`qax.array_field`) or that `vmap` stacked; 0 for a plain array.

    None if its leaves no longer fit its type's declaration (sliced through an unbatched
    dimension outside `use_implicit_args`).

    Examples:
        >>> stacked = LoraMatrix(jnp.ones((4, 6, 5)), jnp.ones((4, 6, 2)), jnp.ones((4, 5, 2)))
        >>> qax.utils.batch_ndim(stacked)
        1
    """
    if not isinstance(x, ImplicitBase):
        return 0
    return x.__dict__.get(NB, 0)


def batchable(cls: type) -> bool:
    """Whether values of `cls` may be sliced and stacked leaf by leaf."""
    return fields_of(cls).declared


def stackable(x: Any) -> bool:
    """Whether implicit `x` can be stacked leaf by leaf (recursively)."""
    if not isinstance(x, ImplicitBase):
        return True
    if not batchable(type(x)):
        return False
    d = x.__dict__
    return all(
        stackable(leaf)
        for n in fields_of(type(x)).children
        for leaf in jax.tree_util.tree_leaves(
            d[n], is_leaf=lambda y: isinstance(y, ImplicitBase)
        )
    )


# ----------------------------------------------------------------------------------------
# Instances


def _leading(child: Any) -> list[tuple[int, ...]] | None:
    """The shapes of the array-like leaves of one child (implicit arrays whole)."""
    if child is None:
        return []
    if isinstance(child, ImplicitBase):
        return [tuple(child.shape)] if child.shape is not None else None
    if isinstance(child, (list, tuple, dict)):
        out = []
        for leaf in jax.tree_util.tree_leaves(
            child, is_leaf=lambda x: isinstance(x, ImplicitBase)
        ):
            shapes = _leading(leaf)
            if shapes is None:
                return None
            out += shapes
        return out
    if isinstance(child, (bool, int, float, complex)):
        return []
    shape = getattr(child, "shape", None)
    if shape is None:
        return []
    try:
        return [tuple(shape)]
    except TypeError:
        return None


NO_ARRAYS = "no arrays"


def batch_shape_of(x: ImplicitBase) -> Any:
    """The batch shape the children of `x` carry, per the declaration of its type.

    `()` for an undeclared type, for one without children, and for unbatched values;
    `NO_ARRAYS` if no child holds an array (a mask of booleans, placeholders); `None`
    if the leaves do not fit the declaration.
    """
    fields = fields_of(type(x))
    if not fields.declared or not fields.children:
        return ()
    d = x.__dict__
    return leaf_batch_shape([d.get(n) for n in fields.children], fields.ranks(d))


def leaf_batch_shape(children: list, ndims: tuple) -> Any:
    """`batch_shape_of` for a declared type, fast: its children in field order."""
    found = None
    for child, ndim in zip(children, ndims):
        if ndim is None:
            return None
        shape = getattr(child, "shape", None)
        if shape is not None:
            shapes = (shape,)
        elif isinstance(child, (list, tuple, dict)):
            shapes = _leading(child)
            if shapes is None:
                return None
        else:
            continue  # None, Python scalars, placeholders without a shape
        for shape in shapes:
            n = len(shape) - ndim
            if n < 0:
                return None
            batch = tuple(shape[:n])
            if found is None:
                found = batch
            elif batch != found:
                return None
    return NO_ARRAYS if found is None else found


def shape_only(x: Any) -> bool:
    """Whether `x` is an implicit array of a type without children (a symbolic
    constant): its shape lives in its aux data, so a pytree map or `lax.scan` over the
    leaves of a value that holds it leaves it whole, and `vmap` stacks it as copies of
    one example."""
    return isinstance(x, ImplicitBase) and not fields_of(type(x)).children


def fit_shape_only(children: list, ndims: tuple) -> tuple[list, Any]:
    """`children` (a declared type's, in field order, of declared ranks `ndims`) with
    each shape-only child given the batch shape of the others' leaves, and that batch
    shape; `(children, None)` if the others do not agree or hold no array.

    A stack over a shape-only part (a LoRA over a symbolic-constant base) whose leaves a
    `lax.scan` or a `tree_map` sliced (or stacked) keeps that part's old shape: being the
    same in every example, it takes the batch shape of the leaves beside it.
    """
    keep = [(c, n) for c, n in zip(children, ndims) if not shape_only(c)]
    found = leaf_batch_shape([c for c, _ in keep], tuple(n for _, n in keep))
    if found is None or found is NO_ARRAYS or len(keep) == len(children):
        return children, None
    out = []
    for child, ndim in zip(children, ndims):
        if shape_only(child) and child.shape is not None:
            child = with_batch_shape(child, ndim, found)
            if child is None:
                return children, None
        out.append(child)
    return out, found


def with_batch_shape(x: ImplicitBase, ndim: Any, batch: tuple) -> Any:
    """Shape-only `x`, whose examples have `ndim` axes, with the batch shape `batch`
    before them (`x` itself if it has it), or None if it has fewer axes."""
    shape = tuple(x.shape)
    if not isinstance(ndim, int) or len(shape) < ndim:
        return None
    new = (*batch, *shape[len(shape) - ndim :])
    return x if new == shape else rebuild(x, {}, new, 0)


def check_batch(x: ImplicitBase) -> int:
    """The number of batch dimensions of a new instance, or a clear error.

    Aux fields that hold a rank and are `None` get the rank of their field's value.
    """
    fields = fields_of(type(x))
    if fields.dynamic:
        d = x.__dict__
        for name, ndim in zip(fields.children, fields.ndims, strict=True):
            if isinstance(ndim, str) and d.get(ndim) is None:
                shapes = _leading(d.get(name))
                if shapes:
                    d[ndim] = len(shapes[0])
    batch = batch_shape_of(x)
    if batch is None:
        fields = fields_of(type(x))
        detail = ", ".join(
            f"`{n}` {_describe_shapes(x.__dict__.get(n))} (ndim={k})"
            for n, k in zip(fields.children, fields.ranks(x.__dict__), strict=True)
        )
        raise ValueError(
            _errors.FIELDS_DISAGREE.format(cls=type(x).__name__, detail=detail)
        )
    return 0 if batch is NO_ARRAYS else len(batch)


def _describe_shapes(child: Any) -> str:
    shapes = _leading(child)
    if not shapes:
        return "(no array)"
    return " ".join(str(s) for s in shapes)


def rebuild(x: ImplicitBase, children: dict, shape: tuple, nb: int) -> ImplicitBase:
    """A copy of `x` with some children replaced and the given shape (no checks)."""
    obj = object.__new__(type(x))
    d = obj.__dict__
    d.update(x.__dict__)
    d.pop("_qax_aval_cache", None)
    d.update(children)
    d["shape"], d[NB] = None if shape is None else tuple(shape), nb
    return obj


def children_of(x: ImplicitBase) -> dict[str, Any]:
    """The child fields of implicit `x` by name, in declaration order."""
    d = x.__dict__
    return {n: d[n] for n in fields_of(type(x)).children}


def field_names(cls: type) -> tuple[str, ...]:
    """All dataclass fields of `cls` but shape and dtype: children, then aux."""
    fields = fields_of(cls)
    return fields.children + fields.aux
