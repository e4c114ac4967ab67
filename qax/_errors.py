"""Exceptions, warnings, and every message template of qax's core.

Templates are module-level `Final` strings named after the situation they describe
(``CARRY_CHANGES``, ``UNKNOWN_FREEZE_KEYS``), formatted where they are raised or warned,
grouped below by the module that uses them. Each names what was wrong, states the rule
and shows the fix. The built-in types (`qax.symbols`, `qax.lora`, `qax.quant`) and
`qax.testing` use the public API only, so they keep their messages beside their code.
"""

from __future__ import annotations

from typing import Any, Final


class MaterializationWarning(UserWarning):
    """An implicit array was turned into a dense array because no handler applied.

    Filter it by category, e.g. ``warnings.simplefilter("error", qax.MaterializationWarning)``
    to make any densification a failing test.
    """


class UninitializedAval(Exception):
    """The shape or dtype of an implicit array could not be determined."""

    def __init__(self, kind: str, cls_name: str = "ImplicitArray", cause: str = ""):
        self.kind = kind
        ways = UNINITIALIZED_AVAL.format(kind=kind, cls=cls_name)
        if cause:
            # The cause first: usually the fields themselves are wrong (LoRA factors
            # of mismatched shapes), and passing `shape=` would only hide that.
            ways = (
                UNINITIALIZED_AVAL_CAUSE.format(kind=kind, cls=cls_name, cause=cause)
                + ways.split("\n", 1)[1]
            )
        super().__init__(ways)


class MaterializationError(RuntimeError):
    """An implicit array was materialized where `qax.materialization_policy` says "error".

    Attributes:
      primitive: name of the primitive that had no handler.
      cls: the implicit class that was materialized.
      source: ``file:line (function)`` of the user's code that triggered it, if known.
      phase: ``"forward"``, or ``"backward"`` inside a backward (transpose) pass.
    """

    def __init__(self, event: Any, rule: str, phase: str = "forward"):
        self.primitive = event.primitive
        self.cls = event.cls
        self.source = event.source
        self.phase = phase
        reason = getattr(event, "reason", None)
        template = (
            MATERIALIZATION_FORBIDDEN_BECAUSE if reason else MATERIALIZATION_FORBIDDEN
        )
        weight, caller = getattr(event, "weight", None), getattr(event, "caller", None)
        super().__init__(
            template.format(
                primitive=event.primitive,
                cls=event.cls.__name__,
                aval=f"{event.dtype}{list(event.shape)}"
                + (f", {weight}" if weight else ""),
                source=(event.source or "an unknown line")
                + (f", reached from {caller}" if caller else ""),
                phase=phase,
                rule=rule,
                reason=reason,
            )
        )


class HandlerError(TypeError):
    """A primitive handler was ambiguous or returned something of the wrong type."""


# Shown as `qax.HandlerError` (where users catch them), not `qax._errors.HandlerError`.
for _cls in (
    MaterializationWarning,
    UninitializedAval,
    MaterializationError,
    HandlerError,
):
    _cls.__module__ = "qax"

MATERIALIZE_WARNING: Final = (
    "Primitive {primitive} was not handled by class {cls}, so implicit args will be "
    "materialized."
)

# Appended to a `MaterializationWarning` (which points at the model's line): which
# weight, and the user's line that reached the model's, when qax knows them.
MATERIALIZED_WEIGHT: Final = " The {cls} is {weight}."
MATERIALIZED_FROM: Final = " Reached from {caller}."


def where_words(event: Any) -> str:
    """The sentences that name the weight and the user's line of a materialization."""
    words = ""
    if getattr(event, "weight", None):
        words += MATERIALIZED_WEIGHT.format(cls=event.cls.__name__, weight=event.weight)
    if getattr(event, "caller", None):
        words += MATERIALIZED_FROM.format(caller=event.caller)
    return words


MATERIALIZATION_FORBIDDEN: Final = """\
Primitive {primitive} was not handled by class {cls}, so a {cls} ({aval}) would be \
materialized at {source} (in the {phase} pass), but its materialization policy is \
"error" ({rule}). Register a handler with `@qax.primitive_handler("{primitive}")` \
(`qax.explain("{primitive}", ...)` shows which ones exist), or allow it, e.g. in a \
`with qax.materialization_policy({cls}, "allow"):` block."""

# The same, for a materialization that comes with its reason (`qax.decline`, or a rule
# that gives up): the reason first, then the policy.
MATERIALIZATION_FORBIDDEN_BECAUSE: Final = """\
{reason}
A {cls} ({aval}) would be materialized by `{primitive}` at {source} (in the {phase} \
pass), but its materialization policy is "error" ({rule}). Do what the reason above \
says, or allow it, e.g. in a `with qax.materialization_policy({cls}, "allow"):` block."""

UNINITIALIZED_AVAL: Final = """\
Could not determine the {kind} of this {cls}. Provide it in one of these ways:
  - pass it when constructing: {cls}(..., {kind}=...)
  - override `compute_{kind}(self)` to derive it from the other fields
  - set the class attribute `default_{kind} = ...`
  - make `materialize()` work on the fields alone, so that it can be inferred with
    `jax.eval_shape`"""

UNINITIALIZED_AVAL_CAUSE: Final = """\
Could not determine the {kind} of this {cls}: `materialize()` fails on its fields with
  {cause}
Check the fields (their shapes must fit together in `materialize()`). If they are right,
provide the {kind} in one of these ways:
"""

AMBIGUOUS_HANDLER: Final = """\
Handlers for primitive `{primitive}` are ambiguous for operand types ({types}):
{candidates}
Fix it by giving one of them `precedence=` (e.g. `@qax.primitive_handler("{primitive}", \
precedence=1)`), by registering a handler for exactly this combination, or by applying \
`qax.use_implicit_args` in two nested steps so that one type is handled first. \
`qax.explain("{primitive}", {types})` shows how each candidate was ranked."""

BAD_HANDLER_RESULT: Final = """\
Handler `{handler}` for primitive `{primitive}` returned {got}, but `{primitive}` on these \
operands produces {expected}. A handler must return arrays (or implicit arrays) of exactly \
the shape and dtype of the primitive's result."""

UNKNOWN_PRIMITIVE: Final = """\
Unknown primitive name {name!r}: JAX has no primitive of that name (looked up as \
`jax.lax.{name}_p`, among JAX's other primitives, and by primitive names).{suggestion} \
Pass a name from `qax.constants` or the JAX `Primitive` object itself (e.g. \
`jax.lax.dot_general_p`)."""

OUTSIDE_WRAPPER: Final = """\
`{function}` received a {cls}, which is an implicit array, outside \
`qax.use_implicit_args`. JAX functions (`jnp.*`, `jax.nn.*`) see implicit arrays only in \
a function wrapped with `qax.use_implicit_args`, where handlers apply: call \
`qax.use_implicit_args(f)(...)` instead of `f(...)`, or pass `x.materialize()` to work on \
the dense array."""

CONVERTED: Final = """\
A {cls} was converted to a dense array by `{how}` outside `qax.use_implicit_args`, so it \
was materialized."""

TRACED_TO_NUMPY: Final = """\
This {cls} holds traced values (it is used inside `jax.jit`, `jax.grad`, ...), so it \
cannot become a NumPy array. Use it inside a function wrapped with \
`qax.use_implicit_args`, or call `x.materialize()` for the dense JAX array."""

SPANS_PROCESSES: Final = """\
This {cls} has leaves that span devices of other processes (a multi-controller \
run: this process holds only its own shards), so {how} cannot give its value here. \
Gather it first, leaf by leaf (codes stay codes): \
`jax.experimental.multihost_utils.process_allgather(x, tiled=True)` returns the {cls} \
with NumPy leaves on every process; or read this process's part of each leaf with \
`leaf.addressable_shards` (`jax.tree.leaves(x)`); or keep it global with \
`x.materialize()` (a global dense array, computed by every process)."""

HALF_BUILT: Final = """\
{fields} {verb} None: an implicit array with missing fields (as `eqx.partition` \
leaves them) reached `qax.use_implicit_args`. Pass the complete value, e.g. \
`eqx.combine(params, static)`, or give the field a value. (The call failed with \
{error}.)"""

FIELD_OF_TRACER: Final = """\
Inside a function wrapped with `qax.use_implicit_args`, a {cls} is seen as the array it \
represents (a JAX tracer of its shape and dtype), so its field `{name}` cannot be read \
here. Fields are readable outside the wrapped function, and inside handlers \
(`@qax.primitive_handler`) and `materialize()`, which receive the {cls} itself: read \
`x.{name}` before the call and pass it as an argument, or write a handler for the \
operation."""

STACKED_UNDECLARED: Final = (
    "This {cls} holds {n} examples stacked by `jax.vmap`, and {cls} does not declare "
    "how its fields carry batch axes, so its handlers (written for one example) cannot "
    "take it: it is materialized, one example at a time. Declare batch axes with "
    "`qax.array_field(ndim=...)` to keep it implicit, or apply the `vmap` around "
    "`qax.use_implicit_args` (`jax.vmap(qax.use_implicit_args(f))`) so that `f` sees "
    "one example."
)

CONSTRUCTED_CARRY: Final = (
    "qax: an implicit array in this loop carry (or `cond` branch output) is a plain "
    "pytree to JAX's loop and `cond` functions, whose structure must stay the same: it "
    "was built outside `qax.use_implicit_args`, or inside it as a stack of a type that "
    "declares no batch axes (its `materialize()` does not give its declared shape). "
    "Build it inside the wrapped function with its real shape, or pass it as an "
    "argument: qax then materializes the parts of a carry whose implicit structure "
    "changes, with a `MaterializationWarning`, as it does for `cond` branches."
)


# -- The field schema (`qax._fields`) ----------------------------------------------------

FIELDS_DISAGREE: Final = (
    "The fields of {cls} disagree on their batch dimensions: {detail}. Each field "
    "declared with `qax.array_field(ndim=k)` has `k` dimensions per array; every "
    "further leading dimension is a batch dimension, which all fields must share."
)

# -- vmap and scan (`qax._batching`) -----------------------------------------------------

UNDECLARED_BATCH_AXES: Final = (
    "`{primitive}` {action} {cls} along axis {axis}, but {why}, so it is materialized. "
    "To keep it implicit, declare how its fields carry batch axes: give every array "
    "field its unbatched rank with `qax.array_field(ndim=...)` (for example "
    "`w: qax.ArrayValue = qax.array_field(ndim=2)`); leading dimensions beyond that are "
    "batch dimensions."
)

NOT_A_BATCH_AXIS: Final = (
    "`{primitive}` {action} {cls} along axis {axis}, but this {cls} has {nb} batch "
    "dimension(s) (the leading dimensions of its fields beyond their declared ranks), "
    "and axis {axis} is not one of them, so it is materialized. To keep it implicit, "
    "build it with that axis as a batch axis (stack fields of the declared ranks); a "
    "type can name its own builder for its users with `batch_axes_advice`."
)

# -- jax.export and flax.serialization (`qax._integrations`) -----------------------------

UNSERIALIZABLE_AUX: Final = (
    "jax.export cannot serialize the static metadata of {cls}: {path} holds a "
    "{kind}. qax encodes None, bool, int, float, complex, str, bytes, NumPy dtypes and "
    "scalars, and tuples, lists and dicts of them. Keep `qax.aux_field` values to these "
    "types, or register the class yourself with "
    "`jax.export.register_pytree_node_serialization` after defining it."
)

# -- Entry points (`qax._entry`) ---------------------------------------------------------

SLICED_THROUGH: Final = (
    "{cls} of shape {shape} has fields that do not fit its declared ranks ({fields}): "
    "its leaves were sliced through an unbatched dimension, for example by "
    "`lax.scan`/`lax.map` or `tree_map(lambda x: x[i], ...)` over it outside "
    "`qax.use_implicit_args`. Do the scan (or indexing) inside the function wrapped "
    "with `qax.use_implicit_args`, where implicit arrays are sliced row by row."
)

CREATED_INSIDE_USED_OUTSIDE: Final = (
    "An implicit {cls} created inside a transformation that ran inside "
    "`qax.use_implicit_args` is now evaluated outside of it (for example, a `jax.jit` "
    "function first traced inside `use_implicit_args` and called again outside), so "
    "it is materialized. Call the function inside `use_implicit_args` to keep it "
    "implicit."
)

CREATED_UNDER_VMAP: Final = (
    "An implicit {cls} was built inside `jax.vmap` from batched values, and {cls} (or "
    "an implicit array in it) does not declare how its fields carry batch axes, so "
    "the stack of its examples cannot stay implicit: it is materialized. Declare batch "
    "axes with `qax.array_field(ndim=...)`, or apply `vmap` outside "
    "`use_implicit_args` (`jax.vmap(qax.use_implicit_args(f))`) to keep it implicit."
)

CREATED_UNDER_GRAD: Final = (
    "An implicit {cls} was built inside `jax.grad`/`jax.jvp` from differentiated "
    "values; a derivative taken inside `qax.use_implicit_args` sees it as a dense "
    "array, so its tangent is formed through `materialize()`. Take the derivative "
    "outside (`jax.grad(qax.use_implicit_args(f))`) to keep it implicit."
)

# -- Flax NNX (`qax.nnx`) ----------------------------------------------------------------

NNX_UPDATE_INSIDE_WRAPPER: Final = (
    "qax.nnx.Optimizer.update was called inside `qax.use_implicit_args`, where the "
    "parameter {path} is a tracer of a {cls}, not the {cls} itself: the optimizer's "
    "arithmetic would run on the represented dense array. Wrap only the model call "
    "with `qax.use_implicit_args` (inside the loss) and keep `nnx.grad` and "
    "`optimizer.update` outside it:\n"
    "    def loss_fn(model, x, y):\n"
    "        return loss(qax.use_implicit_args(lambda m, x: m(x))(model, x), y)\n"
    "    @nnx.jit\n"
    "    def train_step(model, optimizer, x, y):\n"
    "        grads = nnx.grad(loss_fn)(model, x, y)\n"
    "        optimizer.update(model, grads)"
)

NNX_GRAD_WHOLE_VARIABLE: Final = (
    "nnx.grad / nnx.value_and_grad with `nnx.DiffState(..., {filter})` differentiates "
    "each selected Variable whole, and the one at {path} holds a {cls} whose field "
    "{field} is {dtype} (a field of its {owner}): JAX cannot differentiate it "
    '("grad requires real- or complex-valued inputs"). For QLoRA, use the LoRA '
    "recipe with "
    "`qax.nnx.value_and_grad` (or `qax.nnx.grad`), the same arguments: it "
    "differentiates only the trainable fields of the implicit values (the LoRA "
    "factors), and the codes stay as they are:\n"
    "    grad_fn = qax.nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, lora))\n"
    "    loss, grads = grad_fn(model, x, y)\n"
    "    optimizer.update(model, grads)  # qax.nnx.Optimizer, qax.freeze_keys(..., "
    'LoraWeight, ["w"])'
)

NNX_GRAD_INTEGER_INPUT: Final = (
    "{name} requires real- or complex-valued inputs (a sub-dtype of np.inexact), but "
    "the differentiated argument {argnum} has {dtype} at {path}. It differentiates "
    "integers only where an implicit array holds them (quantized codes, given float0 "
    "gradients); leave this one out of `argnums` / the `nnx.DiffState` filter."
)

# -- optax helpers (`qax._optax`) --------------------------------------------------------

BAD_FREEZE_LABELS: Final = (
    "The labels from `label_fn` must be {freeze!r} or {train!r}, got {bad}. Return "
    "{freeze!r} for the subtrees to keep fixed and {train!r} for the others."
)

UNKNOWN_FREEZE_KEYS: Final = (
    "freeze_keys: {cls} has no child field {unknown}; its child fields are {known}. "
    "(Fields declared with `qax.aux_field` are static metadata and never trained.)"
)

NOTHING_FROZEN: Final = (
    "freeze_keys found no {cls} in the parameters, so nothing is frozen and every "
    "parameter is trained. Check that `arr_type` is the class used in the parameters."
)

FLOAT0_WITHOUT_PARAMS: Final = (
    "Some gradients have dtype float0 (gradients of integer leaves); pass `params` to "
    "`update` so that they can be replaced by zeros of the parameters' dtype."
)

# -- Partition specs (`qax._partition`) --------------------------------------------------

UNDECLARED_FIELD: Final = (
    "The partition spec {spec} for a {cls} of shape {shape} partitions dimensions of "
    "the array, but its field `{field}` does not declare which of them it runs along, "
    "so qax cannot say how to partition it. Declare it on the type: "
    "`{field}: qax.ArrayValue = qax.array_field(ndim=k, follows=(...))` (for each of "
    "the field's dimensions, the dimension of the array it runs along, or None), or "
    "define `field_dims(self)` returning such tuples by field name"
)

SPEC_TOO_LONG: Final = (
    "The partition spec {spec} has {n} entries, but the {cls} it is given for has shape "
    "{shape} ({ndim} dimensions)."
)

BAD_FOLLOWS: Final = (
    "{cls}: field `{field}` declares that its dimensions follow {follows}, but it has "
    "{leaf_ndim} dimensions beyond the {nb} batch dimension(s) and the array has "
    "{ndim}; every entry must be None or a dimension of the unbatched array."
)

# -- orbax checkpoints (`qax.checkpoint`) ------------------------------------------------

NO_CHECKPOINT_DESCRIPTION: Final = (
    "qax.checkpoint.rebuild needs the description saved with the checkpoint, got "
    "{got!r}. Save it with `custom_metadata={{'qax': qax.checkpoint.describe(state)}}` "
    "and pass `checkpointer.metadata(path).custom_metadata['qax']`, or restore with a "
    "template: `checkpointer.restore(path, jax.tree.map("
    "ocp.utils.to_shape_dtype_struct, state))`."
)

UNKNOWN_CHECKPOINT_CLASS: Final = (
    "The checkpoint holds a {name}, a class not defined in this process. Import the "
    "module that defines it before `qax.checkpoint.rebuild`."
)

OTHER_CHECKPOINT_AUX: Final = (
    "The checkpoint description of the {cls} at {path} holds {got} metadata value(s), "
    "but {cls} now has {want} aux field(s) ({names}): it was saved by a version of the "
    "class with other fields. Restore that checkpoint with a template instead: "
    "`checkpointer.restore(path, jax.tree.map(ocp.utils.to_shape_dtype_struct, state))`."
)

MISSING_IN_RESTORED: Final = (
    "The restored tree has no {what} at {path} where the checkpoint description "
    "expects a {cls}. Restore the checkpoint the description was saved with."
)

# -- Rules: shardings of leaves (`qax._rules._staging`) ----------------------------------

UNDECLARED_SHARDING: Final = (
    "{what}: {message}. Its leaves {fallback} (a sharding is never guessed from leaf "
    "shapes)."
)

# -- Rules: cond (`qax._rules.cond`) -----------------------------------------------------

COND_BRANCHES_DIFFER: Final = (
    "The branches of a `lax.cond`/`lax.switch` return different implicit structures "
    "for output {path} ({described}); this {cls} is materialized so that every branch "
    "returns the same structure."
)

# -- Rules: custom derivatives (`qax._rules.custom_ad`) ----------------------------------

CUSTOM_RULE_SETTLED: Final = (
    "`{name}` has a custom derivative rule and was called on implicit arrays; its "
    "output {index} is an implicit {cls} holding differentiable data, for which the "
    "rule cannot give tangents, so it is materialized: it is differentiated here, or "
    "recorded (under `jit`, `checkpoint`, ...) in a program that JAX may differentiate "
    "later. Called outside such a transformation, the output stays implicit."
)

CUSTOM_RULE_KEPT_DIFFERENTIATED: Final = (
    "`{name}` has a custom derivative rule and returned an implicit array holding "
    "differentiable data; it was kept implicit because no enclosing transformation "
    "could differentiate it, but JAX now differentiates it, and the rule cannot give "
    "tangents for an implicit output. This is a bug in qax: please report it."
)

# -- Rules: loops (`qax._rules.loops`) ---------------------------------------------------

CARRY_CHANGES: Final = (
    "The carry {path} of a `{loop}` enters the loop as {before} but the loop body "
    "returns {after}; implicit arrays in a carry must keep their structure across "
    "iterations, so this {cls} is materialized {where}."
)

IMPLICIT_PREDICATE: Final = (
    "The predicate of a `lax.while_loop` must be a plain boolean, but its `cond_fun` "
    "returned an implicit {cls}, which is materialized."
)

# -- Rules: shard_map (`qax._rules.sharding`) --------------------------------------------

SHARD_MAP_SPLITS: Final = (
    "`shard_map` splits this {cls} by the partition spec {spec}: {message}; or pass it "
    "replicated (`P()`). It is materialized."
)

ALL_GATHER_NEW_AXIS: Final = (
    "`all_gather` (tiled=False, axis={dim}) stacks the gathered {cls} values on a new "
    "axis; that stays implicit only on a new axis 0 of a type that declares its "
    "batch axes (`qax.array_field(ndim=...)` on every field). It is materialized; "
    "gather with tiled=True, or along axis 0."
)

ALL_GATHER_KEPT_LEAF: Final = (
    "`all_gather` along dimension {dim} of this {cls} gathers the leaves that run along "
    "that dimension and keeps the others, which is right only if they are the same on "
    "every device of {axes}; a leaf of shape {shape} may differ between them (it varies "
    "over those axes, or `shard_map` was called with check_vma=False, so nothing says). "
    "It is materialized; with check_vma=True (the default) and that leaf replicated "
    "over {axes}, it stays implicit."
)

ALL_GATHER_TWICE: Final = (
    "`all_gather` along dimension {dim} of this {cls}: a leaf of shape {shape} runs "
    "along that dimension more than once (as its type declares), and gathering it "
    "leaf by leaf would miss the blocks between devices. It is materialized."
)

# -- vmap and scan, for types that give their users advice (`qax._batching`) -------------

NOT_ONE_OF_THE_BATCH_AXES: Final = (
    "this {cls} has {nb} batch dimension(s) (the leading dimensions of its fields beyond "
    "their declared ranks), and axis {axis} is not one of them"
)

BATCH_AXIS_WITH_ADVICE: Final = (
    "`{primitive}` {action} {cls} along axis {axis}, but {why}, so it is materialized. "
    "To keep it implicit: {advice}"
)
