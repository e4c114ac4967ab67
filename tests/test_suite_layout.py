"""The test suite's own rules: support code is imported one way, under one name.

A support module imported both as ``helpers`` and as ``tests.helpers`` would define its
types twice and register their handlers twice in qax's global tables.
"""

import ast
import importlib
import pathlib
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
SUPPORT = sorted(
    p.stem
    for p in HERE.glob("*.py")
    if not p.stem.startswith("test_") and p.stem not in ("__init__", "conftest")
)
TEST_FILES = sorted(HERE.glob("test_*.py"))


def _imported_modules(path):
    """(module, line) for every import in the file at `path`."""
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.module, node.lineno


@pytest.mark.parametrize("path", sorted(HERE.glob("*.py")), ids=lambda p: p.name)
def test_support_code_is_imported_as_tests_dot_name(path):
    local = set(SUPPORT) | {p.stem for p in TEST_FILES}
    wrong = [
        f"{path.name}:{line}: import {name}"
        for name, line in _imported_modules(path)
        if name.split(".")[0] in local
    ]
    assert not wrong, "import support code as `from tests.<module> import ...`"


@pytest.mark.parametrize("path", TEST_FILES, ids=lambda p: p.name)
def test_no_test_module_imports_another(path):
    wrong = [
        f"{path.name}:{line}: import {name}"
        for name, line in _imported_modules(path)
        if name.startswith("tests.test_")
    ]
    assert not wrong, "move what test files share into tests/helpers.py"


def test_each_support_module_is_loaded_under_one_name():
    for name in SUPPORT:
        try:
            importlib.import_module(f"tests.{name}")
        except pytest.skip.Exception:  # the 8-device cases skip themselves on import
            pass
    names_by_file = {}
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if file and pathlib.Path(file).resolve().parent == HERE:
            names_by_file.setdefault(pathlib.Path(file).name, []).append(name)
    twice = {f: sorted(n) for f, n in names_by_file.items() if len(n) > 1}
    assert not twice, f"loaded under two names: {twice}"
