"""The how-to notebook runs top to bottom, and its saved outputs come from such a run."""

import json
import os
import pathlib
import shutil
import sys

import nbformat
import pytest
from nbclient import NotebookClient

# Whole models and documents on qax's machinery: no leak checking (tests/conftest.py).
pytestmark = pytest.mark.no_leak_check

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "How_to_Qax.ipynb"


def _code_cells(nb):
    return [cell for cell in nb.cells if cell.cell_type == "code"]


def _kernel_for_this_python(tmp_path, monkeypatch) -> str:
    """A kernel spec that runs this interpreter (not whatever `python` is on PATH)."""
    spec = tmp_path / "jupyter" / "kernels" / "qax-tests"
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    kernel = {"argv": argv, "display_name": "qax tests", "language": "python"}
    (spec / "kernel.json").write_text(json.dumps(kernel))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    # The kernel imports qax from this checkout, installed or not.
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    monkeypatch.setenv("PYTHONPATH", path)
    return "qax-tests"


def test_notebook_runs_top_to_bottom(tmp_path, monkeypatch):
    # Nothing but the notebook file, in a directory of its own: it must not need the
    # repository's layout or a particular working directory.
    work = tmp_path / "anywhere"
    work.mkdir()
    shutil.copy(NOTEBOOK, work / NOTEBOOK.name)
    kernel_name = _kernel_for_this_python(tmp_path, monkeypatch)
    nb = nbformat.read(work / NOTEBOOK.name, as_version=4)
    for cell in _code_cells(nb):
        cell.outputs = []
    client = NotebookClient(
        nb,
        timeout=300,
        kernel_name=kernel_name,
        resources={"metadata": {"path": str(work)}},
    )
    client.execute()  # raises CellExecutionError, naming the cell, if any cell fails

    for index, cell in enumerate(_code_cells(nb)):
        for output in cell.outputs:
            text = output.get("text", "")
            # Materializations the notebook expects are caught and printed on stdout;
            # one on stderr is a MaterializationWarning nobody asked for.
            assert not (output.get("name") == "stderr" and "Materialization" in text), (
                f"code cell {index} warned unexpectedly:\n{text}"
            )
    outputs = "\n".join(
        o.get("text", "") for cell in _code_cells(nb) for o in cell.outputs
    )
    assert "the model now answers: 'Some output'" in outputs
    assert "every W bitwise unchanged: True | every B trained: True" in outputs


def test_saved_notebook_shows_a_complete_run():
    """The committed notebook reads well on GitHub: every code cell ran, in order."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    cells = _code_cells(nb)
    counts = [cell.execution_count for cell in cells]
    assert counts == list(range(1, len(cells) + 1)), counts
    errors = [o for cell in cells for o in cell.outputs if o.output_type == "error"]
    assert not errors, errors
    silent = [
        i
        for i, cell in enumerate(cells)
        if "print(" in cell.source and not cell.outputs
    ]
    assert not silent, f"code cells {silent} print but have no saved output"
    first = nb.cells[0].source
    assert "Colab" in first and "QAX_SOURCE" in first


def test_notebook_stands_alone():
    """No placeholder URLs, no files beside the notebook, no working directory."""
    text = NOTEBOOK.read_text()
    assert "OWNER" not in text
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = "\n".join(cell.source for cell in _code_cells(nb))
    lines = [line.strip() for line in code.splitlines()]
    assert not any(line.startswith(("import models", "from models")) for line in lines)
    assert "from qax.examples import models" in code
    for needs_a_directory in ("os.chdir", "open(", "pathlib", "git clone"):
        assert needs_a_directory not in code, needs_a_directory
