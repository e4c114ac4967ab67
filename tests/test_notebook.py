"""The how-to notebook runs top to bottom, and its saved outputs come from such a run."""

import os
import pathlib
import shutil

import jax
import nbformat
import pytest
from nbclient import NotebookClient

import qax
from qax._interpreter import structural_rules

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "How_to_Qax.ipynb"

# Features the notebook demonstrates that other branches provide. Until each has been
# merged, the full run cannot pass (and this is said in the skip reason).
_MISSING = [
    reason
    for present, reason in [
        (
            hasattr(getattr(qax, "utils", None), "freeze_keys"),
            "qax.utils.freeze_keys (section 4)",
        ),
        (hasattr(qax, "symbols"), "qax.symbols (section 6.2)"),
        (hasattr(qax, "materialization_audit"), "qax.materialization_audit (6.3)"),
        (
            all(p in structural_rules for p in (jax.lax.scan_p, jax.lax.while_p)),
            "scan/while_loop over implicit arrays (6.1)",
        ),
    ]
    if not present
]


needs_all_features = pytest.mark.skipif(
    bool(_MISSING), reason=f"not merged yet: {', '.join(_MISSING)}"
)


def _code_cells(nb):
    return [cell for cell in nb.cells if cell.cell_type == "code"]


@needs_all_features
def test_notebook_runs_top_to_bottom(tmp_path, monkeypatch):
    for name in (NOTEBOOK.name, "models.py"):
        shutil.copy(NOTEBOOK.parent / name, tmp_path / name)
    # The kernel imports qax from this checkout, installed or not.
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    monkeypatch.setenv("PYTHONPATH", path)
    nb = nbformat.read(tmp_path / NOTEBOOK.name, as_version=4)
    for cell in _code_cells(nb):
        cell.outputs = []
    client = NotebookClient(
        nb,
        timeout=300,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
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


@needs_all_features
def test_saved_notebook_shows_a_complete_run():
    """The committed notebook reads well on GitHub: every code cell ran, in order."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    cells = _code_cells(nb)
    counts = [cell.execution_count for cell in cells]
    assert counts == list(range(1, len(cells) + 1)), counts
    errors = [o for cell in cells for o in cell.outputs if o.output_type == "error"]
    assert not errors, errors
    assert sum(bool(cell.outputs) for cell in cells) >= len(cells) - 2
    first = nb.cells[0].source
    assert "colab-badge.svg" in first and "How_to_Qax.ipynb" in first
