"""The README stays true: its example runs, and its first lines are the two commands."""

import contextlib
import io
import pathlib
import re
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

import qax

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_readme_starts_with_the_two_commands():
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), re.S)
    assert blocks[0].strip() == (
        'python -m pip install -e ".[examples]" && python notebooks/lora_finetune.py'
    )
    assert blocks[1].strip() == (
        'python -m pip install -e ".[test]" && python -m pytest -n 2'
    )
    ci = (README.parent / ".ci" / "run").read_text()
    assert 'pip install -e ".[test]"' in ci and "python -m pytest -q -n 2" in ci


def _python_blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_readme_example_runs_without_materializing():
    code = _python_blocks()[0]
    namespace = {}
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()) as out:
        warnings.simplefilter("error", qax.MaterializationWarning)
        exec(compile(code, str(README), "exec"), namespace)
    # It prints its result and shows that nothing was materialized.
    printed = out.getvalue()
    assert "(4, 8)" in printed and "nothing was materialized" in printed, printed
    w, y = namespace["w"], namespace["y"]
    np.testing.assert_allclose(
        y, jnp.tanh(jnp.ones((4, 8)) @ w.materialize()), rtol=1e-6
    )


def test_readme_integration_examples_run():
    """The "Using qax with NNX / linen / Equinox / orbax" examples, in order."""
    for module in ("flax.nnx", "equinox", "orbax.checkpoint", "flatbuffers"):
        pytest.importorskip(module)
    blocks = _python_blocks()
    assert len(blocks) == 4
    namespace = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error", qax.MaterializationWarning)
        for code in blocks:
            exec(compile(code, str(README), "exec"), namespace)
    ns = namespace
    lora = ns["model"].kernel.get_value()
    assert isinstance(lora, ns["LoraMatrix"]) and np.abs(np.asarray(lora.a)).sum() > 0
    dense = {**ns["params"]}
    dense["layers_0"] = {
        **dense["layers_0"],
        "kernel": dense["layers_0"]["kernel"].materialize(),
    }
    want = ns["mlp"].apply({"params": dense}, jnp.ones((2, 8)))
    np.testing.assert_allclose(ns["y_linen"], want, rtol=1e-5)
    np.testing.assert_allclose(ns["y_exported"], want, rtol=1e-5)
    g = ns["g"].w
    assert g.w is None and g.a.shape == (8, 2) and g.b.shape == (4, 2)
    for key in ("restored", "rebuilt", "state_again"):
        tree = ns[key]
        assert isinstance(tree["params"]["layers_0"]["kernel"], ns["LoraMatrix"]), key
        assert isinstance(tree["zero"], qax.symbols.SymbolicConstant), key
