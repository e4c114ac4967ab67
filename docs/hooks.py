"""MkDocs hooks: pages generated from files kept elsewhere in the repository.

- ``how-to.md``: ``notebooks/How_to_Qax.ipynb`` with its saved outputs (markdown cells as
  they are, code cells as Python blocks, text outputs as plain blocks, images inline);
- ``benchmarks.md``: ``benchmarks/README.md``.
"""

from __future__ import annotations

import pathlib
import re

import nbformat
from mkdocs.structure.files import File

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _notebook_markdown(path: pathlib.Path) -> str:
    notebook = nbformat.read(path, as_version=4)
    parts = [
        "<!-- Generated from notebooks/How_to_Qax.ipynb by docs/hooks.py. -->\n",
        "The notebook is `notebooks/How_to_Qax.ipynb` in the repository; the test suite "
        "runs it, so what follows is its saved output.\n",
    ]
    for cell in notebook.cells:
        if cell.cell_type == "markdown":
            parts.append(_local_links(cell.source))
        elif cell.cell_type == "code":
            parts.append(f"```py\n{cell.source}\n```")
            for output in cell.get("outputs", []):
                parts.extend(_output_markdown(output))
    return "\n\n".join(parts) + "\n"


def _local_links(markdown: str) -> str:
    """Links to files beside the notebook, as their repository paths (not pages here)."""
    return re.sub(
        r"\[([^\]]+)\]\((?![a-z]+://|#)([^)]+)\)", r"\1 (`notebooks/\2`)", markdown
    )


def _output_markdown(output) -> list[str]:
    if output.output_type == "stream":
        return [f"```text\n{output.text.rstrip()}\n```"]
    data = output.get("data", {})
    if "image/png" in data:
        return [f"![output](data:image/png;base64,{data['image/png']})"]
    if "text/plain" in data:
        return [f"```text\n{data['text/plain'].rstrip()}\n```"]
    if output.output_type == "error":
        return [f"```text\n{output.ename}: {output.evalue}\n```"]
    return []


def _benchmarks_markdown(path: pathlib.Path) -> str:
    text = path.read_text()
    return "<!-- Generated from benchmarks/README.md by docs/hooks.py. -->\n\n" + text


def on_files(files, config):
    generated = {
        "how-to.md": _notebook_markdown(ROOT / "notebooks" / "How_to_Qax.ipynb"),
        "benchmarks.md": _benchmarks_markdown(ROOT / "benchmarks" / "README.md"),
    }
    for name, content in generated.items():
        files.append(File.generated(config, name, content=content))
    return files
