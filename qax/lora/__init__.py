"""LoRA weights that are never formed: `LoraWeight`, `loraify`, `merge`, `split`, `combine`.

A `LoraWeight` behaves like the dense weight ``w + (alpha / rank) * a @ b`` while storing
only ``w`` and the two thin factors. Its handlers turn every way a model uses a weight into
products with the factors, so ``w + a @ b`` is never built:

- ``dot_general`` in any contraction layout (``x @ W``, ``x @ W.T``, ``W @ x``, ``einsum``
  with batch dimensions, attention projections): ``x·W + s·((x·a)·b)`` (or ``(x·b)·a``,
  whichever factor ``x`` contracts with);
- ``conv_general_dilated`` (any spatial rank): a convolution with the factor that holds the
  input and spatial axes, then a 1x1 product with the other one;
- ``gather`` of rows (embedding lookups ``table[ids]``, ``jnp.take``): the rows of ``w``
  and of ``a``, times ``b``;
- ``transpose``, ``reshape`` (e.g. a fused QKV kernel viewed as ``(d, 3, d)``),
  ``squeeze``, ``slice``, ``split`` (``jnp.split`` of a fused kernel),
  ``convert_element_type`` (``w.astype(bf16)``: every field is cast, so bf16 compute over
  f32 factors keeps f32 gradients), ``mul`` by a scalar, ``stop_gradient``: another
  `LoraWeight`.
- on a stack of weights (``loraify(..., batch_ndim=1)``), besides the products and
  `lax.scan` / `vmap` slicing: one layer (``stack[i]`` with a static or traced ``i``,
  also inside `lax.fori_loop`), a range of layers, and transposes that keep the layer
  axis (``jnp.swapaxes(stack, -1, -2)``, ``w.T`` under `vmap`) index or transpose the
  factors.

**Factor layout.** For a weight ``w`` of shape ``(*A, *B)`` (``A`` the leading axes),
``a`` has shape ``(*A, rank)`` and ``b`` has shape ``(rank, *B)``, and the weight stands
for ``w + (alpha / rank) * tensordot(a, b, 1)``. For a Flax / NNX ``Dense`` kernel of shape
``(in, out)`` (``y = x @ W``) that is ``a: (in, rank)``, ``b: (rank, out)``: ``a`` is the
down-projection PEFT calls ``lora_A`` (its ``weight`` is ``a.T``) and ``b`` the
up-projection ``lora_B`` (``weight`` = ``b.T``), so ``x @ W_eff = x @ w + s (x @ a) @ b``.
For a Flax convolution kernel ``(*spatial, in, out)``, ``a`` is ``(*spatial, in, rank)``
(a convolution with ``rank`` output channels) and ``b`` is ``(rank, out)`` (a 1x1
convolution), as in PEFT's convolution LoRA. Equinox stores ``Linear`` weights as
``(out, in)`` and convolutions as ``(out, in, *spatial)``: use ``split_at=1`` in `loraify`
(``a: (out, rank)``, ``b: (rank, in, *spatial)``).
Einsum kernels whose contracted axes are not the leading ones (a query kernel
``(heads, d_model, head_dim)``) take ``a_axes``: ``a`` runs along the named axes of ``w``
and ``b`` along the others, ``a (d_model, rank)``, ``b (rank, heads, head_dim)`` for
``a_axes=(1,)``, the adapter PEFT and qwix put on such kernels.

**Gradients.** With ``freeze_w=True`` (the default) the handlers (and `materialize`) apply
`jax.lax.stop_gradient` to ``w``: differentiating a loss with respect to a whole
`LoraWeight` then computes no ``w``-sized gradient product at all (its gradient is zero);
only ``a`` and ``b`` get gradients. The recipe for training is `split` / `combine`:

Examples:
    >>> params = qax.lora.loraify(params, rank=8, key=jax.random.key(0), alpha=16.0)
    >>> adapters, base = qax.lora.split(params)
    >>> opt = optax.adam(1e-3)
    >>> opt_state = opt.init(adapters)          # moments for the factors only
    >>> @jax.jit
    ... def step(adapters, opt_state, base, batch):
    ...     def loss(adapters):
    ...         return qax.use_implicit_args(loss_fn)(qax.lora.combine(adapters, base), batch)
    ...     value, grads = jax.value_and_grad(loss)(adapters)
    ...     updates, opt_state = opt.update(grads, opt_state, adapters)
    ...     return optax.apply_updates(adapters, updates), opt_state, value

``base`` may hold quantized weights (`qax.quant`): that is QLoRA. Nothing in ``base`` is
differentiated, so integer leaves need no ``allow_int=True``.

This module uses qax's public API only; copy it to write your own weight types.
"""

from __future__ import annotations

import qax

from . import _ragged, _stacks  # noqa: F401 (registers more handlers)
from ._bank import (
    BankPadding,
    BankPaddingRow,
    DoraBank,
    LoraBank,
    bank,
    bank_padding,
    unbank,
)
from ._bank_specs import bank_specs
from ._dora import DoraAdapter, DoraBase, DoraWeight, to_dora
from ._experts import expert_axes
from ._init import LoftQ, PiSSA
from ._merge import MergeQualityError, MergeReport
from ._params import (
    combine,
    default_filter,
    loraify,
    merge,
    plan,
    split,
    trainable_count,
)
from ._per_example import per_example
from ._select import Plan, PlanRow, biases, check_rules, unmatched_rules
from ._weight import LoraAdapter, LoraWeight

# Public here before it moved to `qax.utils` (the parameter-tree helpers' home).
path_string = qax.utils.path_string
# PEFT's layout for every kernel, read from one abstract trace of the model (lives in
# `qax.utils`: it reads jaxprs); pass it as `loraify`'s ``a_axes``.
contracted_axes = qax.utils.contracted_axes

__all__ = [
    "BankPadding",
    "BankPaddingRow",
    "DoraAdapter",
    "DoraBank",
    "DoraBase",
    "DoraWeight",
    "LoftQ",
    "LoraAdapter",
    "LoraBank",
    "LoraWeight",
    "MergeQualityError",
    "MergeReport",
    "PiSSA",
    "Plan",
    "PlanRow",
    "bank",
    "bank_padding",
    "bank_specs",
    "biases",
    "check_rules",
    "combine",
    "contracted_axes",
    "default_filter",
    "expert_axes",
    "loraify",
    "merge",
    "path_string",
    "per_example",
    "plan",
    "split",
    "to_dora",
    "trainable_count",
    "unbank",
    "unmatched_rules",
]
