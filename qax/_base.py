"""The small protocol that the interpreter relies on.

`ImplicitBase` is what the interpreter recognises as "an implicit array": something with an
`aval`, a `materialize()` method, two class flags and an optional per-type default rule.
The dataclass machinery users see lives in `qax._implicit_array`.
"""

from __future__ import annotations

import abc
import contextvars
from typing import Any, ClassVar

from ._compat import Primitive, ShapedArray

# Whether code that qax runs on implicit values is running: a handler, `materialize()`,
# `default_handler`, or a constructor's own body. The implicit arrays it builds are plain
# values, whose fields it may read (see `_ImplicitMeta.__call__`).
in_rule: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "qax_in_rule", default=False
)
# Filled by `qax._entry`: an implicit array that the user's code has just built, as a
# value of the current trace when `use_implicit_args` is active (else itself).
enter_built: list[Any] = [lambda value: value]


class _ImplicitMeta(abc.ABCMeta):
    # `isinstance(x, ImplicitBase)` runs several times per primitive: use `type`'s C
    # checks instead of ABCMeta's (no virtual subclasses are registered anyway).
    __instancecheck__ = type.__instancecheck__
    __subclasscheck__ = type.__subclasscheck__

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        """Build an instance; inside `use_implicit_args`, as a value of the current trace.

        An implicit array that the wrapped function builds (``Lora(w, a, b)``, maybe
        around an implicit argument) is then exactly what an implicit argument is
        there: a JAX value that every JAX function, loop carry and transformation takes
        as one array. Handlers and `materialize()` (and constructors themselves) get
        plain instances.
        """
        if in_rule.get():
            return super().__call__(*args, **kwargs)
        token = in_rule.set(True)
        try:
            value = super().__call__(*args, **kwargs)
        finally:
            in_rule.reset(token)
        return enter_built[0](value)


class ImplicitBase(metaclass=_ImplicitMeta):
    """Base of every implicit array; see `qax.ImplicitArray`."""

    commute_ops: ClassVar[bool] = True
    warn_on_materialize: ClassVar[bool] = True
    # What a user should do when a value of this type lacks a batch axis that `vmap`
    # or `scan` needs (read by `qax._batching` into its warnings); None: the general
    # advice about declaring batch axes.
    batch_axes_advice: ClassVar[str | None] = None

    shape: tuple[int, ...]
    dtype: Any

    @abc.abstractmethod
    def materialize(self) -> Any:
        """Return the dense array (or a less implicit array) this value represents."""

    @property
    def aval(self) -> ShapedArray:
        raise NotImplementedError  # provided by qax.ImplicitArray

    def frozen_fields(self) -> tuple[str, ...]:
        """The child fields that optimizers must leave as they are.

        `qax.utils.apply_updates` and `qax.nnx.Optimizer` keep the leaves of these
        fields unchanged whatever the updates say (weight decay included), so a value
        that declares a field frozen (`qax.lora.LoraWeight`'s ``w`` with
        ``freeze_w=True``) is never moved by them, even without `qax.freeze_keys`. The
        default: none.
        """
        return ()

    @classmethod
    def default_handler(cls, primitive: Primitive, *args: Any, params: dict) -> Any:
        """The rule for primitives that no handler covers, for this type.

        Return `NotImplemented` (what this base version does) to get the standard
        behaviour: the implicit operands are materialized, with a warning, and the
        primitive runs on dense arrays. Override it to, for example, wrap every result back
        into this type.
        """
        return NotImplemented


# Instance attribute holding an implicit array's number of batch dimensions (see
# `qax._batching`); `None` when its leaves no longer fit its type's declaration.
NB = "_qax_nb"
# Instance attribute of a value of an *undeclared* type that `jax.vmap` stacked from
# examples (outside `use_implicit_args`): the rank of each of its leaves in one example,
# in flattening order. Its `NB` leading dimensions are then the stacked ones.
STACKED = "_qax_stacked"


# Instance attribute of an implicit array that the user's code built inside
# `use_implicit_args`: its fields stay readable there (see `ImplicitTracer`).
BUILT = "_qax_built"


def is_implicit(x: Any) -> bool:
    return isinstance(x, ImplicitBase)


# Set while qax itself runs `materialize()` for bookkeeping (shape inference), so that
# those materializations are neither warned about nor recorded.
quiet_materialization: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "qax_quiet_materialization", default=False
)

# False while `use_implicit_args` runs: implicit arrays built by handlers then skip the
# (costly) check of their declared shape/dtype against `materialize()`.
check_declared_avals: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "qax_check_declared_avals", default=True
)
