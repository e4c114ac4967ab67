"""Merging adapters into a quantized model, with the price on the table.

``w + s·a⊗b`` over a quantized base is not in the base's format: storing the merged
model quantized rounds it again, and that rounding can undo much of a fine-tune
(merged QLoRA models that score worse than the unmerged ones are a common report).
`merge` with ``quantize=`` therefore never returns a quantized model without saying
what the merge costs: it runs the user's ``check`` (the model on a batch) on the
unmerged and the merged parameters and returns a `MergeReport`; thresholds turn a bad
report into an error. This module uses qax's public API only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

import qax

from ._bank import LoraBank
from ._dora import DoraWeight
from ._weight import LoraWeight, _batch_ndim


def _adapted(x: Any) -> bool:
    return isinstance(x, (LoraWeight, DoraWeight, LoraBank))


@dataclasses.dataclass(frozen=True)
class MergeReport:
    """What merging cost, measured on the batch of ``check`` (`merge`).

    Each number is the root-mean-square difference of ``check``'s output from the
    unmerged model's (implicit weights, the reference a fine-tune was evaluated on).

    Attributes:
      quantize: the format the merged weights were stored in (``"base"``: each in its
        base's format), or ``None`` (dense).
      merged: the merged model returned.
      merged_max: its largest absolute difference.
      dense: the model merged to dense weights (float rounding only: the floor).
      adapter: the base model alone, adapters removed: what the adapters change. A
        merge whose ``merged`` approaches this has lost the fine-tune.
    """

    quantize: Any
    merged: float
    merged_max: float
    dense: float
    adapter: float

    @property
    def fraction(self) -> float:
        """``merged / adapter``: the share of the adapters' effect the merge loses."""
        return self.merged / self.adapter if self.adapter > 0 else float("inf")

    def __str__(self) -> str:
        return (
            f"merge into {self.quantize or 'dense'}: output RMS difference from the "
            f"unmerged model {self.merged:.3g} (max {self.merged_max:.3g}), "
            f"{100 * self.fraction:.1f} % of what the adapters change "
            f"({self.adapter:.3g}); a dense merge differs by {self.dense:.3g}."
        )


class MergeQualityError(ValueError):
    """A merge whose `MergeReport` exceeds a threshold given to `merge`; the report
    is the ``report`` attribute."""

    def __init__(self, message: str, report: MergeReport):
        super().__init__(message)
        self.report = report


def requantized(x: Any, dense: jax.Array, quantize: Any, options: dict) -> Any:
    """``dense``, the merge of the adapted weight ``x``, stored in ``x``'s base's format
    (``quantize="base"``; a dense base stays dense) or in the format ``quantize``."""
    if quantize == "base":
        if not isinstance(x.w, qax.quant.QuantizedWeight):
            return dense
        return qax.quant.requantize(dense, x.w)
    nb = _batch_ndim(jnp.ndim(x.w), jnp.ndim(x.a), jnp.ndim(x.b))
    return qax.quant.quantize(
        dense, quantize, filter=lambda *_: True, **{"batch_ndim": nb, **options}
    )


BANK_REFUSED = (
    "merge(quantize=...): a LoraBank stands for one merged weight per adapter; "
    "take out the adapter you serve first (qax.lora.unbank) and merge that."
)


def _rms(x: Any, y: Any) -> tuple[float, float]:
    diffs = [
        jnp.ravel(jnp.asarray(a, jnp.float32) - jnp.asarray(b, jnp.float32))
        for a, b in zip(jax.tree_util.tree_leaves(x), jax.tree_util.tree_leaves(y))
    ]
    d = jnp.concatenate(diffs)
    return float(jnp.sqrt(jnp.mean(d**2))), float(jnp.max(jnp.abs(d)))


def report(
    params: Any,
    merged: Any,
    dense: Any,
    check: Callable[[Any], Any],
    quantize: Any,
    max_error: float | None,
    max_fraction: float | None,
) -> MergeReport:
    """Run ``check`` on the unmerged, merged, dense-merged and base-only parameters
    and compare; raise `MergeQualityError` past a threshold."""
    run = qax.use_implicit_args(check)
    want = run(params)
    base = jax.tree_util.tree_map(
        lambda x: x.w if _adapted(x) else x, params, is_leaf=_adapted
    )
    merged_rms, merged_max = _rms(run(merged), want)
    out = MergeReport(
        quantize=quantize,
        merged=merged_rms,
        merged_max=merged_max,
        dense=_rms(run(dense), want)[0],
        adapter=_rms(run(base), want)[0],
    )
    if max_error is not None and out.merged > max_error:
        raise MergeQualityError(
            f"{out} That is more than max_error={max_error}: keep the adapters "
            "unmerged, merge into a finer format (quantize='int8' or None), or "
            "fine-tune against the merged base.",
            out,
        )
    if max_fraction is not None and out.fraction > max_fraction:
        raise MergeQualityError(
            f"{out} That is more than max_fraction={max_fraction} of the adapters' "
            "effect: keep the adapters unmerged, merge into a finer format "
            "(quantize='int8' or None), or fine-tune against the merged base.",
            out,
        )
    return out
