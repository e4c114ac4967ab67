"""Parameter trees: put `LoraWeight`s into any params pytree and take them apart again
(see `qax.lora`). This module uses qax's public API only.
"""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import qax

from ._bank import LoraBank
from ._dora import DoraAdapter, DoraBase, DoraWeight, to_dora
from ._experts import expert_axes, is_router
from ._init import check_init, initialised
from ._merge import BANK_REFUSED, report, requantized
from ._select import (
    Plan,
    PlanRow,
    _first_rule,
    biases,
    check_rules,
    unmatched_rules,
)
from ._weight import LoraAdapter, LoraWeight


def _is_lora(x: Any) -> bool:
    return isinstance(x, LoraWeight)


_SPLIT_BANK = (
    "qax.lora.split: the parameters hold a LoraBank at {path} (many adapters over one "
    "base), which `split` does not take apart. To train a bank's adapters with optax, "
    "keep them as the list of adapter trees `qax.lora.unbank(params)` returns, and "
    "build the bank inside the loss: `qax.lora.per_example(f)(ids, qax.lora.bank(base, "
    "adapters), ...)`. To train it in place, use `qax.freeze_keys(tx, "
    "qax.lora.LoraBank, ['w'])` or `qax.nnx.Optimizer`."
)


# What the default filter leaves out, by name (`default_filter`), with the reason.
_EMBEDDING = re.compile(r"embed|^wte$|^wpe$|^(pos|tok)_emb", re.I)
_NORM = re.compile(r"norm|^ln(_|\d|$)", re.I)
_BIAS = re.compile(r"bias", re.I)


def default_filter(path: str, leaf: Any) -> bool:
    """`loraify`'s default: every floating-point weight with 2 or more axes, except
    embeddings, normalisation parameters and biases.

    A weight is left out when a component of its path contains ``norm`` or ``bias``
    (``layer_norm``, ``RMSNorm``; Equinox convolution biases have shape
    ``(out, 1, 1)``), starts with ``ln`` followed by ``_``, a digit or nothing
    (``ln_f``, ``ln1``), or when it has at most 3 axes and a component contains
    ``embed`` or is ``wte``/``wpe`` (embedding tables such as ``embedding``,
    ``Embed_0``, GPT-2's token and position tables, a ViT's ``(1, n, d)``
    ``pos_embedding``; a convolution kernel of 4 or more axes, such as a ViT's
    ``patch_embedding/kernel`` ``(p, p, c, d)``, is a weight), or when it is a
    mixture-of-experts router (a component contains ``router``, or is ``gate`` under
    a component containing ``expert`` or a ``moe`` word: ``block_sparse_moe/gate``).

    On a whole tree, `loraify`, `qax.quant.quantize` and `qax.qat.fake_quantize` also
    leave out the biases that `biases` finds from the tree's structure (Haiku's and
    Griffin's ``b`` beside ``w``) when ``filter`` is this function or ``None``; a
    filter of your own that calls it can do the same with `biases`. `plan` shows
    what was chosen and why.

    Examples:
        >>> qax.lora.default_filter("h_0/attn/c_attn/kernel", jnp.ones((4, 12)))
        True
        >>> qax.lora.default_filter("wte/embedding", jnp.ones((64, 4)))
        False

    Args:
      path: the leaf's key path as a string (see `loraify`).
      leaf: the parameter.

    Returns:
      Whether the parameter gets a LoRA.
    """
    return _left_out(path, leaf) is None


def _left_out(path: str, leaf: Any) -> str | None:
    """Why `default_filter` leaves ``leaf`` out (``None``: it does not)."""
    parts = path.split("/")
    if any(_BIAS.search(part) for part in parts):
        return "bias"
    if any(_NORM.search(part) for part in parts):
        return "normalisation"
    if not hasattr(leaf, "shape") or len(leaf.shape) < 2:
        return "fewer than 2 axes"
    if not jnp.issubdtype(leaf.dtype, jnp.floating):
        return "not floating point"
    if len(leaf.shape) <= 3 and any(_EMBEDDING.search(part) for part in parts):
        return "embedding"
    if is_router(path):
        return "router"
    return None


def _default_reason(filter: Any, found: frozenset) -> Callable[[str, Any], str | None]:
    """``reason(path, leaf)``: why a selection leaves a leaf out (``None``: chosen),
    with ``filter`` (``None`` or `default_filter`: by name and by the tree's biases,
    `found`)."""
    if filter is not None and filter is not default_filter:
        return lambda path, leaf: None if filter(path, leaf) else "filter"
    return lambda path, leaf: "bias" if path in found else _left_out(path, leaf)


_BAD_SPLIT = (
    "loraify: split_at={split_at} for the weight at {path!r} of shape {shape}; it must "
    "leave at least one axis to each factor (1 <= split_at <= {most})."
)


def loraify(
    params: Any,
    rank: int,
    *,
    key: jax.Array,
    alpha: float | None = None,
    filter: Callable[[str, Any], bool] | None = None,
    split_at: int | Callable[[str, Any], int] | None = None,
    a_axes: Sequence[int] | Callable[[str, Any], Sequence[int]] | None = None,
    freeze_w: bool = True,
    dtype: Any = None,
    batch_ndim: int | Callable[[str, Any], int] = 0,
    rules: Any = None,
    strict_rules: bool = False,
    init: Any = "gaussian",
    dora: bool = False,
) -> Any:
    """Turn chosen weights of any params pytree into `LoraWeight`s.

    Works on any pytree: a Flax linen ``params`` dict, an NNX ``State``, an Equinox
    module, a dict of arrays. Quantized weights (`qax.quant`) are weights too (QLoRA). The
    new factors follow PEFT's initialisation: ``a`` is Gaussian with standard deviation
    ``1 / sqrt(fan_in)`` (``fan_in`` = the size of ``a``'s weight axes) and ``b`` is zero,
    so the model computes exactly what it computed before.

    Examples:
        >>> params = qax.lora.loraify(params, 8, key=jax.random.key(0), alpha=16.0)
        >>> qax.lora.trainable_count(params)
        12288
        >>> params = qax.lora.loraify(params, 8, key=key, rules=[
        ...     ("layers/[0-9]+/attn/.*", {"rank": 16, "alpha": 32.0}),
        ...     (".*/head/.*", None),  # no adapter on the head
        ... ])

    Args:
      params: the parameters.
      rank: the LoRA rank.
      key: a PRNG key for the ``a`` factors (folded with each weight's path).
      alpha: the scale numerator (``alpha / rank``); ``None`` means a scale of 1.
      filter: ``filter(path, leaf) -> bool`` chooses the weights; ``path`` is the leaf's
        key path as ``"a/b/c"`` (NNX states end in ``/value``). Default:
        `default_filter` (every 2-D+ weight but embeddings and norms), and no bias
        that `biases` finds in ``params`` (``b`` beside ``w``). `plan` shows what it
        chooses.
      split_at: where a weight's axes split between the factors: ``a`` takes the axes
        before it, ``b`` the rest (an int, or a function of ``(path, leaf)``). Default:
        all but the last axis go to ``a`` (Flax ``(in, out)`` kernels and
        ``(*spatial, in, out)`` convolutions); use ``1`` for Equinox ``(out, in, ...)``
        weights. (Not `LoraWeight.a_ndim`, the rank of ``a``, which is ``split_at + 1``.)
      a_axes: which of a weight's axes go to ``a`` (a tuple of axes of one unbatched
        weight, or a function of ``(path, leaf)``); the others go to ``b``, in order.
        Given, it takes the place of ``split_at``. For an einsum kernel whose input
        axis is not first, this makes the adapter PEFT and qwix make: the query kernel
        ``(heads, d_model, head_dim)`` of ``x @ W`` over ``d_model`` with
        ``a_axes=(1,)`` gets ``a (d_model, rank)`` and ``b (rank, heads, head_dim)``,
        one ``b`` column block per head, where ``split_at`` can only cut the axes in
        order. (Name the contracted axes: the adapter then costs
        ``rank * (contracted size + the rest)`` numbers.) A function may return
        ``None`` for a weight: ``split_at`` decides there. `contracted_axes` gives
        such a function for the whole model, read from one abstract trace of it
        (PEFT's layout on every kernel, no rules).
      freeze_w: passed to every `LoraWeight`.
      dtype: the dtype of the new factors (default: the weight's).
      batch_ndim: leading axes of a chosen weight that stack independent weights
        (layers stacked for `lax.scan`), an int or a function of ``(path, leaf)``: each
        layer gets its own factors, ``a`` of shape ``(L, *A, rank)`` and ``b``
        ``(L, rank, *B)``, and `lax.scan` over the stack slices the `LoraWeight`
        without forming it. A chosen weight with fewer than ``batch_ndim + 2`` axes
        (the 2-D head beside a stack of layers, under ``batch_ndim=1`` for the whole
        model) is adapted as one unstacked weight. A stack of experts (a path
        component containing ``expert`` or a ``moe`` word, at least ``batch_ndim + 3``
        axes: ``experts/w_up`` ``(E, d, f)``) gets its expert axis as one more batch
        axis: one pair of factors per expert.
      rules: per-path settings, like qwix's rules: an ordered list of ``(pattern,
        settings)``. The first pattern (a regular expression) that matches all of a
        weight's path decides for it: ``settings`` is a dict overriding this call's
        ``rank``, ``alpha``, ``split_at``, ``a_axes``, ``freeze_w``, ``dtype``,
        ``batch_ndim``, ``init`` and ``dora`` for that weight, which is then chosen whatever ``filter`` says (but biases
        and normalisation parameters, as `default_filter` and `biases` find them,
        are never adapted by a rule, and a weight with too few axes for the rule's
        ``batch_ndim`` is left alone); or ``None``, to leave it alone. Weights that no
        pattern matches are chosen by ``filter`` and get this call's settings. A rule
        that decides no weight (its pattern matches no path: patterns match whole
        paths; or only paths an earlier rule decides) gives a warning that names it
        and the closest paths (`check_rules`).
      strict_rules: raise instead of warning about a rule that decides no weight.
      init: how the factors start: ``"gaussian"`` (PEFT's: the model unchanged), or
        from the dense weight, `PiSSA` (the principal components in the factors, the
        residual in the base, dense or quantized: QPiSSA) or `LoftQ` (a quantized base
        and factors that cancel its error); see `qax.lora.PiSSA`. A rule's settings may
        name another ``init`` for its weights.
      dora: make `DoraWeight`s (DoRA: a trainable magnitude per output unit, see
        `to_dora`) instead of `LoraWeight`s; a rule may set it per weight.

    Returns:
      ``params`` with the chosen weights replaced by `LoraWeight`s (`DoraWeight`s
      where ``dora``).

    Raises:
      ValueError: ``rank`` is not positive, ``split_at`` leaves a factor no axis,
        ``a_axes`` names no axis, every axis or an axis twice, or a rule is malformed
        (see `qax.utils.path_rules`), or, under ``strict_rules``, a rule decides no
        weight.
    """
    defaults = {
        "rank": rank,
        "alpha": alpha,
        "split_at": split_at,
        "a_axes": a_axes,
        "freeze_w": freeze_w,
        "dtype": dtype,
        "batch_ndim": batch_ndim,
        "init": check_init(init),
        "dora": bool(dora),
    }
    lookup = qax.utils.path_rules(rules, tuple(defaults), "loraify")
    _check_rank(rank)
    decide = _decider(params, defaults, filter, rules, lookup)
    seen = []

    def convert(path, leaf):
        name = qax.utils.path_string(path)
        if hasattr(leaf, "shape"):
            seen.append(name)
        if _is_lora(leaf):
            return leaf
        settings, _, stacked = decide(name, leaf)
        if settings is None:
            return leaf
        # factors made here, beside a weight placed on a mesh (a global array of a
        # multi-controller run): placed as the weight's spec asks
        return qax.sharding.conform(_adapted(name, leaf, key, settings, stacked))

    out = qax.utils.tree_map_with_path_with_implicit(convert, params)
    check_rules(rules, seen, "loraify", strict=strict_rules, stacklevel=2)
    return out


def _decider(
    params: Any, defaults: dict, filter: Any, rules: Any, lookup: Any
) -> Callable[[str, Any], tuple[dict | None, str, bool]]:
    """``decide(path, leaf) -> (settings, why, stacked)``: `loraify`'s choice for one
    weight: its settings (``None``: left alone), what decided, and whether a rule gave
    its ``batch_ndim``."""
    found = biases(params)
    reason = _default_reason(filter, found)
    by = "default filter" if filter is None or filter is default_filter else "filter"

    def decide(name: str, leaf: Any) -> tuple[dict | None, str, bool]:
        matched, settings = lookup(name)
        if matched:
            rule = f"rule {_first_rule(rules, name)!r}"
            if settings is None:
                return None, f"{rule}: None", False
            parts = name.split("/")
            if name in found or any(_BIAS.search(p) for p in parts):
                return None, "bias (never by a rule)", False
            if any(_NORM.search(p) for p in parts):
                return None, "normalisation (never by a rule)", False
            stacked = "batch_ndim" in settings
            return {**defaults, **settings}, rule, stacked
        why = reason(name, leaf)
        if why is not None:
            return None, why, False
        return dict(defaults), by, False

    return decide


def plan(
    params: Any,
    rank: int,
    *,
    filter: Callable[[str, Any], bool] | None = None,
    split_at: int | Callable[[str, Any], int] | None = None,
    a_axes: Sequence[int] | Callable[[str, Any], Sequence[int]] | None = None,
    batch_ndim: int | Callable[[str, Any], int] = 0,
    rules: Any = None,
) -> Plan:
    """What `loraify` with these arguments would do to each weight, without doing it.

    Takes `loraify`'s arguments that choose and shape the adapters. Each leaf with a
    shape gets a `PlanRow`: adapted or not, what decided (the filter, a rule, or the
    reason it is left out: ``"bias"``, ``"embedding"``, ``"normalisation"``, ``"fewer
    than 2 axes"``...), and the factors' shapes; rules that would decide no weight are
    listed. ``print(plan)`` shows a table.

    Examples:
        >>> params = {"gate": {"w": jnp.ones((2, 64, 64)), "b": jnp.ones((2, 64))}}
        >>> print(qax.lora.plan(params, 8))
        loraify converts 1 of 2 leaves:
          gate/b  (2, 64)      float32  skipped: bias
          gate/w  (2, 64, 64)  float32  rank 8: a (2, 64, 8), b (8, 64) (default filter)

    Args:
      params: the parameters, as for `loraify`.
      rank: as for `loraify`.
      filter: as for `loraify`.
      split_at: as for `loraify`.
      a_axes: as for `loraify`.
      batch_ndim: as for `loraify`.
      rules: as for `loraify`.

    Returns:
      A `Plan`.

    Raises:
      ValueError: as `loraify` for these arguments.
    """
    defaults = {
        "rank": rank,
        "alpha": None,
        "split_at": split_at,
        "a_axes": a_axes,
        "freeze_w": True,
        "dtype": None,
        "batch_ndim": batch_ndim,
        "init": "gaussian",
        "dora": False,
    }
    lookup = qax.utils.path_rules(rules, tuple(defaults), "loraify")
    _check_rank(rank)
    decide = _decider(params, defaults, filter, rules, lookup)
    rows = []
    for path, leaf in qax.utils.tree_flatten_with_path_with_implicit(params)[0]:
        if not hasattr(leaf, "shape"):
            continue
        name = qax.utils.path_string(path)
        shape, dtype = tuple(leaf.shape), str(jnp.dtype(leaf.dtype))
        if _is_lora(leaf):
            rows.append(PlanRow(name, shape, dtype, False, "already a LoraWeight"))
            continue
        settings, why, stacked = decide(name, leaf)
        layout = None if settings is None else _layout(name, leaf, settings, stacked)
        if layout is None:
            if settings is not None:
                why = f"{why}: fewer than batch_ndim + 2 axes"
            rows.append(PlanRow(name, shape, dtype, False, why))
            continue
        _check_rank(settings["rank"])
        lead, one, a, b = layout
        r = int(settings["rank"])
        detail = (
            f"rank {r}: a {(*lead, *(one[i] for i in a), r)}, "
            f"b {(*lead, r, *(one[i] for i in b))}"
        )
        rows.append(PlanRow(name, shape, dtype, True, why, detail))
    seen = [row.path for row in rows]
    return Plan("loraify", tuple(rows), unmatched_rules(rules, seen, "loraify"))


def _check_rank(rank: Any) -> None:
    if int(rank) < 1:
        raise ValueError(f"loraify: rank must be a positive integer, got {rank!r}.")


def _adapted(
    name: str, leaf: Any, key: jax.Array, s: dict, stacked: bool = False
) -> Any:
    """`leaf` as a `LoraWeight` with the settings `s` (`loraify`'s keywords);
    `stacked`: a rule gave its ``batch_ndim`` (it is then part of a stack)."""
    rank = s["rank"]
    _check_rank(rank)
    layout = _layout(name, leaf, s, stacked)
    if layout is None:
        return leaf
    lead, shape, a_axes, b_axes = layout
    factor_dtype = s["dtype"] or leaf.dtype
    init = check_init(s.get("init", "gaussian"))
    if init == "gaussian":
        k = jax.random.fold_in(key, zlib.crc32(name.encode()) % (2**31))
        a_shape = tuple(shape[i] for i in a_axes)
        a = jax.random.normal(k, (*lead, *a_shape, rank), jnp.float32)
        a = (a / np.sqrt(math.prod(a_shape))).astype(factor_dtype)
        b = jnp.zeros((*lead, rank, *(shape[i] for i in b_axes)), factor_dtype)
    else:
        scale = 1.0 if s["alpha"] is None else float(s["alpha"]) / rank
        leaf, a, b = initialised(name, leaf, init, rank, scale, layout, factor_dtype)
    try:
        out = LoraWeight(
            leaf, a, b, alpha=s["alpha"], freeze_w=s["freeze_w"], a_axes=a_axes
        )
    except ValueError as error:  # name the weight
        raise ValueError(f"loraify, the weight at {name!r}: {error}") from None
    return to_dora(out) if s.get("dora") else out


def _layout(name: str, leaf: Any, s: dict, stacked: bool) -> tuple | None:
    """``(lead, shape, a_axes, b_axes)`` of the `LoraWeight` that `_adapted` makes
    (the stack's axes, one weight's shape, the axes of ``a`` and ``b``), or ``None``
    where it leaves `leaf` alone."""
    nb = s["batch_ndim"](name, leaf) if callable(s["batch_ndim"]) else s["batch_ndim"]
    nb += expert_axes(name, leaf, nb)  # a stack of experts: one more batch axis
    if len(leaf.shape) - nb < 2:
        if stacked:
            return None  # a stack of vectors, by the rule: nothing to adapt
        nb = 0  # too few axes for a stack: one weight (the head beside the layers)
    if len(leaf.shape) < 2:
        return None
    lead, shape = tuple(leaf.shape[:nb]), tuple(leaf.shape[nb:])
    return (lead, shape, *_factor_axes(name, leaf, shape, s))


_BAD_AXES = (
    "loraify: a_axes={axes} for the weight at {path!r} of shape {shape}: it must name "
    "distinct axes of one (unbatched) weight ({k} axes: -{k}..{top}), at least one and "
    "not all of them, so that each factor gets an axis."
)


def _factor_axes(
    name: str, leaf: Any, shape: tuple, s: dict
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The axes of one weight that ``a`` and ``b`` run along (`loraify`'s ``a_axes``
    or ``split_at``)."""
    k = len(shape)
    given = s["a_axes"](name, leaf) if callable(s["a_axes"]) else s["a_axes"]
    if given is not None:  # (a callable's None: the default layout for this weight)
        try:
            axes = tuple(int(i) for i in given)
        except TypeError:
            axes = ()
        ok = 1 <= len(axes) < k and all(-k <= i < k for i in axes)
        if ok and len({i % k for i in axes}) == len(axes):
            axes = tuple(i % k for i in axes)
            return axes, tuple(i for i in range(k) if i not in axes)
        raise ValueError(
            _BAD_AXES.format(axes=given, path=name, shape=leaf.shape, k=k, top=k - 1)
        )
    p = s["split_at"](name, leaf) if callable(s["split_at"]) else s["split_at"]
    p = k - 1 if p is None else int(p)
    if not 1 <= p <= k - 1:
        raise ValueError(
            _BAD_SPLIT.format(split_at=p, path=name, shape=leaf.shape, most=k - 1)
        )
    return tuple(range(p)), tuple(range(p, k))


def merge(
    params: Any,
    quantize: Any = None,
    *,
    check: Callable[[Any], Any] | None = None,
    max_error: float | None = None,
    max_fraction: float | None = None,
    **options: Any,
) -> Any:
    """Parameters for serving: every adapted weight becomes ``w + s·a⊗b``.

    By default the merged weights are dense (a quantized base is dequantized); a
    `LoraBank` becomes the stack of its adapters' merged weights (what it stands for),
    a `DoraWeight` its ``m·V/‖V‖``. With ``quantize``, the merged weights are stored
    quantized again: ``"base"`` (each in its base's format and layout, a dense base
    staying dense; `qax.quant.requantize`) or a format of `qax.quant.FORMATS` (with
    its ``options``). Rounding ``w + s·a⊗b`` again can undo part of a fine-tune, so a
    quantized merge needs ``check``, a function of the parameters that runs the model
    on a batch (any pytree of arrays out): `merge` then returns the merged parameters
    *and* a `MergeReport` that says how far the merged model's output is from the
    unmerged one's, beside what the adapters change and what a dense merge changes.
    ``check`` runs four times (unmerged, merged, dense-merged, base alone), under
    `qax.use_implicit_args`.

    Examples:
        >>> dense = qax.lora.merge(params)  # runs without use_implicit_args
        >>> qlora = qax.lora.loraify(qax.quant.quantize(params, "nf4"), 8, key=key)
        >>> served, report = qax.lora.merge(
        ...     qlora, "base", check=lambda p: model.apply(p, x), max_error=0.5)
        >>> print(report)  # doctest: +SKIP
        merge into base: output RMS difference from the unmerged model 0.0213 ...

    Args:
      params: parameters holding `LoraWeight`s (`DoraWeight`s, `LoraBank`s).
      quantize: ``None`` (dense), ``"base"`` or a format name or class.
      check: ``check(params) -> outputs``; required with ``quantize``, optional
        without (then a report on the dense merge is returned too).
      max_error: raise `MergeQualityError` when the merged output's RMS difference
        from the unmerged one is larger.
      max_fraction: raise `MergeQualityError` when that difference is more than this
        fraction of what the adapters change (`MergeReport.fraction`).
      **options: the format's options (``block_size``...) for a named ``quantize``.

    Returns:
      The merged tree; with ``check``, ``(merged, report)``.

    Raises:
      ValueError: ``quantize`` without ``check``; a `LoraBank` with ``quantize``
        (`unbank` the adapter to serve first); thresholds without ``check``.
      MergeQualityError: the report exceeds ``max_error`` or ``max_fraction``.
    """
    if quantize is not None and check is None:
        raise ValueError(
            f"merge(quantize={quantize!r}) needs check=: a function of the parameters "
            "that runs the model on a batch (e.g. lambda p: model.apply(p, batch)). "
            "Quantizing w + s·a⊗b again can undo part of the fine-tune; the report "
            "says how much."
        )
    if check is None and (max_error is not None or max_fraction is not None):
        raise ValueError("merge: max_error and max_fraction need check= to measure.")

    def is_leaf(x: Any) -> bool:
        return isinstance(x, (LoraWeight, LoraBank, DoraWeight))

    def dense_of(x: Any) -> Any:
        return qax.materialize_nested(x, full=True) if is_leaf(x) else x

    if quantize is not None and any(
        isinstance(x, LoraBank) for x in jax.tree_util.tree_leaves(params, is_leaf)
    ):
        raise ValueError(BANK_REFUSED)
    dense = jax.tree_util.tree_map(dense_of, params, is_leaf=is_leaf)
    merged = dense
    if quantize is not None:
        merged = jax.tree_util.tree_map(
            lambda x, d: requantized(x, d, quantize, options) if is_leaf(x) else x,
            params,
            dense,
            is_leaf=is_leaf,
        )
    if check is None:
        return merged
    return merged, report(
        params, merged, dense, check, quantize, max_error, max_fraction
    )


def split(params: Any) -> tuple[Any, Any]:
    """Separate the trainable factors from everything else.

    Returns ``(adapters, base)``: ``adapters`` has the structure of ``params`` with a
    `LoraAdapter` (``a``, ``b``) in place of each `LoraWeight` and ``None`` elsewhere
    (save it alone: a few MB); ``base`` is ``params`` with each `LoraWeight` replaced by
    its ``w`` (the pretrained weights, possibly quantized). ``combine(adapters, base)``
    rebuilds ``params``.

    Examples:
        >>> adapters, base = qax.lora.split(params)
        >>> opt_state = optax.adam(1e-3).init(adapters)

    Args:
      params: parameters holding `LoraWeight`s.

    Returns:
      ``(adapters, base)``.
    """

    for path, x in jax.tree_util.tree_flatten_with_path(
        params, is_leaf=lambda v: isinstance(v, LoraBank)
    )[0]:
        if isinstance(x, LoraBank):
            path_text = qax.utils.path_string(path)
            raise ValueError(_SPLIT_BANK.format(path=path_text))

    def adapter(x: Any) -> Any:
        if isinstance(x, DoraWeight):
            return DoraAdapter(x.a, x.b, x.m, alpha=x.alpha, a_axes=x.a_axes)
        if not _is_lora(x):
            return None
        return LoraAdapter(
            x.a, x.b, alpha=x.alpha, freeze_w=x.freeze_w, a_axes=x.a_axes
        )

    def frozen(x: Any) -> Any:
        if isinstance(x, DoraWeight):
            return DoraBase(x.w, x.w_norm2)
        return x.w if _is_lora(x) else x

    # Every implicit array is one weight: None at a quantized weight without LoRA (not
    # a copy of its type with None fields, which `combine` would take for an adapter).
    def is_weight(x: Any) -> bool:
        return isinstance(x, qax.ImplicitArray)

    adapters = jax.tree_util.tree_map(adapter, params, is_leaf=is_weight)
    base = jax.tree_util.tree_map(frozen, params, is_leaf=is_weight)
    return adapters, base


_BAD_COMBINE = (
    "combine: `adapters` must have the structure of the `base` parameters, with a "
    "LoraAdapter or None at each weight (as `qax.lora.split` returns): {error}"
)


def combine(adapters: Any, base: Any) -> Any:
    """Inverse of `split`: put each `LoraAdapter` back on its base weight.

    Examples:
        >>> params = qax.lora.combine(adapters, base)

    Args:
      adapters: a tree from `split` (`LoraAdapter` or ``None`` per weight).
      base: the base parameters (the second result of `split`), e.g. restored from a
        checkpoint or quantized with `qax.quant.quantize`.

    Returns:
      The parameters with `LoraWeight`s.

    Raises:
      ValueError: the two trees do not match.
    """

    def is_leaf(x: Any) -> bool:
        return x is None or isinstance(x, (LoraAdapter, DoraAdapter))

    def one(adapter: Any, w: Any) -> Any:
        if adapter is None:
            return w
        if isinstance(adapter, DoraAdapter):
            w, w_norm2 = (w.w, w.w_norm2) if isinstance(w, DoraBase) else (w, None)
            return DoraWeight(
                w,
                adapter.a,
                adapter.b,
                m=adapter.m,
                w_norm2=w_norm2,
                alpha=adapter.alpha,
                a_axes=adapter.a_axes,
            )
        return LoraWeight(
            w,
            adapter.a,
            adapter.b,
            alpha=adapter.alpha,
            freeze_w=adapter.freeze_w,
            a_axes=adapter.a_axes,
        )

    try:
        return jax.tree_util.tree_map(one, adapters, base, is_leaf=is_leaf)
    except (ValueError, TypeError) as e:
        raise ValueError(_BAD_COMBINE.format(error=e)) from None


def trainable_count(params: Any) -> int:
    """The number of trainable LoRA numbers: the sizes of every ``a`` and ``b``.

    Examples:
        >>> qax.lora.trainable_count(qax.lora.loraify({"w": jnp.ones((4, 3))}, 2, key=k))
        14

    Args:
      params: parameters holding `LoraWeight`s or `LoraBank`s (or the adapters from
        `split`).

    Returns:
      The total size of the factors (a bank's as stored, padding included).
    """

    def is_leaf(x: Any) -> bool:
        return isinstance(
            x, (LoraWeight, LoraAdapter, LoraBank, DoraWeight, DoraAdapter)
        )

    found = jax.tree_util.tree_leaves(params, is_leaf=is_leaf)
    return sum(
        int(np.size(x.a)) + int(np.size(x.b)) + int(np.size(getattr(x, "m", ())))
        for x in found
        if is_leaf(x)
    )
