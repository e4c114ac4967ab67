"""MkDocs hooks: pages generated from files kept elsewhere in the repository.

- ``how-to.md``: ``notebooks/How_to_Qax.ipynb`` with its saved outputs (markdown cells as
  they are, code cells as Python blocks, text outputs as plain blocks, images inline);
- ``benchmarks.md``: ``benchmarks/README.md``;

and, in ``guides/many-adapters.md``, the plot of ``benchmarks/results/bench_banks.json``
(step time against the number of distinct adapters) in place of its placeholder, as an
inline SVG drawn here (no plotting library needed); in ``guides/lora-qlora.md``, the
composition matrix, from the parameters of ``tests/test_composition.py`` (the page
lists exactly the cells that test runs); in ``architecture.md``, the steps of a
primitive's route through the interpreter, from ``qax/_route.py`` (where
``apply_primitive`` and ``qax.explain`` read them).
"""

from __future__ import annotations

import html
import json
import math
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


# ----------------------------------------------------------------------------------------
# The plot of benchmarks/bench_banks.py's results

BANKS_JSON = ROOT / "benchmarks" / "results" / "bench_banks.json"
BANKS_PLACEHOLDER = "<!-- bench_banks: plot -->"
# (variant, colour, dash pattern)
BANKS_LINES = (
    ("qax bank", "#1f77b4", ""),
    ("hand gather", "#7f7f7f", "4 3"),
    ("per-adapter loop", "#d62728", ""),
    ("one adapter", "#2ca02c", "2 2"),
)


def _banks_panel(phase: dict, title: str, x0: float, width: float, height: float):
    """One panel's SVG elements: step time (log scale) against distinct adapters."""
    left, right, top, bottom = x0 + 52, x0 + width - 10, 28, height - 40
    distinct = phase["distinct"]
    series = {
        name: [1e3 * t for t in phase["median_s"][name]]
        for name, _, _ in BANKS_LINES
        if name in phase["median_s"]
    }
    values = [v for ys in series.values() for v in ys]
    lo = 10 ** math.floor(math.log10(min(values)))
    hi = 10 ** math.ceil(math.log10(max(values)))

    def x_at(k):
        span = math.log2(max(distinct)) or 1.0
        return left + (right - left) * math.log2(k) / span

    def y_at(ms):
        return bottom - (bottom - top) * math.log10(ms / lo) / math.log10(hi / lo)

    parts = [
        f'<text x="{(left + right) / 2:.0f}" y="16" text-anchor="middle" '
        f'font-weight="bold">{html.escape(title)}</text>',
        f'<line x1="{left}" y1="{bottom}" x2="{right}" y2="{bottom}" stroke="#444"/>',
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{bottom}" stroke="#444"/>',
    ]
    decade = lo
    while decade <= hi * 1.0001:
        y = y_at(decade)
        label = f"{decade:g} ms" if decade >= 1 else f"{decade * 1e3:g} us"
        parts.append(
            f'<line x1="{left}" y1="{y:.1f}" x2="{right}" y2="{y:.1f}" '
            'stroke="#ddd"/>'
            f'<text x="{left - 4}" y="{y + 4:.1f}" text-anchor="end">{label}</text>'
        )
        decade *= 10
    for k in distinct:
        x = x_at(k)
        parts.append(
            f'<text x="{x:.1f}" y="{bottom + 16}" text-anchor="middle">{k}</text>'
        )
    parts.append(
        f'<text x="{(left + right) / 2:.0f}" y="{bottom + 32}" '
        'text-anchor="middle">distinct adapters in the batch</text>'
    )
    for name, colour, dash in BANKS_LINES:
        if name not in series:
            continue
        points = " ".join(
            f"{x_at(k):.1f},{y_at(ms):.1f}"
            for k, ms in zip(distinct, series[name], strict=True)
        )
        dashed = f' stroke-dasharray="{dash}"' if dash else ""
        parts.append(
            f'<polyline points="{points}" fill="none" stroke="{colour}" '
            f'stroke-width="2"{dashed}/>'
        )
        for k, ms in zip(distinct, series[name], strict=True):
            parts.append(
                f'<circle cx="{x_at(k):.1f}" cy="{y_at(ms):.1f}" r="3" '
                f'fill="{colour}"><title>{html.escape(name)}, {k} distinct: '
                f"{ms:.3g} ms</title></circle>"
            )
    return parts


def _banks_plot(path: pathlib.Path = BANKS_JSON) -> str:
    """An inline SVG of the newest run in `path` (decode and prefill side by side)."""
    if not path.exists():
        return (
            "*(No saved results: run `PYTHONPATH=. python benchmarks/bench_banks.py` "
            "to write `benchmarks/results/bench_banks.json`.)*"
        )
    runs = json.loads(path.read_text())["runs"]
    label, run = next(iter(runs.items()))
    width, height, legend = 340, 250, 24
    parts = []
    for i, phase in enumerate(("decode", "prefill")):
        seq = run[phase]["seq"]
        title = f"{phase}: batch {run['batch']} x {seq} token{'s' * (seq > 1)}"
        parts += _banks_panel(run[phase], title, i * width, width, height)
    x = 10
    for name, colour, dash in BANKS_LINES:
        dashed = f' stroke-dasharray="{dash}"' if dash else ""
        parts.append(
            f'<line x1="{x}" y1="{height + 10}" x2="{x + 24}" y2="{height + 10}" '
            f'stroke="{colour}" stroke-width="2"{dashed}/>'
            f'<text x="{x + 30}" y="{height + 14}">{html.escape(name)}</text>'
        )
        x += 40 + 7 * len(name)
    total_w, total_h = 2 * width, height + legend
    svg = (
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {total_w} {total_h}" '
        f'width="100%" style="max-width:{total_w * 1.3:.0f}px" font-family="sans-serif" '
        f'font-size="11" role="img" aria-label="step time against distinct adapters">'
        + "".join(parts)
        + "</svg>"
    )
    cfg = run["config"]
    caption = (
        f"Step time (log scale) against the number of distinct adapters in a batch of "
        f"{run['batch']}: {cfg['layers']} layers of {cfg['d']} x {cfg['d']}, LoRA rank "
        f"{cfg['rank']}, a bank of {cfg['adapters']} adapters. {html.escape(label)}, "
        f"{run['platform'].upper()} ({run['cpus']} cores); from "
        "<code>benchmarks/results/bench_banks.json</code>, written by "
        f"<code>{html.escape(run['command'])}</code>."
    )
    return f"<figure>{svg}<figcaption>{caption}</figcaption></figure>"


COMPOSITION_PLACEHOLDER = "<!-- test_composition: matrix -->"


def _composition_table() -> str:
    """The matrix `tests/test_composition.py` runs: a row per base format, a column
    per adapter type, in each cell the transformations checked."""
    import importlib.util

    path = ROOT / "tests" / "test_composition.py"
    spec = importlib.util.spec_from_file_location("_qax_composition_matrix", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    pairs, mesh = set(module.PAIRS), set(module.MESH_PAIRS)
    header = "| base format | " + " | ".join(module.ADAPTERS) + " |"
    lines = [header, "|---" * (1 + len(module.ADAPTERS)) + "|"]
    for fmt in module.BASES:
        cells = []
        for kind in module.ADAPTERS:
            ran = [
                t
                for t in module.TRANSFORMS
                if ((kind, fmt) in mesh if t == "mesh" else (kind, fmt) in pairs)
            ]
            cells.append(" ".join(ran) or "-")
        lines.append(f"| {fmt} | " + " | ".join(cells) + " |")
    note = (
        f"\n\nGenerated from `tests/test_composition.py`: {len(pairs)} pairs under "
        f"{', '.join(t for t in module.TRANSFORMS if t != 'mesh')}, and {len(mesh)} "
        "of them on a 2x4 mesh, each against the merged dense model with nothing "
        "materialized (on the newest JAX; the oldest supported JAX runs the formats of "
        "the mesh column)."
    )
    return "\n".join(lines) + note


ROUTE_PLACEHOLDER = "<!-- qax._route: steps -->"


def route_markdown(markdown: str) -> str:
    """`markdown` with the route's placeholder replaced by `qax._route.markdown()`,
    indented as the placeholder is (a list nested in a list item)."""
    from qax import _route

    def steps(match):
        indent = match.group(1)
        return "\n".join(indent + line for line in _route.markdown().splitlines())

    pattern = rf"^( *){re.escape(ROUTE_PLACEHOLDER)}$"
    return re.sub(pattern, steps, markdown, flags=re.MULTILINE)


def on_page_markdown(markdown, page, config, files):
    if ROUTE_PLACEHOLDER in markdown:
        markdown = route_markdown(markdown)
    if BANKS_PLACEHOLDER in markdown:
        markdown = markdown.replace(BANKS_PLACEHOLDER, _banks_plot())
    if COMPOSITION_PLACEHOLDER in markdown:
        markdown = markdown.replace(COMPOSITION_PLACEHOLDER, _composition_table())
    return markdown
