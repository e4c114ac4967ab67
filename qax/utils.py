"""Training and tree utilities: optax helpers, `vmap_all_but_one`, implicit-aware trees,
and the tools that handlers folding constants at trace time need (`eval_context`,
`known_constant`, `jaxpr_as_function`)."""

from ._compat import eval_context as eval_context
from ._compat import jaxpr_as_function as jaxpr_as_function
from ._compat import known_constant as known_constant
from ._entry import materialize_nested as materialize_nested
from ._fields import batch_ndim as batch_ndim
from ._layout import Layout as Layout
from ._layout import contracted_axes as contracted_axes
from ._optax import apply_updates as apply_updates
from ._optax import freeze_keys as freeze_keys
from ._optax import freeze_subtrees as freeze_subtrees
from ._optax import set_to_zero_scalar as set_to_zero_scalar
from ._structure import get_common_prefix_transforms as get_common_prefix_transforms
from ._tree_util import EmptyNode as EmptyNode
from ._tree_util import flatten_one_implicit_layer as flatten_one_implicit_layer
from ._tree_util import implicit_depth as implicit_depth
from ._tree_util import path_rules as path_rules
from ._tree_util import path_string as path_string
from ._tree_util import tree_flatten_with_implicit as tree_flatten_with_implicit
from ._tree_util import (
    tree_flatten_with_path_with_implicit as tree_flatten_with_path_with_implicit,
)
from ._tree_util import tree_leaves_with_implicit as tree_leaves_with_implicit
from ._tree_util import tree_map_with_implicit as tree_map_with_implicit
from ._tree_util import (
    tree_map_with_path_with_implicit as tree_map_with_path_with_implicit,
)
from ._tree_util import tree_structure_with_implicit as tree_structure_with_implicit
from ._tree_util import tree_unflatten as tree_unflatten
from ._vmap import vmap_all_but_one as vmap_all_but_one

__all__ = [
    "EmptyNode",
    "Layout",
    "apply_updates",
    "batch_ndim",
    "contracted_axes",
    "eval_context",
    "flatten_one_implicit_layer",
    "freeze_keys",
    "freeze_subtrees",
    "get_common_prefix_transforms",
    "implicit_depth",
    "jaxpr_as_function",
    "known_constant",
    "materialize_nested",
    "path_rules",
    "path_string",
    "set_to_zero_scalar",
    "tree_flatten_with_implicit",
    "tree_flatten_with_path_with_implicit",
    "tree_leaves_with_implicit",
    "tree_map_with_implicit",
    "tree_map_with_path_with_implicit",
    "tree_structure_with_implicit",
    "tree_unflatten",
    "vmap_all_but_one",
]
