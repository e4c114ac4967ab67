"""Checkpoints (orbax) of pytrees that hold implicit arrays.

An implicit array is a pytree whose leaves are its declared fields, so orbax saves and
restores it like any other pytree: restoring with a template (``jax.tree.map(
ocp.utils.to_shape_dtype_struct, state)``) gives the implicit arrays back with their
types. Restoring *without* a template gives orbax's plain containers: each implicit
array comes back as a dict of its fields, and a field-less one (a
`qax.symbols.SymbolicConstant`) as ``None``. To get the types back there, save the
description of the implicit arrays as custom metadata and `rebuild` after restoring:

Examples:
    >>> ckpt = ocp.StandardCheckpointer()
    >>> ckpt.save(path, state, custom_metadata={"qax": qax.checkpoint.describe(state)})
    >>> raw = ckpt.restore(path)  # no template
    >>> state = qax.checkpoint.rebuild(raw, ckpt.metadata(path).custom_metadata["qax"])

Across processes (JAX's multi-controller runtime, each process holding its own shards
of global arrays), every process calls ``save`` with the same tree and the same
``describe`` metadata, and ``restore`` with the same template: its shardings decide the
mesh, so a checkpoint saved by 2 processes restores into 1, or the other way round.
orbax refuses a restore *without* a template across process counts ("Topology
mismatch"); `describe` and `rebuild` serve restores on the topology that saved.

`describe` is JSON: class names (as registered for `jax.export`) and static metadata.
The adapters of `qax.lora.split` (`qax.lora.LoraAdapter`, a dataclass pytree registered
with `register_dataclass`) are described and rebuilt the same way.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Final

import jax

from . import _errors, _integrations
from ._base import is_implicit
from ._fields import fields_of
from ._implicit_array import _pytree_functions
from ._tree_util import key_value

__all__ = ["describe", "rebuild", "register_dataclass"]

_NOT_A_DATACLASS: Final = (
    "register_dataclass: {cls} must be a dataclass registered as a pytree with "
    "`jax.tree_util.register_dataclass`, its static fields marked "
    "`dataclasses.field(metadata={{'static': True}})` (as `qax.lora.LoraAdapter`)."
)


def register_dataclass(cls: type) -> type:
    """Make a dataclass pytree with static fields travel as implicit arrays do.

    A class registered with `jax.tree_util.register_dataclass` (children as pytree
    children, static fields marked ``metadata={"static": True}``) then serializes with
    `jax.export` (under the name ``qax:<module>.<qualname>``), has a `flax.serialization`
    state dict (the dict of its children; restoring needs a template), and is
    described by `describe` and rebuilt by `rebuild` after a restore without a
    template. `qax.lora.LoraAdapter` is registered so.

    Examples:
        >>> @qax.checkpoint.register_dataclass
        ... @jax.tree_util.register_dataclass
        ... @dataclasses.dataclass
        ... class Adapter:
        ...     a: jax.Array
        ...     scale: float = dataclasses.field(default=1.0, metadata={"static": True})

    Args:
      cls: the dataclass.

    Returns:
      ``cls`` (usable as a decorator).

    Raises:
      TypeError: ``cls`` is not a dataclass.
    """
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(_NOT_A_DATACLASS.format(cls=cls))
    _integrations.register_dataclass(cls)
    return cls


def _is_node(x: Any) -> bool:
    return is_implicit(x) or type(x) in _integrations.dataclasses_by_type


def _describe_one(x: Any) -> dict:
    cls, aux = jax.tree_util.tree_structure(x, is_leaf=lambda y: y is not x).node_data()
    fields = {}
    if is_implicit(x):
        names = fields_of(cls).children
    else:
        names = _integrations.data_names(x)
    for name in names:
        child = getattr(x, name) if not is_implicit(x) else x.__dict__[name]
        fields[name] = _describe_one(child) if _is_node(child) else None
    return {
        "type": _integrations.export_name(cls),
        "aux": _integrations.encode_aux(aux, cls),
        "fields": fields,
    }


def describe(tree: Any) -> dict:
    """A JSON description of the implicit arrays in `tree`, for `rebuild`.

    Dataclass pytrees registered with `register_dataclass` (`qax.lora.LoraAdapter`) are
    described too.

    Args:
      tree: the pytree to be saved (parameters, optimizer state, ...).

    Returns:
      A dict of JSON types: for each implicit array, its path, class and metadata.

    Examples:
        >>> tree = {"z": SymbolicConstant(0.0, shape=(2,))}
        >>> qax.checkpoint.describe(tree)["implicit"][0]["path"]
        ['z']

    Raises:
      TypeError: an implicit array's static metadata cannot be encoded (see
        `jax.export` support in the README).
    """
    found = []
    keyed, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_node)
    for path, leaf in keyed:
        if _is_node(leaf):
            found.append({"path": [key_value(k) for k in path], **_describe_one(leaf)})
    return {"format": 1, "implicit": found}


def _child(node: Any, key: Any) -> Any:
    if isinstance(node, dict):
        if key in node:
            return node[key]
        if str(key) in node:
            return node[str(key)]
        raise KeyError(key)
    if isinstance(node, (list, tuple)) and isinstance(key, int):
        return node[key]
    return getattr(node, str(key))


def _replace(node: Any, path: list, value: Any, where: list) -> Any:
    if not path:
        return value
    key, rest = path[0], path[1:]
    child = _child(node, key)
    new = _replace(child, rest, value, [*where, key])
    if isinstance(node, dict):
        out = dict(node)
        out[key if key in node else str(key)] = new
        return out
    if isinstance(node, list):
        return [new if i == key else v for i, v in enumerate(node)]
    if isinstance(node, tuple):
        return type(node)(*(new if i == key else v for i, v in enumerate(node)))
    raise TypeError(f"Cannot rebuild inside a {type(node).__name__} at {where}.")


def _build(raw: Any, desc: dict, where: list) -> Any:
    cls = _integrations.classes.get(desc["type"])
    if cls is None:
        raise TypeError(_errors.UNKNOWN_CHECKPOINT_CLASS.format(name=desc["type"]))
    children = []
    for name, sub in desc["fields"].items():
        try:
            value = _child(raw, name)
        except (KeyError, AttributeError, TypeError):
            raise ValueError(
                _errors.MISSING_IN_RESTORED.format(
                    what=f"field {name!r}", path=where, cls=cls.__name__
                )
            ) from None
        children.append(value if sub is None else _build(value, sub, [*where, name]))
    aux = _integrations.decode_aux(desc["aux"])
    if cls in _integrations.dataclasses_by_type:
        static = dict(zip(_integrations.static_names(cls), aux, strict=True))
        return cls(**dict(zip(desc["fields"], children, strict=True)), **static)
    names = fields_of(cls).aux
    added = _added_since(cls, names[len(aux[0]) :])
    if added is not None:
        aux = (tuple(aux[0]) + added, *aux[1:])
    if len(aux[0]) != len(names):
        raise ValueError(
            _errors.OTHER_CHECKPOINT_AUX.format(
                cls=cls.__name__,
                path=where,
                got=len(aux[0]),
                want=len(names),
                names=", ".join(names),
            )
        )
    return _pytree_functions(cls)[2](aux, children)


def _added_since(cls: type, missing: tuple[str, ...]) -> tuple | None:
    """The defaults of aux fields that a class gained, at the end, after a checkpoint
    was described (constructor arguments with a default), or None if `missing` holds
    another kind of field."""
    if not missing:
        return None
    by_name = {f.name: f for f in dataclasses.fields(cls)}
    out = []
    for name in missing:
        f = by_name[name]
        if not f.init:
            return None
        if f.default is not dataclasses.MISSING:
            out.append(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            out.append(f.default_factory())
        else:
            return None
    return tuple(out)


def rebuild(raw: Any, description: dict) -> Any:
    """Turn the implicit arrays of a template-less restore back into their types.

    Args:
      raw: what ``checkpointer.restore(path)`` returned (no template).
      description: `describe` of the saved tree, as saved in the checkpoint.

    Returns:
      `raw` with each described implicit array rebuilt from its fields.

    Raises:
      ValueError: `description` is not one from `describe`, `raw` lacks a field, or
        a saved class had other aux fields than it has now (aux fields added at the
        end of a class since, with defaults, take their defaults).
      TypeError: the class of a saved implicit array is not defined in this process.
    """
    if not isinstance(description, dict) or "implicit" not in description:
        raise ValueError(_errors.NO_CHECKPOINT_DESCRIPTION.format(got=description))
    out = raw
    for entry in description["implicit"]:
        path = entry["path"]
        try:
            node = raw
            for key in path:
                node = _child(node, key)
        except (KeyError, AttributeError, IndexError, TypeError):
            raise ValueError(
                _errors.MISSING_IN_RESTORED.format(
                    what="value", path=path, cls=entry["type"]
                )
            ) from None
        out = _replace(out, path, _build(node, entry, path), [])
    return out
