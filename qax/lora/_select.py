"""Which weights the default filter takes, decided from the tree's structure (biases
beside their kernels), what a selection did (`Plan`), and per-path rules that decide no
weight (`check_rules`). Shared by `qax.lora`, `qax.quant` and `qax.qat`. This module
uses qax's public API only.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import qax

# The last name of a path that holds a layer's kernel, in Flax (`kernel`), Equinox and
# PyTorch (`weight`), Haiku and DeepMind's Griffin (`w`).
_KERNELS = frozenset({"kernel", "weight", "w"})
_NUMBERED_W = re.compile(r"[wW]\d+")
_NUMBERED_B = re.compile(r"[bB]\d+")


def _split_name(path: str) -> tuple[str, str]:
    """``(parent, name)`` of a leaf's path; an NNX state's trailing ``value`` is not
    the name (``"dense/kernel/value"`` -> ``("dense", "kernel")``)."""
    parts = path.split("/")
    if len(parts) > 1 and parts[-1] == "value":
        parts = parts[:-1]
    return "/".join(parts[:-1]), parts[-1]


def _subsequence(small: Sequence[int], big: Sequence[int]) -> bool:
    rest = iter(big)
    return all(any(n == m for m in rest) for n in small)


def _is_bias_of(shape: tuple, kernel: tuple) -> bool:
    """Whether an array of `shape` can be the bias of a kernel of shape `kernel`: its
    size-1 axes aside, fewer axes, the kernel's axes without the contracted ones,
    keeping the output axis: the last (Flax, Haiku: ``(in, out)``; block-diagonal
    ``(blocks, in, out)`` with bias ``(blocks, out)``) or the first (Equinox, PyTorch:
    ``(out, in, ...)`` with bias ``(out,)`` or ``(out, 1, 1)``)."""
    core = tuple(n for n in shape if n != 1)
    if not core or len(core) >= len(kernel):
        return False
    last = core[-1] == kernel[-1] and _subsequence(core[:-1], kernel[:-1])
    first = core[0] == kernel[0] and _subsequence(core[1:], kernel[1:])
    return last or first


def biases(params: Any) -> frozenset[str]:
    """The paths of the biases in a params pytree, found from how the tree is built.

    A leaf is a bias when its name is ``bias`` (Flax, Equinox, PyTorch), or when a
    sibling holds a kernel (named ``kernel``, ``weight`` or ``w``: Flax, Equinox and
    PyTorch, Haiku and DeepMind's Griffin) and the leaf's shape, its size-1 axes
    aside, is the kernel's without the contracted axes (fewer axes, the output axis
    kept: the kernel's last or first): Haiku's and Griffin's
    ``b`` beside ``w`` (and ``b1`` beside ``w1``: an MLP's numbered pairs), a
    block-diagonal layer's ``(blocks, out)`` bias beside its ``(blocks, in, out)``
    kernel, biases stacked beside stacked kernels. A leaf named
    ``b`` without such a kernel beside it (``{"a": ..., "b": ...}``) is not a bias.
    NNX states' trailing ``value`` is skipped. The default selection of
    `loraify`, `qax.quant.quantize` and `qax.qat.fake_quantize` leaves these out.

    Examples:
        >>> qax.lora.biases({"gate": {"w": jnp.ones((2, 4, 4)), "b": jnp.ones((2, 4))}})
        frozenset({'gate/b'})
        >>> sorted(qax.lora.biases({"mlp": {"w1": jnp.ones((2, 4, 8)),
        ...                                 "b1": jnp.ones((2, 8))}}))
        ['mlp/b1']

    Args:
      params: any pytree (implicit arrays are leaves).

    Returns:
      The paths (as `qax.utils.path_string` writes them) of the biases.
    """
    leaves, _ = qax.utils.tree_flatten_with_path_with_implicit(params)
    groups: dict[str, list[tuple[str, str, tuple]]] = {}
    for key, leaf in leaves:
        if hasattr(leaf, "shape"):
            path = qax.utils.path_string(key)
            parent, name = _split_name(path)
            groups.setdefault(parent, []).append((path, name, tuple(leaf.shape)))
    found = set()
    for members in groups.values():
        kernels = [s for _, n, s in members if n.lower() in _KERNELS and len(s) >= 2]
        for path, name, shape in members:
            if name.lower() == "bias":
                found.add(path)
            elif name.lower() not in _KERNELS and any(
                _is_bias_of(shape, k) for k in kernels
            ):
                found.add(path)
        # Numbered pairs (an MLP's ``w1``/``b1``, ``w2``/``b2``): ``bN`` beside ``wN``.
        numbered = {
            n.lower()[1:]: s
            for _, n, s in members
            if _NUMBERED_W.fullmatch(n) and len(s) >= 2
        }
        for path, name, shape in members:
            if _NUMBERED_B.fullmatch(name) and name[1:] in numbered:
                if _is_bias_of(shape, numbered[name[1:]]):
                    found.add(path)
    return frozenset(found)


@dataclasses.dataclass(frozen=True)
class PlanRow:
    """One leaf of a `Plan`: what a selection does to it.

    Attributes:
      path: the leaf's path (``"layers/0/attn/kernel"``).
      shape: its shape.
      dtype: its dtype (a name).
      chosen: whether it is converted.
      why: what decided: ``"default filter"``, ``"filter"`` or ``"rule '...'"`` for a
        chosen leaf; for a skipped one, the reason (``"bias"``, ``"embedding"``,
        ``"normalisation"``, ``"fewer than 2 axes"``, ``"not floating point"``, a
        block size that does not divide it, ``"filter"``, ``"rule '...': None"``...).
      detail: what it becomes (``"rank 8: a (64, 8), b (8, 64)"``,
        ``"NF4Weight, block_size=64"``); ``""`` for a skipped leaf.
    """

    path: str
    shape: tuple
    dtype: str
    chosen: bool
    why: str
    detail: str = ""


@dataclasses.dataclass(frozen=True)
class Plan:
    """What `loraify` or `qax.quant.quantize` would do to each leaf of a tree, as
    `plan` and `qax.quant.plan` return it; ``str(plan)`` is a table to read.

    Attributes:
      caller: the function planned (``"loraify"``, ``"quantize"``).
      rows: one `PlanRow` per leaf with a shape, in the tree's order.
      unmatched: the messages for the rules that decide no weight (see `check_rules`).
    """

    caller: str
    rows: tuple[PlanRow, ...]
    unmatched: tuple[str, ...] = ()

    @property
    def chosen(self) -> tuple[PlanRow, ...]:
        """The rows of the leaves that are converted."""
        return tuple(r for r in self.rows if r.chosen)

    @property
    def skipped(self) -> tuple[PlanRow, ...]:
        """The rows of the leaves left as they are."""
        return tuple(r for r in self.rows if not r.chosen)

    def __str__(self) -> str:
        cells = [
            (
                r.path,
                str(r.shape),
                r.dtype,
                f"{r.detail} ({r.why})" if r.chosen else f"skipped: {r.why}",
            )
            for r in self.rows
        ]
        widths = [max((len(c[i]) for c in cells), default=0) for i in range(3)]
        lines = [
            f"{self.caller} converts {len(self.chosen)} of {len(self.rows)} leaves:"
        ]
        lines += [
            "  " + "  ".join(c[i].ljust(widths[i]) for i in range(3)) + "  " + c[3]
            for c in cells
        ]
        lines += [f"warning: {m}" for m in self.unmatched]
        return "\n".join(lines)


def _pattern(pattern: Any) -> str:
    return pattern.pattern if isinstance(pattern, re.Pattern) else str(pattern)


def _first_rule(rules: Any, path: str) -> str | None:
    """The pattern of the first rule that matches all of ``path`` (``None``: none)."""
    for pattern, _ in rules or ():
        if re.fullmatch(pattern, path):
            return _pattern(pattern)
    return None


_NO_MATCH = (
    "{caller}: the rule {pattern!r} matched no weight. Patterns match whole paths "
    "(re.fullmatch); the closest paths: {closest}.{hint}"
)
_SHADOWED = (
    "{caller}: the rule {pattern!r} decided no weight: every path it matches is "
    "decided by an earlier rule ({earlier}). Put it before them, or remove it."
)


def _hint(text: str, paths: list[str]) -> str:
    """A whole-path pattern for a rule written as a plain part of paths (``""`` for
    a pattern with regular-expression syntax)."""
    if any(c in text for c in ".*+?[](){}|^$\\"):
        return ""
    if any(p.startswith(f"{text}/") for p in paths):
        whole = f"{text}/.*"
    elif any(f"/{text}/" in p for p in paths):
        whole = f".*/{text}/.*"
    else:
        whole = f".*{text}.*"
    return f" Write the whole path, e.g. {whole!r}."


def unmatched_rules(rules: Any, paths: Iterable[str], caller: str) -> tuple[str, ...]:
    """Messages for the rules of a ``rules=`` list that decide no path of ``paths``.

    A rule decides a path when it is the first whose pattern matches all of it (as in
    `loraify`); one that decides none either matches no path (the message names the
    closest paths, by `difflib`) or only paths that earlier rules decide.

    Examples:
        >>> qax.lora.unmatched_rules([("q_einsum", None)], ["attn/q_einsum/w"], "f")
        ("f: the rule 'q_einsum' matched no weight. Patterns match whole paths
        (re.fullmatch); the closest paths: 'attn/q_einsum/w'. Write the whole path,
        e.g. '.*/q_einsum/.*'.",)

    Args:
      rules: ``[(pattern, settings), ...]`` (already checked by
        `qax.utils.path_rules`).
      paths: the paths of the weights.
      caller: the function's name, for the messages.

    Returns:
      One message per rule that decides nothing, in the rules' order.
    """
    paths = list(dict.fromkeys(paths))
    rules = [(re.compile(p), _pattern(p)) for p, _ in rules or ()]
    decided = [False] * len(rules)
    for path in paths:
        for i, (regex, _) in enumerate(rules):
            if regex.fullmatch(path):
                decided[i] = True
                break
    out = []
    for i, (regex, text) in enumerate(rules):
        if decided[i]:
            continue
        hits = [p for p in paths if regex.fullmatch(p)]
        if hits:
            earlier = sorted(
                {t for r, t in rules[:i] if any(r.fullmatch(p) for p in hits)}
            )
            message = _SHADOWED.format(
                caller=caller,
                pattern=text,
                earlier=", ".join(repr(t) for t in earlier),
            )
        else:
            near = [p for p in paths if regex.search(p)] or paths
            closest = difflib.get_close_matches(text, near, n=3, cutoff=0.0)
            message = _NO_MATCH.format(
                caller=caller,
                pattern=text,
                closest=", ".join(repr(p) for p in closest) or "(no weights)",
                hint=_hint(text, paths),
            )
        out.append(message)
    return tuple(out)


def check_rules(
    rules: Any,
    paths: Iterable[str],
    caller: str,
    *,
    strict: bool = False,
    stacklevel: int = 2,
) -> None:
    """Warn about (or, with ``strict``, refuse) the rules that decide no weight.

    `loraify`, `qax.quant.quantize` and `qax.qat.fake_quantize` call it with the
    paths of a tree's weights and their ``strict_rules=``; see `unmatched_rules`.

    Examples:
        >>> rules, paths = [("q_einsum", None)], ["attn/q_einsum/w"]
        >>> try:
        ...     qax.lora.check_rules(rules, paths, "f", strict=True)
        ... except ValueError as error:
        ...     print(error)
        f: the rule 'q_einsum' matched no weight. Patterns match whole paths
        (re.fullmatch); the closest paths: 'attn/q_einsum/w'. Write the whole path,
        e.g. '.*/q_einsum/.*'.

    Args:
      rules: ``[(pattern, settings), ...]``.
      paths: the paths of the weights.
      caller: the function's name, for the messages.
      strict: raise instead of warning.
      stacklevel: as `warnings.warn`'s, counted from the caller of `check_rules`.

    Raises:
      ValueError: ``strict`` and a rule decides no weight.
    """
    messages = unmatched_rules(rules, paths, caller)
    if not messages:
        return
    if strict:
        raise ValueError("\n".join(messages))
    for m in messages:
        warnings.warn(
            f"{m} (strict_rules=True makes this an error.)", stacklevel=stacklevel + 1
        )
