"""The public surface: every exported name exists and is documented; nothing private leaks."""

import importlib
import inspect

import pytest

import qax

PUBLIC_MODULES = [
    "qax",
    "qax.checkpoint",
    "qax.constants",
    "qax.lora",
    "qax.nnx",
    "qax.quant",
    "qax.qat",
    "qax.sharding",
    "qax.utils",
    "qax.symbols",
    "qax.testing",
]


def _module(name):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError:
        pytest.skip(f"{name} is not part of this build")


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_all_names_exist_and_are_documented(name):
    module = _module(name)
    exported = getattr(module, "__all__", None)
    assert exported, f"{name} must declare __all__"
    for attr in exported:
        assert not attr.startswith("_"), f"{name}.{attr} is private"
        value = getattr(module, attr)
        if (
            inspect.isclass(value)
            or inspect.isfunction(value)
            or inspect.ismodule(value)
        ):
            assert inspect.getdoc(value), f"{name}.{attr} has no docstring"


def test_no_third_party_modules_leak_into_the_namespace():
    for leaked in ("jax", "jnp", "np", "optax", "plum", "warnings"):
        assert not hasattr(qax, leaked), f"qax.{leaked} should not be public"


def test_original_qax_names_are_reachable():
    for name in (
        "ImplicitArray",
        "use_implicit_args",
        "primitive_handler",
        "aux_field",
        "default_handler",
        "ArrayValue",
        "EmptyNode",
        "UninitializedAval",
        "materialize_nested",
        "constants",
    ):
        assert hasattr(qax, name)
