"""The documentation site (`docs/`, `mkdocs.yml`): its examples run, its API pages cover
every public name, and every public name has a docstring.

Each page's ```python blocks run in order in one fresh namespace, with
`qax.MaterializationWarning` as an error (```py blocks are shown, not run). The site
itself is built in strict mode by `.ci/run` (`pip install -e ".[docs]"`), where broken
links and docstrings that do not parse fail the build.
"""

from __future__ import annotations

import importlib
import inspect
import pathlib
import re
import warnings

import pytest

import qax

# Whole models and documents on qax's machinery: no leak checking (tests/conftest.py).
pytestmark = pytest.mark.no_leak_check

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
# Pages whose code only illustrates (the architecture notes) or is run elsewhere.
NOT_RUN = {"architecture.md"}
PAGES = sorted(
    p.relative_to(DOCS).as_posix()
    for p in DOCS.rglob("*.md")
    if p.relative_to(DOCS).as_posix() not in NOT_RUN
)
PUBLIC_MODULES = (
    "qax",
    "qax.lora",
    "qax.quant",
    "qax.qat",
    "qax.symbols",
    "qax.utils",
    "qax.sharding",
    "qax.nnx",
    "qax.checkpoint",
    "qax.testing",
    "qax.constants",
)


def _python_blocks(page: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", (DOCS / page).read_text(), re.S | re.M)


@pytest.mark.parametrize("page", [p for p in PAGES if _python_blocks(p)])
def test_page_examples_run(page):
    namespace: dict = {"__name__": "docs_" + re.sub(r"\W", "_", page[:-3])}
    with warnings.catch_warnings():
        warnings.simplefilter("error", qax.MaterializationWarning)
        for i, code in enumerate(_python_blocks(page)):
            exec(
                compile(
                    code, f"{DOCS / page} (block {i + 1})", "exec", dont_inherit=True
                ),
                namespace,
            )


def _public_names(module_name: str) -> list[tuple[str, object]]:
    module = importlib.import_module(module_name)
    return [(name, getattr(module, name)) for name in module.__all__]


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_public_names_have_docstrings(module_name):
    # (Type aliases such as `qax.ArrayValue` carry their docstring in the source, where
    # the API reference reads it.)
    module = importlib.import_module(module_name)
    assert inspect.getdoc(module), f"{module_name} has no module docstring"
    missing = [
        f"{module_name}.{name}"
        for name, obj in _public_names(module_name)
        if (inspect.isclass(obj) or inspect.isroutine(obj))
        and not (obj.__doc__ or "").strip()
    ]
    assert not missing, f"public names without a docstring: {missing}"


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_api_reference_has_a_page_per_module(module_name):
    page = (
        DOCS
        / "api"
        / f"{module_name.removeprefix('qax.') if '.' in module_name else 'qax'}.md"
    )
    assert page.exists(), f"no API page for {module_name}"
    text = page.read_text()
    assert f"::: {module_name}" in text
    if module_name == "qax":  # its members are listed one by one
        modules = {n for n, o in _public_names("qax") if inspect.ismodule(o)}
        listed = set(re.findall(r"^\s+- (\w+)$", text, re.M))
        wanted = {n for n, _ in _public_names("qax")} - modules
        assert wanted <= listed, f"missing from docs/api/qax.md: {wanted - listed}"


def test_navigation_lists_every_page():
    nav = (ROOT / "mkdocs.yml").read_text()
    generated = {"how-to.md", "benchmarks.md"}  # made by docs/hooks.py
    for page in PAGES:
        assert page in nav, f"{page} is not in mkdocs.yml's nav"
    for page in re.findall(r":\s+([\w/.-]+\.md)$", nav, re.M):
        assert page in generated or (DOCS / page).exists(), f"nav names missing {page}"
