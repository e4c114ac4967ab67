"""`ImplicitArray`: the dataclass users subclass, with its pytree and shape machinery."""

from __future__ import annotations

import copy
import dataclasses
import functools
import operator
import warnings
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import numpy as np

from . import _base as base
from . import _integrations, _outside
from ._base import (
    NB,
    STACKED,
    ImplicitBase,
    check_declared_avals,
)
from ._batching import leaf_ranks, per_element, register_batching, undeclared_layout
from ._compat import (
    ShapedArray,
    Tracer,
    current_trace,
    is_eval_trace,
    varying_aval,
    varying_axes,
)
from ._entry import enter_current_trace, implicit_args_active, use_implicit_args
from ._errors import UninitializedAval
from ._fields import (
    NO_ARRAYS,
    aux_field,
    check_batch,
    fields_of,
    fit_shape_only,
    leaf_batch_shape,
)
from ._interpreter import ImplicitTracer, implicit_children
from ._report import quietly

# Instance attribute caching `aval` (keyed by shape and dtype, in case they are reassigned).
_AVAL_CACHE = "_qax_aval_cache"


def _pytree_functions(cls: type) -> tuple[Callable, Callable, Callable]:
    """Flatten (with and without keys) and unflatten functions for `cls`.

    Children are the declared fields, in order; the aux data is the aux fields, shape,
    dtype and number of batch dimensions. These run on every `jit` call, so they are
    specialized per class.
    """
    fields = fields_of(cls)
    names, aux_names, ndims = fields.children, fields.aux, fields.ndims
    keys = tuple(jax.tree_util.GetAttrKey(n) for n in names)
    # A type that declares its fields' ranks gets its batch shape from its leaves (after
    # `vmap`, `scan` or a `tree_map` sliced or stacked them); one that declares nothing
    # records its leaves' ranks in the aux data and compares them (`undeclared_layout`).
    declared = fields.declared and bool(names)
    dynamic = fields.dynamic

    if declared or not names:

        def aux_data(d: dict) -> tuple:
            aux = tuple([d[n] for n in aux_names]) if aux_names else ()
            return (aux, d["shape"], d["dtype"], d.get(NB, 0), None)

    else:  # the leaves' ranks in one example: see `undeclared_layout`

        def aux_data(d: dict) -> tuple:
            aux = tuple([d[n] for n in aux_names]) if aux_names else ()
            ranks = d.get(STACKED) or leaf_ranks([d[n] for n in names])
            return (aux, d["shape"], d["dtype"], d.get(NB, 0), ranks)

    def flatten(x):
        d = x.__dict__
        return [d[n] for n in names], aux_data(d)

    def flatten_with_keys(x):
        d = x.__dict__
        return list(zip(keys, [d[n] for n in names])), aux_data(d)

    def unflatten(aux_data, children):
        obj = object.__new__(cls)
        d = obj.__dict__
        d.update(zip(names, children))
        aux_values, shape, dtype, nb, ranks = aux_data
        if aux_names:
            d.update(zip(aux_names, aux_values))
        if declared and nb is not None and shape is not None:
            ranks_ = fields.ranks(d) if dynamic else ndims
            batch = leaf_batch_shape(children, ranks_)
            if batch is None:  # a shape-only part beside sliced or stacked leaves?
                children, batch = fit_shape_only(children, ranks_)
                d.update(zip(names, children))
            if batch is None:
                nb = None  # leaves that do not fit the declaration (see _check_entry)
            elif batch is not NO_ARRAYS and (len(batch) != nb or shape[:nb] != batch):
                shape, nb = (*batch, *shape[nb:]), len(batch)
        d["shape"], d["dtype"], d[NB] = shape, dtype, nb
        if ranks is not None:
            undeclared_layout(obj, children, ranks)
        return obj

    return flatten, flatten_with_keys, unflatten


def _wrap_materialize(cls: type) -> None:
    """Make `cls.materialize` run once per batch element on a batched value."""
    own = cls.__dict__.get("materialize")
    if own is None or getattr(own, "_qax_per_element", False):
        return

    @functools.wraps(own)
    def materialize(self):
        if self.__dict__.get(NB):
            return per_element(materialize, self)
        return own(self)

    materialize._qax_per_element = True
    type.__setattr__(cls, "materialize", materialize)


def _enter_built(value: ImplicitBase) -> Any:
    """`value`, just built by the user's code, as a value of the current trace when
    `use_implicit_args` is active (see `ImplicitBase`'s metaclass).

    A value of a type that declares no batch axes whose `materialize()` does not give
    its declared shape (a stack built by hand with the shape of one example, as the
    original Qax's types were) stays the plain pytree it was there: `jax.vmap` then
    maps its leaves, as it does without `use_implicit_args`.
    """
    if is_eval_trace(current_trace()):
        return value
    if not fields_of(type(value)).declared and (
        # (the shape probe traces `materialize()`: only where there is a trace to
        # enter; `enter_current_trace` finds that out itself for the others)
        not implicit_args_active() or not _fits_its_shape(value)
    ):
        return value
    wrapped = enter_current_trace((value,))
    if wrapped is None:
        return value
    if isinstance(wrapped[0], ImplicitTracer):
        wrapped[0].value.__dict__[base.BUILT] = True
    return wrapped[0]


def _fits_its_shape(value: ImplicitBase) -> bool:
    for leaf in jax.tree_util.tree_leaves(value):
        if isinstance(leaf, ImplicitTracer) or not hasattr(leaf, "shape"):
            return True  # (implicit or non-array leaves: nothing cheap to compare)
    try:
        with quietly():
            out = _materialized_aval(value)
    except Exception:  # noqa: BLE001 (it cannot materialize as declared)
        return False
    return tuple(out.shape) == tuple(value.shape)


base.enter_built[0] = _enter_built


def _implicit_method(fn: Callable) -> Callable:
    """An array method that runs `fn` through the interpreter."""

    implicit_fn = use_implicit_args(fn)

    def method(*args):
        wrapped = enter_current_trace(args)
        if wrapped is not None:
            return fn(*wrapped)
        return implicit_fn(*args)

    method.__name__ = getattr(fn, "__name__", "method")
    return method


def _reflected(fn: Callable) -> Callable:
    return lambda a, b: fn(b, a)


def _method(name: str) -> Callable:
    """The array method `name`, run through the interpreter."""

    def call(self, *args, **kwargs):
        return _implicit_method(lambda x: getattr(x, name)(*args, **kwargs))(self)

    call.__name__ = name
    return call


_OWN_DUNDERS = ("__eq__", "__ne__", "__hash__", "__repr__")


@dataclasses.dataclass(eq=False, repr=False)
class ImplicitArray(ImplicitBase):
    """An array represented implicitly: subclass it, add fields, write `materialize()`.

    Subclasses are dataclasses (with or without an explicit ``@dataclass``) and pytrees
    with keys: fields are children, `aux_field` fields are static metadata. Every instance
    has keyword-only `shape` and `dtype`, resolved in this order: the keyword arguments;
    `compute_shape()` / `compute_dtype()`; the class attributes `default_shape` /
    `default_dtype`; `jax.eval_shape` of `materialize()`.

    Class keywords: ``commute_ops=False`` (do not swap operands of commutative binary
    primitives to put this type first), ``warn_on_materialize=False`` (materialize
    silently when no handler applies).

    The class attribute ``batch_axes_advice`` (a string, default ``None``) is what the
    warning tells your users when `vmap` or `lax.scan` needs a batch axis that a value
    of this type lacks (e.g. a weight built over layers stacked for `lax.scan` without
    declaring the stack): name the argument that builds it stacked, as `qax.lora.LoraWeight`
    names ``qax.lora.loraify(..., batch_ndim=1)``. Without it, the warning says how to
    declare batch axes on the type.

    Examples:
        >>> class Zeros(qax.ImplicitArray):
        ...     default_dtype = jnp.float32
        ...     def materialize(self):
        ...         return jnp.zeros(self.shape, self.dtype)
        >>> Zeros(shape=(2, 3))
        Zeros(shape=(2, 3), dtype=float32)
    """

    shape: Any = aux_field(kw_only=True, default=None)
    dtype: Any = aux_field(kw_only=True, default=None)

    default_shape: ClassVar[Any] = None
    default_dtype: ClassVar[Any] = None

    def __init_subclass__(
        cls,
        commute_ops: bool | None = None,
        warn_on_materialize: bool | None = None,
        **kwargs: Any,
    ):
        super().__init_subclass__(**kwargs)
        if commute_ops is not None:
            cls.commute_ops = bool(commute_ops)
        if warn_on_materialize is not None:
            cls.warn_on_materialize = bool(warn_on_materialize)
        # Array semantics for ==, != and hashing, and our repr, must survive a later
        # user-applied @dataclass, which only fills in methods the class lacks.
        for name in _OWN_DUNDERS:
            if name not in cls.__dict__:
                setattr(cls, name, getattr(ImplicitArray, name))
        own = set(cls.__dict__.get("__annotations__", {}))
        dataclasses.dataclass(cls, eq=False, repr=False)
        # dataclass() replaced field objects by their defaults; put them back so that
        # applying @dataclass again keeps `aux_field` metadata.
        for f in dataclasses.fields(cls):
            if f.name in own:
                type.__setattr__(cls, f.name, f)
        type.__setattr__(cls, "_qax_fields", None)
        flatten, flatten_with_keys, unflatten = _pytree_functions(cls)
        type.__setattr__(cls, "_qax_pytree", (flatten, flatten_with_keys, unflatten))
        jax.tree_util.register_pytree_with_keys(
            cls, flatten_with_keys, unflatten, flatten
        )
        register_batching(cls)
        _wrap_materialize(cls)
        _integrations.register(cls)

    # -- shape and dtype -----------------------------------------------------------------

    def __post_init__(self) -> None:
        self.__dict__[NB] = check_batch(self)
        shape = self.shape if self.shape is not None else self.compute_shape()
        dtype = self.dtype if self.dtype is not None else self.compute_dtype()
        self.shape = None if shape is None else tuple(int(d) for d in shape)
        self.dtype = None if dtype is None else _canonical_dtype(dtype)
        missing = "shape" if shape is None else "dtype" if dtype is None else None
        if missing or (check_declared_avals.get() and is_eval_trace(current_trace())):
            self._resolve_from_materialize(missing)

    def _resolve_from_materialize(self, missing: str | None) -> None:
        try:
            out = _materialized_aval(self)
        except Exception as e:  # noqa: BLE001 (any failure means "cannot infer")
            if missing:
                raise UninitializedAval(
                    missing, type(self).__name__, f"{type(e).__name__}: {e}"
                ) from None
            return
        shape, dtype = tuple(out.shape), _canonical_dtype(out.dtype)
        name = type(self).__name__
        for kind, declared, found in (
            ("shape", self.shape, shape),
            ("dtype", self.dtype, dtype),
        ):
            if declared is None:
                setattr(self, kind, found)
            elif declared != found:
                warnings.warn(
                    f"{name} declares {kind} {declared}, but its materialize() produces "
                    f"{kind} {found}.",
                    stacklevel=4,
                )

    def compute_shape(self) -> Any:
        """Override to derive the shape from the other fields."""
        return self.default_shape

    def compute_dtype(self) -> Any:
        """Override to derive the dtype from the other fields."""
        return self.default_dtype

    @property
    def aval(self) -> ShapedArray:
        """The abstract value (a `ShapedArray`) JAX sees for this array.

        Inside `shard_map` it varies over every mesh axis that one of its leaves varies
        over, as the materialized array would.
        """
        d = self.__dict__
        cached = d.get(_AVAL_CACHE)
        if cached is not None and cached[0] == (self.shape, self.dtype):
            return cached[1]
        reference, varying = _varying_axes(self)
        if varying:
            aval = varying_aval(self.shape, self.dtype, reference, varying)
        else:
            aval = _plain_aval(self.shape, self.dtype)
        d[_AVAL_CACHE] = ((self.shape, self.dtype), aval)
        return aval

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of unsized object")
        return self.shape[0]

    def __repr__(self) -> str:
        fields = fields_of(type(self))
        names, aux = fields.children, fields.aux
        parts = [f"{n}={_short(getattr(self, n))}" for n in names]
        parts += [f"{n}={getattr(self, n)!r}" for n in aux]
        parts.append(f"shape={self.shape}")
        parts.append(
            f"dtype={None if self.dtype is None else np.dtype(self.dtype).name}"
        )
        return f"{type(self).__name__}({', '.join(parts)})"

    def __treescope_repr__(self, path: str | None, subtree_renderer: Any) -> Any:
        """Rendering in `treescope` (and so in Flax NNX's notebook display).

        Shown as its constructor call: the child fields (arrays summarized by
        treescope), then the metadata that `__init__` takes, then shape and dtype.
        """
        import treescope  # only treescope calls this method

        fields = fields_of(type(self))
        names, aux = fields.children, fields.aux
        settable = {f.name for f in dataclasses.fields(self) if f.init}
        attributes = {n: getattr(self, n) for n in names}
        attributes.update({n: getattr(self, n) for n in aux if n in settable})
        attributes["shape"] = self.shape
        attributes["dtype"] = None if self.dtype is None else np.dtype(self.dtype)
        return treescope.repr_lib.render_object_constructor(
            object_type=type(self),
            attributes=attributes,
            path=path,
            subtree_renderer=subtree_renderer,
            roundtrippable=True,
        )

    __hash__ = object.__hash__

    # -- array behaviour: every operation goes through the interpreter -------------------

    __eq__ = _implicit_method(operator.eq)
    __ne__ = _implicit_method(operator.ne)
    __lt__ = _implicit_method(operator.lt)
    __le__ = _implicit_method(operator.le)
    __gt__ = _implicit_method(operator.gt)
    __ge__ = _implicit_method(operator.ge)
    __add__ = _implicit_method(operator.add)
    __radd__ = _implicit_method(_reflected(operator.add))
    __sub__ = _implicit_method(operator.sub)
    __rsub__ = _implicit_method(_reflected(operator.sub))
    __mul__ = _implicit_method(operator.mul)
    __rmul__ = _implicit_method(_reflected(operator.mul))
    __truediv__ = _implicit_method(operator.truediv)
    __rtruediv__ = _implicit_method(_reflected(operator.truediv))
    __floordiv__ = _implicit_method(operator.floordiv)
    __rfloordiv__ = _implicit_method(_reflected(operator.floordiv))
    __mod__ = _implicit_method(operator.mod)
    __rmod__ = _implicit_method(_reflected(operator.mod))
    __pow__ = _implicit_method(operator.pow)
    __rpow__ = _implicit_method(_reflected(operator.pow))
    __matmul__ = _implicit_method(operator.matmul)
    __rmatmul__ = _implicit_method(_reflected(operator.matmul))
    __and__ = _implicit_method(operator.and_)
    __rand__ = _implicit_method(_reflected(operator.and_))
    __or__ = _implicit_method(operator.or_)
    __ror__ = _implicit_method(_reflected(operator.or_))
    __xor__ = _implicit_method(operator.xor)
    __rxor__ = _implicit_method(_reflected(operator.xor))
    __lshift__ = _implicit_method(operator.lshift)
    __rlshift__ = _implicit_method(_reflected(operator.lshift))
    __rshift__ = _implicit_method(operator.rshift)
    __rrshift__ = _implicit_method(_reflected(operator.rshift))
    __neg__ = _implicit_method(operator.neg)
    __pos__ = _implicit_method(operator.pos)
    __abs__ = _implicit_method(operator.abs)
    __invert__ = _implicit_method(operator.invert)

    astype = _method("astype")
    reshape = _method("reshape")
    transpose = _method("transpose")
    squeeze = _method("squeeze")
    sum = _method("sum")
    mean = _method("mean")
    max = _method("max")
    min = _method("min")
    prod = _method("prod")
    ravel = _method("ravel")
    flatten = _method("flatten")
    T = property(_implicit_method(lambda x: x.T))

    # -- outside `use_implicit_args` (the rule is in `qax/_outside.py`) -------------------
    # Conversions materialize, iteration stops after `len(x)` rows, `jnp` functions name
    # the wrapper; indexing runs through the interpreter.

    __getitem__ = _outside.getitem
    __iter__ = _outside.iterate
    __array__ = _outside.to_numpy
    __jax_array__ = property(_outside.jax_array_protocol)
    __bool__ = functools.partialmethod(_outside.scalar, bool)
    __int__ = functools.partialmethod(_outside.scalar, int)
    __float__ = functools.partialmethod(_outside.scalar, float)
    __complex__ = functools.partialmethod(_outside.scalar, complex)

    # -- the original Qax's pytree methods (downstream code splits and merges trees) -----

    def tree_flatten_with_keys(self) -> tuple[list, Any]:
        """One level of the pytree: ``(children, aux_data)``, as in the original Qax.

        `children` holds ``(jax.tree_util.GetAttrKey(name), value)`` for every child
        field, in declaration order; `aux_data` is the static part (aux fields, shape,
        dtype). ``type(x).tree_unflatten(aux_data, values)`` rebuilds `x`.

        Examples:
            >>> children, aux = lora.tree_flatten_with_keys()
            >>> [key.name for key, _ in children]
            ['w', 'a', 'b']
        """
        return type(self)._qax_pytree[1](self)

    @classmethod
    def tree_unflatten(cls, aux_data: Any, children: Any) -> ImplicitArray:
        """Rebuild an instance from `tree_flatten_with_keys`'s ``aux_data`` and the
        values of its children (without their keys), as in the original Qax.

        Examples:
            >>> children, aux = lora.tree_flatten_with_keys()
            >>> LoraMatrix.tree_unflatten(aux, [w, a2, b2])  # same base, new factors
        """
        return cls._qax_pytree[2](aux_data, list(children))


@functools.lru_cache(maxsize=4096)
def _plain_aval(shape: tuple[int, ...], dtype: Any) -> ShapedArray:
    return ShapedArray(shape, dtype)


def _varying_axes(x: ImplicitArray) -> tuple[Any, frozenset]:
    """The mesh axes some traced leaf of `x` varies over (inside `shard_map`), and the
    aval of one such leaf."""
    reference, found = None, frozenset()
    names = fields_of(type(x)).children
    for child in (x.__dict__[n] for n in names):
        if isinstance(child, ImplicitArray):
            ref, axes = _varying_axes(child)
        elif isinstance(child, Tracer):
            ref, axes = child.aval, varying_axes(child.aval)
        elif isinstance(child, (list, tuple, dict)):
            inner = [
                leaf
                for leaf in jax.tree_util.tree_leaves(child)
                if isinstance(leaf, Tracer)
            ]
            ref = inner[0].aval if inner else None
            axes = frozenset().union(*(varying_axes(leaf.aval) for leaf in inner))
        else:
            continue
        if axes:
            reference, found = ref, found | axes
    return reference, found


def _short(x: Any) -> str:
    if isinstance(x, ImplicitBase):
        return repr(x)
    try:
        return jax.typeof(x).str_short()
    except TypeError:
        return repr(x)


def _canonical_dtype(dtype: Any) -> np.dtype:
    return jax.dtypes.canonicalize_dtype(dtype)


# Per class: (treedef, leaf avals) -> the `jax.ShapeDtypeStruct` of `materialize()`.
# `materialize` is traced on abstract leaves, so its result's shape and dtype depend on
# nothing else; a handler that returns a new instance of a type without `compute_shape`
# then pays a dictionary lookup instead of a trace.
_SHAPES = "_qax_materialized_shapes"
_SHAPES_LIMIT = 1024


def _materialized_aval(obj: ImplicitArray) -> Any:
    """`_eval_shape_of_materialize(obj)`, cached per class and leaf avals."""
    cls = type(obj)
    try:
        leaves, tree = jax.tree_util.tree_flatten(obj)
        key = (tree, tuple(map(_leaf_key, leaves)))
        hash(key)
    except TypeError:  # an unhashable aux field, or a leaf that is not an array
        return _eval_shape_of_materialize(obj)
    cache = cls.__dict__.get(_SHAPES)
    if cache is None:
        cache = {}
        type.__setattr__(cls, _SHAPES, cache)
    found = cache.get(key)
    if found is None:
        found = _eval_shape_of_materialize(obj)
        if len(cache) >= _SHAPES_LIMIT:
            cache.clear()
        cache[key] = found
    return found


def clear_caches() -> None:
    """Empty the caches of abstract values and, in every subclass, of `materialize()`'s
    shape (an instance's own cached aval stays with the instance)."""
    _plain_aval.cache_clear()
    classes = [ImplicitArray]
    while classes:
        cls = classes.pop()
        classes += cls.__subclasses__()
        cache = cls.__dict__.get(_SHAPES)
        if cache is not None:
            cache.clear()


def _leaf_key(leaf: Any) -> tuple:
    """What tracing `materialize()` sees of one leaf: shape, dtype, weak type."""
    aval = getattr(leaf, "aval", None)  # arrays and tracers, without their sharding
    if aval is None:
        if isinstance(leaf, jax.ShapeDtypeStruct):
            return (leaf.shape, leaf.dtype, bool(leaf.weak_type))
        aval = jax.typeof(leaf)
    return (aval.shape, aval.dtype, aval.weak_type)


def _eval_shape_of_materialize(obj: ImplicitArray) -> Any:
    """`jax.eval_shape` of `obj.materialize()`, quietly; `obj` may be half-built.

    Every array leaf of the child fields (values, tracers of any trace, or
    `jax.ShapeDtypeStruct`s given for `jax.eval_shape` or AOT lowering) becomes an
    abstract argument of `eval_shape`: the traced function closes over no value of
    `obj`, so no tracer of an enclosing transformation is captured by that trace.
    """
    parts, flat = [], []
    for name in fields_of(type(obj)).children:
        leaves, tree = jax.tree_util.tree_flatten(getattr(obj, name, None))
        parts.append((name, tree, len(leaves)))
        flat += leaves
    abstract = [hasattr(x, "shape") and hasattr(x, "dtype") for x in flat]
    structs = [_struct(x) for x, a in zip(flat, abstract) if a]

    def run(*values: Any) -> Any:
        given = iter(values)
        leaves = [next(given) if a else x for x, a in zip(flat, abstract)]
        target, at = copy.copy(obj), 0
        for name, tree, k in parts:
            object.__setattr__(
                target, name, jax.tree_util.tree_unflatten(tree, leaves[at : at + k])
            )
            at += k
        children = implicit_children(target)
        if not children:
            return type(target).materialize(target)
        names = [n for n, _ in children]

        def inner(*values):
            clone = copy.copy(target)
            for n, v in zip(names, values):
                object.__setattr__(clone, n, v)
            return type(target).materialize(clone)

        return use_implicit_args(inner)(*[c for _, c in children])

    with quietly():
        return jax.eval_shape(run, *structs)


def _struct(x: Any) -> jax.ShapeDtypeStruct:
    """The abstract value of one leaf (its shape, dtype and weak type)."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    weak = bool(getattr(getattr(x, "aval", None), "weak_type", False))
    return jax.ShapeDtypeStruct(tuple(x.shape), x.dtype, weak_type=weak)
