"""The package's layering (docs/architecture.md): read from the source with `ast`.

- the built-in types (`qax.symbols`, `qax.lora`, `qax.quant`) use qax's public API only;
- only `qax/_compat.py` names JAX's private modules;
- the core never imports the built-ins, and the imports have no cycles;
- a module longer than 700 lines says why: the limit is a review trigger, not a rule.
  A long module passes when a line of its module docstring starts with
  ``Why one module:`` and gives the reason splitting it would make it harder to read
  (one concern whose parts are read together, say); the test prints the reasons given,
  for the reviewer to judge.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

import qax

PACKAGE = pathlib.Path(qax.__file__).parent
BUILT_INS = ("symbols", "lora", "quant", "qat")
MAX_LINES = 700


def _modules() -> dict[str, pathlib.Path]:
    """Every module of the package by dotted name (``qax._rules.jit``)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imports(name: str, path: pathlib.Path) -> list[tuple[str, int, list[str]]]:
    """(imported module, line, imported names) for each import of a module, relative
    imports resolved. Imports inside functions count too."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            out.append((base, node.lineno, [a.name for a in node.names]))
    return out


def _private_attributes(path: pathlib.Path) -> list[tuple[int, str]]:
    """``qax._something`` attribute reads in a module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            target = node.value
            chain = []
            while isinstance(target, ast.Attribute):
                chain.append(target.attr)
                target = target.value
            if isinstance(target, ast.Name) and target.id == "qax":
                found.append(
                    (node.lineno, ".".join(["qax", *reversed(chain), node.attr]))
                )
    return found


def _is_built_in(name: str) -> bool:
    return any(name == f"qax.{b}" or name.startswith(f"qax.{b}.") for b in BUILT_INS)


@pytest.mark.parametrize("built_in", BUILT_INS)
def test_built_ins_use_the_public_api_only(built_in):
    modules = {n: p for n, p in _modules().items() if _is_built_in(n)}
    modules = {n: p for n, p in modules.items() if n.split(".")[1] == built_in}
    assert modules, built_in
    bad = []
    for name, path in modules.items():
        for module, line, names in _imports(name, path):
            own = module == f"qax.{built_in}" or module.startswith(f"qax.{built_in}.")
            if own:
                continue  # the built-in's own package (`qax.lora._weight`)
            top = module.split(".")[0]
            private = any(part.startswith("_") for part in module.split(".")[1:])
            if top == "qax" and (private or any(n.startswith("_") for n in names)):
                bad.append(f"{path.name}:{line} imports {module} {names}")
            if module.startswith("jax._src"):
                bad.append(f"{path.name}:{line} imports JAX's private {module}")
        bad += [
            f"{path.name}:{line} reads {attr}"
            for line, attr in _private_attributes(path)
        ]
    assert not bad, "\n".join(bad)


def test_only_compat_imports_jax_private_modules():
    bad = [
        f"{name}:{line} imports {module}"
        for name, path in _modules().items()
        if name != "qax._compat"
        for module, line, _ in _imports(name, path)
        if module.startswith("jax._src") or module == "jaxlib._jax"
    ]
    assert not bad, "\n".join(bad)


def test_the_core_never_imports_the_built_ins():
    # The built-ins, and the glue above them (`qax.utils`, `qax._optax`, the package),
    # may import them; everything else is below them.
    above = {
        "qax",
        "qax._optax",
        "qax._caches",
        "qax.utils",
        "qax.testing",
        "qax.examples",
        "qax.examples.models",
    }
    bad = []
    for name, path in _modules().items():
        if _is_built_in(name) or name in above:
            continue
        for module, line, names in _imports(name, path):
            targets = [module, *(f"{module}.{n}" for n in names)]
            if any(_is_built_in(t) for t in targets):
                bad.append(f"{name}:{line} imports {module} {names}")
    assert not bad, "\n".join(bad)


def test_private_imports_have_no_cycles():
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        edges = set()
        for module, _, names in _imports(name, path):
            # `from . import _staging` is an arrow to the submodule, not its package.
            targets = [f"{module}.{n}" for n in names if f"{module}.{n}" in modules]
            for target in targets or [module]:
                if target in modules and target != name and target != "qax":
                    edges.add(target)
        graph[name] = edges
    # `import qax` from a built-in is the intended arrow back up (see the package's
    # `__init__`: they are imported after the names they use); every other arrow must
    # leave no cycle.
    state: dict[str, int] = {}
    cycle: list[str] = []

    def visit(node: str, stack: list[str]) -> bool:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle.extend([*stack[stack.index(nxt) :], nxt])
                return True
            if state.get(nxt) is None and visit(nxt, [*stack, nxt]):
                return True
        state[node] = 2
        return False

    for node in sorted(graph):
        if state.get(node) is None and visit(node, [node]):
            break
    assert not cycle, " -> ".join(cycle)


WHY_ONE_MODULE = "Why one module:"


def why_one_module(source: str) -> str | None:
    """The reason a module's docstring gives for staying one module past `MAX_LINES`:
    the text after ``Why one module:`` on a line of its own (continued on the lines
    below, up to a blank line), or None if it gives none."""
    doc = ast.get_docstring(ast.parse(source)) or ""
    lines = doc.splitlines()
    for i, line in enumerate(lines):
        if line.strip().startswith(WHY_ONE_MODULE):
            reason = [line.strip()[len(WHY_ONE_MODULE) :]]
            for more in lines[i + 1 :]:
                if not more.strip():
                    break
                reason.append(more.strip())
            return " ".join(" ".join(reason).split()) or None
    return None


def test_why_one_module_reads_the_reason_from_the_docstring():
    reason = "one concern: the rules of a family read together."
    assert (
        why_one_module(
            f'"""Title.\n\n{WHY_ONE_MODULE} one concern:\nthe rules '
            'of a family read together.\n\nMore."""'
        )
        == reason
    )
    assert why_one_module('"""Title.\n\nNo reason here."""\nx = 1') is None
    assert why_one_module(f'"""{WHY_ONE_MODULE}   """') is None  # an empty reason
    assert why_one_module(f'x = 1\n"{WHY_ONE_MODULE} not the docstring"') is None


def test_a_module_longer_than_700_lines_says_why_it_is_one_module():
    """The limit is a review trigger: past it, a module's docstring says why splitting
    it would make it harder to read (see `why_one_module`); the reasons are printed."""
    unexplained, reasons = {}, {}
    for name, path in _modules().items():
        source = path.read_text()
        n = len(source.splitlines())
        if n <= MAX_LINES:
            continue
        reason = why_one_module(source)
        if reason is None:
            unexplained[name] = n
        else:
            reasons[name] = (n, reason)
    for name, (n, reason) in sorted(reasons.items()):
        print(f"{name} ({n} lines): {reason}")
    assert not unexplained, (
        f"{unexplained}: longer than {MAX_LINES} lines, and the module docstring does "
        f"not say why. Split the module by concern, or add a line starting with "
        f"{WHY_ONE_MODULE!r} to its docstring that says why splitting it would make "
        "it harder to read."
    )
