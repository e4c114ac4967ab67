"""Everything qax relies on inside JAX, checked on the installed JAX.

`qax/_compat.py` is the only module that reaches into JAX's private modules, frames and
primitive parameter layouts. Each test here names the `_compat` function (or table) to
fix when JAX moves what it relies on, so that a JAX upgrade fails here first, with that
name, rather than deep inside a rule.
"""

import ast
import importlib
import inspect
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qax
from qax import _compat, _dispatch

PACKAGE = pathlib.Path(qax.__file__).parent


def _fix(name: str) -> str:
    return f"JAX moved what `qax._compat.{name}` relies on: update it (JAX {jax.__version__})"


# -- the private surface stays in one module -----------------------------------------------


_PRIVATE_MODULES = ("jax._src", "jaxlib.", "jax.extend", "jax.core")
# Private attributes of JAX objects, and the locals of frames (JAX's, in practice: qax's
# own frame walks only read file names and line numbers).
_PRIVATE_ATTRIBUTES = {"_trace", "_weakref", "_src", "f_locals"}


def _private_uses(path: pathlib.Path) -> list[str]:
    """Imports of JAX's private (or extension) modules, reads of private attributes of
    JAX objects and of frames' local variables, in one file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith(_PRIVATE_MODULES):
                found.append(f"{path.name}:{node.lineno} from {node.module}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(_PRIVATE_MODULES):
                    found.append(f"{path.name}:{node.lineno} import {alias.name}")
        elif isinstance(node, ast.Attribute) and node.attr in _PRIVATE_ATTRIBUTES:
            found.append(f"{path.name}:{node.lineno} .{node.attr}")
        elif isinstance(node, ast.Attribute) and node.attr in ("extend", "core"):
            if isinstance(node.value, ast.Name) and node.value.id == "jax":
                found.append(f"{path.name}:{node.lineno} jax.{node.attr}")
    return found


def test_only_compat_touches_jax_internals():
    uses = [
        use
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "_compat.py"
        for use in _private_uses(path)
    ]
    assert uses == [], "route these through qax/_compat.py: " + ", ".join(uses)


def test_builtin_types_use_no_private_jax_module():
    """`qax.lora`, `qax.quant`, `qax.qat`, `qax.symbols` are the examples users copy."""
    paths = [PACKAGE / "symbols.py"]
    for package in ("lora", "quant", "qat"):
        found = sorted((PACKAGE / package).glob("*.py"))
        assert found, f"qax/{package}/ has no modules: update this test's list"
        paths += found
    for path in paths:
        assert _private_uses(path) == [], f"{path.parent.name}/{path.name}"


def test_no_version_string_checks_outside_compat():
    """Differences between JAX versions are found by feature, in `_compat` alone."""
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        assert "jax.__version__" not in text and "__version_info__" not in text, path


# -- names ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "Trace",
        "Tracer",
        "ShapedArray",
        "TraceTag",
        "Primitive",
        "ClosedJaxpr",
        "Jaxpr",
        "DebugInfo",
        "set_current_trace",
        "jaxpr_as_fun",
        "eval_jaxpr",
        "ensure_no_leaks",
        "EvalTrace",
        "trace_to_jaxpr_dynamic",
        "convert_constvars_jaxpr",
        "wrap_init",
        "primitive_jvps",
        "primitive_batchers",
        "instantiate_zeros",
        "Zero",
        "SymbolicZero",
        "mapped_aval",
        "separate_consts",
        "api_boundary",
        "shard_map_p",
        "ragged_dot_general_p",
        "unlisted_primitives",
        "UNSPECIFIED",
        "ArrayImpl",
        "flatten_ft",
    ],
)
def test_names_resolve(name):
    assert getattr(_compat, name, None) is not None, _fix(name)


def test_tracer_constructor_takes_trace_and_aval():
    params = list(inspect.signature(_compat.Tracer.__init__).parameters)
    assert params[1:3] == ["trace", "aval"], _fix("init_tracer")


def test_current_trace_is_the_eval_trace_at_top_level():
    assert _compat.is_eval_trace(_compat.current_trace()), _fix("current_trace")
    assert isinstance(_compat.jit_context(), tuple), _fix("jit_context")


def test_flattree_flatten_carries_aux():
    tree = _compat.flatten_ft((1.0, 2.0)).with_aux("aux")
    assert list(tree.vals) == [1.0, 2.0], _fix("flatten_ft")


def test_backward_pass_is_recognized():
    assert _compat._BACKWARD_PASS_CODE, _fix("in_backward_pass")
    phases = []

    @jax.custom_vjp
    def f(x):
        return x * 2.0

    def fwd(x):
        phases.append(("fwd", _compat.in_backward_pass()))
        return f(x), None

    def bwd(_, ct):
        phases.append(("bwd", _compat.in_backward_pass()))
        return (ct * 2.0,)

    f.defvjp(fwd, bwd)
    jax.grad(f)(1.0)
    assert phases == [("fwd", False), ("bwd", True)], _fix("in_backward_pass")


def test_jnp_modules_that_ask_for_jax_array_exist():
    for module_name in (_compat._JNP_ARRAYLIKE_CHECK, _compat._JNP_CONSTRUCTORS):
        assert module_name in sys.modules or importlib.import_module(module_name), _fix(
            "jax_array_asker"
        )
    check = importlib.import_module(_compat._JNP_ARRAYLIKE_CHECK).check_arraylike
    assert "fun_name" in inspect.signature(check).parameters, _fix("jax_array_asker")


def test_jnp_asks_implicit_arrays_through_the_expected_modules():
    """What `jax_array_asker` tells apart, seen from a real implicit array."""
    zeros = qax.symbols.SymbolicConstant(0.0, shape=(2,), dtype=jnp.float32)
    with pytest.raises(TypeError, match=r"jnp\.sin"):
        jnp.sin(zeros)
    with pytest.warns(qax.MaterializationWarning):
        dense = jnp.asarray(zeros)
    np.testing.assert_array_equal(dense, np.zeros(2, np.float32))


def test_export_registries_have_the_expected_layout():
    from jax._src.export import _export

    assert isinstance(_export.serialization_registry, dict), _fix(
        "forget_export_serialization"
    )
    assert isinstance(_export.deserialization_registry, dict), _fix(
        "forget_export_serialization"
    )


def test_manual_axis_type_fields():
    mat = getattr(jax.typeof(jnp.ones(2)), "manual_axis_type", None)
    if mat is None:
        pytest.skip("this JAX has no manual axis types")
    for field in ("varying", "unreduced", "reduced"):
        assert hasattr(mat, field), _fix("varying_aval")


# -- parameter layouts ---------------------------------------------------------------------


def _eqn_params(fn, *args) -> dict:
    """The params of every equation of `fn`'s jaxpr (nested ones too), by primitive."""
    found: dict = {}

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            found.setdefault(eqn.primitive.name, eqn.params)
            for value in eqn.params.values():
                for sub in value if isinstance(value, tuple) else (value,):
                    inner = getattr(sub, "jaxpr", None)
                    if inner is not None and hasattr(inner, "eqns"):
                        walk(inner)
                    elif hasattr(sub, "eqns"):
                        walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def _program(x):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    y = jax.jit(lambda v: v * 2.0)(x)
    y = jax.lax.cond(y[0] > 0, jnp.sin, jnp.cos, y)
    y, _ = jax.lax.scan(lambda c, r: (c + r, c), y, jnp.stack([y, y]))
    y = jax.lax.while_loop(lambda c: c[0] < 10.0, lambda c: c + 1.0, y)
    y = jax.checkpoint(jnp.tanh)(y)
    y = jax.lax.with_sharding_constraint(y, sharding)
    return jax.device_put(y, sharding)


def test_parameter_layouts_hold():
    found = _eqn_params(_program, jnp.ones(3))
    for primitive, names in _compat.PARAM_LAYOUTS.items():
        if primitive == "shard_map":
            continue  # checked below, on a mesh
        assert primitive in found, f"no `{primitive}` equation: {_fix('PARAM_LAYOUTS')}"
        missing = names - set(found[primitive])
        assert not missing, f"`{primitive}` lacks {sorted(missing)}: " + _fix(
            "PARAM_LAYOUTS"
        )


def test_shard_map_parameter_layout():
    from jax.sharding import PartitionSpec as P

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
    f = jax.shard_map(lambda v: v * 2.0, mesh=mesh, in_specs=P("d"), out_specs=P("d"))
    found = _eqn_params(f, jnp.ones(4))
    assert _compat.PARAM_LAYOUTS["shard_map"] <= set(found["shard_map"]), _fix(
        "PARAM_LAYOUTS"
    )


def test_scan_operand_counts():
    def f(c, xs):
        k = jnp.ones(3) * 2.0  # a constant of the body

        def body(carry, x):
            a, b = carry
            return (a + x * k, b * 2.0), a

        return jax.lax.scan(body, (c, c), xs)

    params = _eqn_params(f, jnp.ones(3), jnp.ones((4, 3)))["scan"]
    n_consts, n_carry = _compat.scan_operand_counts(params)
    assert n_carry == 2, _fix("scan_operand_counts")
    assert n_consts == len(params["jaxpr"].in_avals) - 3, _fix("scan_operand_counts")


def test_inline_flag_tells_jnp_wrappers_from_user_jits(monkeypatch):
    """The `jit` binds that reach qax's rule: `jnp.sin` is inline, a user's jit not."""

    jit_p = _compat.primitives_module.jit_p
    rule = _dispatch.primitive_rules[jit_p]
    seen = []

    def spy(trace, primitive, vals, params):
        seen.append(_compat.is_inline_jit(params))
        return rule(trace, primitive, vals, params)

    monkeypatch.setitem(_dispatch.primitive_rules, jit_p, spy)
    c = qax.symbols.SymbolicConstant(1.0, shape=(2,), dtype=jnp.float32)
    qax.use_implicit_args(jnp.sin)(c)
    assert seen == [True], _fix("is_inline_jit")
    qax.use_implicit_args(jax.jit(lambda v: v * 3.0))(c)
    assert seen == [True, False], _fix("is_inline_jit")


def test_plain_jit_params_are_default():
    params = _eqn_params(lambda x: jax.jit(lambda v: v + 1.0)(x), jnp.ones(2))["jit"]
    assert _compat.jit_params_are_default(params), _fix("jit_params_are_default")
    donated = _eqn_params(
        lambda x: jax.jit(lambda v: v + 1.0, donate_argnums=0)(x), jnp.ones(2)
    )["jit"]
    assert not _compat.jit_params_are_default(donated), _fix("jit_params_are_default")


def test_call_primitives():
    prims = _compat.primitives_module
    assert _compat.CALL_JAXPR_P is not None or _compat.CALL_PRIMITIVES, _fix(
        "CALL_PRIMITIVES"
    )
    for p in (prims.call_p, prims.closed_call_p):
        assert p is _compat.CALL_JAXPR_P or p in _compat.CALL_PRIMITIVES, _fix(
            "CALL_PRIMITIVES"
        )


def test_custom_vjp_backward_protocol():
    """Cotangents of a two-input `custom_vjp` called inside `use_implicit_args` go to
    their own inputs (a misread bwd result would swap or drop them)."""

    @jax.custom_vjp
    def f(x, y):
        return x * y

    f.defvjp(lambda x, y: (f(x, y), None), lambda _, ct: (ct * 5.0, ct * 7.0))
    c = qax.symbols.SymbolicConstant(2.0, shape=(), dtype=jnp.float32)
    grads = jax.grad(qax.use_implicit_args(lambda x, y, c: f(x, y) + c), (0, 1))
    gx, gy = grads(1.0, 1.0, c)
    assert (float(gx), float(gy)) == (5.0, 7.0), _fix("split_bwd_result")


def test_weakly_typed():
    x = _compat.weakly_typed(jnp.ones(2, jnp.float32))
    assert jax.typeof(x).weak_type and x.dtype == jnp.float32, _fix("weakly_typed")


def test_shardy_barrier_and_varying_axes_helpers():
    # the Shardy dialect's barrier (qax._arrival), and the shard_map internals that
    # the all_gather rule reads
    assert hasattr(_compat._sdy, "propagation_barrier"), _fix("propagation_barrier")
    assert hasattr(_compat._sdy.PropagationDirection, "NONE"), _fix(
        "propagation_barrier"
    )
    assert hasattr(_compat._config, "use_shardy_partitioner"), _fix(
        "propagation_barrier"
    )
    assert _compat.tracks_varying_axes() is False, _fix("tracks_varying_axes")
    assert callable(_compat._parallel.insert_collective_pvary), _fix(
        "insert_collective_pvary"
    )
    x = jnp.ones(3)
    assert _compat.insert_collective_pvary(("i",), x) is x  # outside shard_map


def test_frame_variable_reads_a_closure_variable():
    # `qax.nnx` reads `allow_int`, a closure variable of Flax's `nnx.grad` wrapper.

    def outer(allow_int):
        def wrapper():
            assert allow_int in (False, True)  # a closure variable of this frame
            return sys._getframe(0)

        return wrapper

    assert _compat.frame_variable(outer(False)(), "allow_int") is False
    assert _compat.frame_variable(outer(True)(), "allow_int") is True
    assert _compat.frame_variable(outer(True)(), "missing") is None
