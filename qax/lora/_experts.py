"""Mixture-of-experts weights found by path and shape (`loraify`, `qax.quant.quantize`).

An MoE layer holds its experts as one stacked weight ``(experts, d_in, d_out)`` and
routes tokens with a small router kernel ``(d_model, experts)``:

- a weight whose path has a component containing ``expert`` or a ``moe`` word
  (``experts``, ``local_experts``, ``block_sparse_moe``, ``MoeBlock_0``) and at least
  ``batch_ndim + 3`` axes is a stack of experts: its leading axis after the
  ``batch_ndim`` ones is one more batch axis (one pair of factors, or codes and scales,
  per expert);
- a weight whose path has a component containing ``router``, or the component
  ``gate`` under an MoE block (``block_sparse_moe/gate``, ``moe/gate``), is the
  router: the default filter leaves it dense (a rule can still choose it).

This module uses qax's public API only.
"""

from __future__ import annotations

import re
from typing import Any

_EXPERTS = re.compile(r"expert|(^|_)moe", re.I)
_ROUTER = re.compile(r"router", re.I)


def expert_axes(path: str, leaf: Any, batch_ndim: int = 0) -> int:
    """The expert axes of a weight beyond its ``batch_ndim`` leading (layer) axes: 1
    for a stack of experts, else 0.

    A stack of experts is a weight whose path has a component containing ``expert``
    or a ``moe`` word (``experts``, ``local_experts``, ``block_sparse_moe``,
    ``MoeBlock_0``) and that has at least ``batch_ndim + 3`` axes (``(E, d_in,
    d_out)`` beyond the layers'). `loraify` and `qax.quant.quantize` add it to their
    ``batch_ndim`` for such a weight: one pair of factors, or codes and scales, per
    expert.

    Examples:
        >>> qax.lora.expert_axes("moe/experts/w_up", jnp.ones((4, 8, 16)))
        1
        >>> qax.lora.expert_axes("layers/experts/w_up", jnp.ones((2, 8, 16)), 1)
        0

    Args:
      path: the weight's key path as a string (see `loraify`).
      leaf: the weight (anything with a ``shape``).
      batch_ndim: the leading axes that stack layers.

    Returns:
      ``1`` or ``0``.
    """
    if (
        not isinstance(batch_ndim, int)
        or len(getattr(leaf, "shape", ())) < batch_ndim + 3
    ):
        return 0
    return int(any(_EXPERTS.search(part) for part in path.split("/")))


def is_router(path: str) -> bool:
    """Whether the weight at ``path`` is an MoE router (see the module docstring)."""
    parts = path.split("/")
    if any(_ROUTER.search(part) for part in parts):
        return True
    return any(
        part.lower() == "gate" and any(_EXPERTS.search(p) for p in parts[:i])
        for i, part in enumerate(parts)
    )
