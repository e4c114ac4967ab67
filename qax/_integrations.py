"""Serialization of implicit arrays for `jax.export` and `flax.serialization`.

Every `ImplicitArray` subclass is registered when the class is created (`register`):

- with `jax.export` under the stable name ``qax:<module>.<qualname>``, its static
  metadata (aux fields, shape, dtype) encoded as tagged JSON, so an `Exported` whose
  inputs or outputs hold implicit arrays serializes and deserializes;
- with `flax.serialization` (`to_bytes`/`from_bytes`, `to_state_dict`): the state dict
  of an implicit array is the dict of its child fields; restoring needs a template of
  the same type, as for any Flax state. Flax is never imported for this: the
  registration waits until something else imports `flax.serialization`.

Plain dataclass pytrees with static fields (`qax.lora.LoraAdapter`) are registered the
same way by `register_dataclass` (`qax.checkpoint.register_dataclass`).
"""

from __future__ import annotations

import base64
import dataclasses
import importlib.abc
import json
import sys
import threading
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from . import _errors
from ._compat import forget_export_serialization
from ._fields import children_of

_EXPORT_PREFIX = "qax:"


# ----------------------------------------------------------------------------------------
# jax.export


def _encode(x: Any, path: str, cls: type) -> Any:
    if x is None or isinstance(x, (bool, str)):
        return x
    if isinstance(x, int) and not isinstance(x, bool):
        return {"int": str(x)}
    if isinstance(x, float):
        return {"float": repr(x)}
    if isinstance(x, complex):
        return {"complex": [repr(x.real), repr(x.imag)]}
    if isinstance(x, bytes):
        return {"bytes": base64.b64encode(x).decode("ascii")}
    if isinstance(x, np.dtype) or (isinstance(x, type) and issubclass(x, np.generic)):
        return {"dtype": np.dtype(x).name}
    if isinstance(x, np.generic):
        raw = base64.b64encode(np.asarray(x).tobytes()).decode("ascii")
        return {"scalar": [x.dtype.name, raw]}
    if isinstance(x, (tuple, list)):
        tag = "tuple" if isinstance(x, tuple) else "list"
        return {tag: [_encode(v, f"{path}[{i}]", cls) for i, v in enumerate(x)]}
    if isinstance(x, dict):
        return {
            "dict": [
                [_encode(k, path, cls), _encode(v, f"{path}[{k!r}]", cls)]
                for k, v in x.items()
            ]
        }
    raise TypeError(
        _errors.UNSERIALIZABLE_AUX.format(
            cls=cls.__name__, path=path, kind=f"{type(x).__name__} ({x!r})"
        )
    )


def _decode(x: Any) -> Any:
    if not isinstance(x, dict):
        return x
    ((tag, v),) = x.items()
    if tag == "int":
        return int(v)
    if tag == "float":
        return float(v)
    if tag == "complex":
        return complex(float(v[0]), float(v[1]))
    if tag == "bytes":
        return base64.b64decode(v)
    if tag == "dtype":
        return _dtype(v)
    if tag == "scalar":
        return np.frombuffer(base64.b64decode(v[1]), dtype=_dtype(v[0]))[0]
    if tag == "tuple":
        return tuple(_decode(e) for e in v)
    if tag == "list":
        return [_decode(e) for e in v]
    if tag == "dict":
        return {_decode(k): _decode(e) for k, e in v}
    raise ValueError(f"Unknown tag {tag!r} in serialized qax metadata.")


def _dtype(name: str) -> np.dtype:
    return np.dtype(getattr(jax.numpy, name, name))


def export_name(cls: type) -> str:
    """The name under which `jax.export` serializes `cls`."""
    return f"{_EXPORT_PREFIX}{cls.__module__}.{cls.__qualname__}"


def _register_export(cls: type) -> None:
    name = export_name(cls)

    def serialize(aux: Any) -> bytes:
        return encode_aux(aux, cls).encode()

    def deserialize(data: bytes) -> Any:
        return decode_aux(data.decode())

    # A class defined again under the same name (a re-run cell) replaces the old one.
    forget_export_serialization(cls, name)
    jax.export.register_pytree_node_serialization(
        cls,
        serialized_name=name,
        serialize_auxdata=serialize,
        deserialize_auxdata=deserialize,
    )


# ----------------------------------------------------------------------------------------
# flax.serialization


def _register_flax(serialization: Any, cls: type) -> None:
    def to_state_dict(x: Any) -> dict[str, Any]:
        return {n: serialization.to_state_dict(v) for n, v in children_of(x).items()}

    def from_state_dict(target: Any, state: dict[str, Any]) -> Any:
        children = children_of(target)
        missing = [n for n in children if n not in state]
        if missing:
            raise ValueError(
                f"The state dict for {cls.__name__} lacks the field(s) {missing} "
                f"(it has {sorted(state)}). Restore with a target of the same type "
                "and fields as the one that was saved."
            )
        treedef = jax.tree_util.tree_structure(
            target, is_leaf=lambda y: y is not target
        )
        new = [
            serialization.from_state_dict(v, state[n], name=n)
            for n, v in children.items()
        ]
        return treedef.unflatten(new)

    serialization.register_serialization_state(
        cls, to_state_dict, from_state_dict, override=True
    )


# ----------------------------------------------------------------------------------------
# Registration when a module is imported, without importing it.

_lock = threading.Lock()
_waiting: dict[str, list[Callable[[Any], None]]] = {}


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs the callbacks waiting for a module right after that module executes."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _waiting:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        spec.loader = _CallbackLoader(loader)
        return spec


class _CallbackLoader(importlib.abc.Loader):
    def __init__(self, loader: Any):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        # The module keeps its real loader (resources, reload).
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        _run_waiting(module.__name__, module)


_finder = _AfterImport()


def _run_waiting(name: str, module: Any) -> None:
    with _lock:
        callbacks = _waiting.pop(name, [])
    for callback in callbacks:
        callback(module)


def when_imported(name: str, callback: Callable[[Any], None]) -> None:
    """Call `callback(module)` now if `name` is imported, else right after its import."""
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
        return
    with _lock:
        _waiting.setdefault(name, []).append(callback)
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)


# The latest class defined under each export name (for `qax.checkpoint.rebuild`).
classes: dict[str, type] = {}


def encode_aux(aux: Any, cls: type) -> str:
    """The static metadata `aux` of a `cls` node as JSON text."""
    return json.dumps(_encode(aux, "aux", cls))


def decode_aux(text: str) -> Any:
    return _decode(json.loads(text))


def register(cls: type) -> None:
    """Register a new `ImplicitArray` subclass with `jax.export` and Flax."""
    classes[export_name(cls)] = cls
    _register_export(cls)
    when_imported("flax.serialization", lambda module: _register_flax(module, cls))


# ----------------------------------------------------------------------------------------
# Plain dataclass pytrees with static fields (`qax.checkpoint.register_dataclass`)


def data_names(x: Any) -> list[str]:
    """The attribute names of the children of one dataclass pytree node `x`."""
    keyed, _ = jax.tree_util.tree_flatten_with_path(x, is_leaf=lambda y: y is not x)
    return [path[0].name for path, _ in keyed]


def static_names(cls: type) -> list[str]:
    """The fields of a `jax.tree_util.register_dataclass` class marked static."""
    return [f.name for f in dataclasses.fields(cls) if f.metadata.get("static")]


def _register_flax_dataclass(serialization: Any, cls: type) -> None:
    def to_state_dict(x: Any) -> dict[str, Any]:
        return {n: serialization.to_state_dict(getattr(x, n)) for n in data_names(x)}

    def from_state_dict(target: Any, state: dict[str, Any]) -> Any:
        names = data_names(target)
        missing = [n for n in names if n not in state]
        if missing:
            raise ValueError(
                f"The state dict for {cls.__name__} lacks the field(s) {missing} "
                f"(it has {sorted(state)}). Restore with a target of the same type "
                "and fields as the one that was saved."
            )
        new = {
            n: serialization.from_state_dict(getattr(target, n), state[n], name=n)
            for n in names
        }
        return dataclasses.replace(target, **new)

    serialization.register_serialization_state(
        cls, to_state_dict, from_state_dict, override=True
    )


def register_dataclass(cls: type) -> None:
    """Register a dataclass pytree (children and static fields) with `jax.export`,
    Flax and `qax.checkpoint`."""
    classes[export_name(cls)] = cls
    dataclasses_by_type[cls] = export_name(cls)
    _register_export(cls)
    when_imported(
        "flax.serialization", lambda module: _register_flax_dataclass(module, cls)
    )


# The dataclass pytrees registered so, by class (for `qax.checkpoint.describe`).
dataclasses_by_type: dict[type, str] = {}
