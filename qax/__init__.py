"""qax: arrays represented one way that behave like another, for any JAX code."""

# The core: the class users subclass, the interpreter's entry points, handler tables.
from . import _rules as _rules  # noqa: F401 (registers the rules)
from . import constants as constants
from ._audit import materialization_audit as materialization_audit
from ._audit import materialization_policy as materialization_policy
from ._base import ImplicitBase as ImplicitBase
from ._dispatch import ArrayValue as ArrayValue
from ._dispatch import decline as decline
from ._dispatch import default_handler as default_handler
from ._dispatch import primitive_handler as primitive_handler
from ._entry import materialize_nested as materialize_nested
from ._entry import use_implicit_args as use_implicit_args
from ._errors import HandlerError as HandlerError
from ._errors import MaterializationError as MaterializationError
from ._errors import MaterializationWarning as MaterializationWarning
from ._errors import UninitializedAval as UninitializedAval
from ._explain import explain as explain
from ._fields import array_field as array_field
from ._fields import aux_field as aux_field
from ._implicit_array import ImplicitArray as ImplicitArray
from ._tree_util import EmptyNode as EmptyNode

# isort: split
# Built-in types, written with the public API above only (they `import qax`).
from . import symbols as symbols

# isort: split
# Tooling around the core (`freeze_keys` knows symbolic constants).
from . import checkpoint as checkpoint
from . import sharding as sharding
from . import testing as testing
from . import utils as utils
from ._optax import freeze_keys as freeze_keys

# isort: split
# More built-in types (public API only; `quant` builds on `lora`, `qat` on `quant`).
from . import lora as lora
from . import qat as qat
from . import quant as quant

# isort: split
# Above every module that keeps a cache, built-ins included.
from ._caches import clear_caches as clear_caches

__version__ = "0.1.0"

__all__ = [
    "ArrayValue",
    "EmptyNode",
    "HandlerError",
    "ImplicitArray",
    "ImplicitBase",
    "MaterializationError",
    "MaterializationWarning",
    "UninitializedAval",
    "array_field",
    "aux_field",
    "checkpoint",
    "clear_caches",
    "constants",
    "decline",
    "default_handler",
    "explain",
    "freeze_keys",
    "lora",
    "materialization_audit",
    "materialization_policy",
    "materialize_nested",
    "primitive_handler",
    "qat",
    "quant",
    "sharding",
    "symbols",
    "testing",
    "use_implicit_args",
    "utils",
]
