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

# Whole models and documents on qax's machinery: no leak checking (tests/conftest.py).
pytestmark = pytest.mark.no_leak_check

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


def test_readme_links_resolve():
    """Every relative link of the README names a file of the repository."""
    for target in re.findall(r"\]\(([^)#:]+)\)", README.read_text()):
        assert (README.parent / target).exists(), target
