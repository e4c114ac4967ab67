"""The route of a primitive on implicit operands through the interpreter, written once.

`apply_primitive` (`qax/_interpreter.py`) runs the steps of `ROUTE` in this order (each
is marked ``# route: <name>`` in its code); `qax.explain` says which of them act on given
operands and which one decides; docs/architecture.md shows them (`markdown`, through
docs/hooks.py). `tests/test_explain_route.py` checks all three against what runs.
"""

from __future__ import annotations

import dataclasses

__all__ = ["ROUTE", "Step", "markdown", "step"]


@dataclasses.dataclass(frozen=True)
class Step:
    """One step of the route.

    Attributes:
      name: what `qax.explain` reports (``Explanation.route``, ``decides``).
      summary: what the step does, in one sentence.
      decides: whether the step can produce the result (the others prepare operands).
    """

    name: str
    summary: str
    decides: bool = True


ROUTE: tuple[Step, ...] = (
    Step(
        "swap",
        "a commutative binary primitive gets its implicit operand first (unless the "
        "operand's class was created with `commute_ops=False`)",
        decides=False,
    ),
    Step(
        "arrival",
        "in a staged program, a product (`dot_general`, `conv_general_dilated`) passes "
        "the tracer leaves of its implicit operands' stored fields "
        "(`qax.array_field(stored=True)`) through an identity that lets the product "
        "choose their layout (`qax/_arrival.py`)",
        decides=False,
    ),
    Step(
        "handler",
        "the handler registered with `qax.primitive_handler` for the operand types "
        "runs; it may return `NotImplemented` (or `qax.decline(reason)`) to pass. "
        "Skipped for a stack of examples of a type that declares no batch axes",
    ),
    Step(
        "rule",
        "a structural rule (`jit`, `remat`, `cond`, `scan`, `while`, `custom_jvp`, "
        "`custom_vjp`, `shard_map`, ...) runs the primitive's body on the implicit "
        "values, materializing nothing itself",
    ),
    Step(
        "stacked",
        "operands that `vmap` stacked from examples of a type that declares no batch "
        "axes are materialized (reported; that type's handlers are written for one "
        "example), and the route starts again on the result",
    ),
    Step(
        "default_handler",
        "`default_handler` of the first implicit operand's class runs, when the class "
        "overrides it; it may return `NotImplemented` to pass",
    ),
    Step(
        "materialize",
        "the implicit operands are materialized (one layer, reported as the "
        "materialization policy says: silently, with a warning, or an error) and the "
        "primitive is bound on the dense arrays",
    ),
)


def step(name: str) -> Step:
    """The step called `name` (a KeyError names the steps there are)."""
    for s in ROUTE:
        if s.name == name:
            return s
    raise KeyError(f"{name!r} is not a step of the route: {[s.name for s in ROUTE]}")


def markdown() -> str:
    """The route as a numbered Markdown list (docs/architecture.md, by docs/hooks.py)."""
    return "\n".join(f"{i}. **{s.name}**: {s.summary}." for i, s in enumerate(ROUTE, 1))
