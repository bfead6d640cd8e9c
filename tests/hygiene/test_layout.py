"""The package layout keeps its rules: no module reaches into another's private names (a private
name may change with its module alone), no import circle, and no module is named like a
standard-library one."""

from __future__ import annotations

import ast
import sys
import textwrap
from pathlib import Path


PACKAGE = Path(__file__).resolve().parents[2] / "pallas_cache"


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _is_module(dotted: str, root: Path) -> bool:
    rel = Path(*dotted.split(".")[1:]) if "." in dotted else Path()
    target = root / rel
    return target.with_suffix(".py").is_file() or (target / "__init__.py").is_file()


def private_imports(source: str, module: str, root: Path, is_package: bool = False) -> list[str]:
    """Every cross-module use of a ``_private`` name of the package in ``source``: ``from m import
    _x`` and ``m._x`` on a name bound to a package module by an import."""
    top = root.name
    found, module_aliases = [], {}
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source_module = _resolve(node, module, is_package)
            if source_module.split(".")[0] != top or source_module == module:
                continue
            for alias in node.names:
                if _is_private(alias.name):
                    found.append(f"{module}: from {source_module} import {alias.name}")
                elif _is_module(f"{source_module}.{alias.name}", root):
                    module_aliases[alias.asname or alias.name] = f"{source_module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == top:
                    module_aliases[alias.asname or alias.name] = alias.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and _is_private(node.attr)
                and isinstance(node.value, ast.Name) and node.value.id in module_aliases
                and module_aliases[node.value.id] != module):
            found.append(f"{module}:{node.lineno}: {module_aliases[node.value.id]}.{node.attr}")
    return found


def package_modules(root: Path = PACKAGE):
    for path in sorted(root.rglob("*.py")):
        yield path, _module_name(path, root)


def test_no_cross_module_private_import():
    """FAILS if a package module imports another module's ``_private`` name (``from m import _x``)
    or reads one as an attribute (``m._x``)."""
    found = []
    for path, module in package_modules():
        found += private_imports(path.read_text(), module, PACKAGE, path.name == "__init__.py")
    assert not found, "\n".join(found)


def test_private_import_checker_catches_each_form(tmp_path):
    """FAILS if the checker above misses one of the forms it exists to reject (it would then pass
    on any package)."""
    root = tmp_path / "pallas_cache"
    (root / "kernels").mkdir(parents=True)
    for name in ("__init__.py", "ops.py", "kernels/__init__.py", "kernels/step.py"):
        (root / name).write_text("")
    source = textwrap.dedent("""
        from pallas_cache.ops import _ensure, ensure
        from .step import _pad_to
        from pallas_cache.kernels import step
        import pallas_cache.ops as core
        x = step._num_warps(3) + core._Rules + step.__name__ + step.public
        from pallas_cache.ops import __all__
    """)
    found = private_imports(source, "pallas_cache.kernels.dispatch", root)
    assert len(found) == 4, found
    assert private_imports("def _own(): pass\n_own()\n", "pallas_cache.ops", root) == []


def _stdlib_named():
    return sorted(module for path, module in package_modules()
                  if module.rsplit(".", 1)[-1] in sys.stdlib_module_names)


def test_no_module_named_like_the_stdlib():
    """FAILS if a package module is named like a standard-library module (``inspect``, ``types``,
    ``statistics``...), which shadows it for anyone running from inside the folder and misleads
    readers."""
    assert _stdlib_named() == []


def imports_of(source: str, module: str, is_package: bool = False) -> set[str]:
    """The absolute names of the modules ``source`` imports (relative imports resolved)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            base = _resolve(node, module, is_package)
            found |= {base} | {f"{base}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return found


def _reaches_reference(names) -> bool:
    return any(name == "pallas_cache.reference" or name.startswith("pallas_cache.reference.")
               for name in names)


#: The modules that hold the library to the reference: the users' testing kit, never the core.
REFERENCE_USERS = ("pallas_cache.testing.lockstep",)


def test_only_the_reference_imports_the_reference_and_it_imports_no_jax():
    """FAILS if a library module imports ``pallas_cache.reference`` (the oracle would then share
    code, and so mistakes, with what it checks) other than the testing kit's lockstep check, or
    if the reference imports JAX or the library (the rules are stated there once, in NumPy)."""
    found = []
    for path, module in package_modules():
        names = imports_of(path.read_text(), module, path.name == "__init__.py")
        if module.startswith("pallas_cache.reference"):
            found += [f"{module}: {n}" for n in sorted(names)
                      if n.split(".")[0] == "jax" or (n.startswith("pallas_cache")
                                                      and not _reaches_reference([n]))]
        elif _reaches_reference(names) and module not in REFERENCE_USERS:
            found.append(f"{module} imports the reference")
    assert not found, "\n".join(found)
    assert _reaches_reference(imports_of("from pallas_cache import reference\n", "x"))
    assert _reaches_reference(imports_of("from ..reference import ops\n", "pallas_cache.kernels.step"))


def module_imports(source: str, module: str, root: Path, is_package: bool = False) -> set[str]:
    """The package modules ``source`` imports, at any depth (an import inside a function
    included): ``from p import m`` names the module ``p.m`` where one exists, else ``p``."""
    top = root.name
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            source_module = _resolve(node, module, is_package)
            if source_module.split(".")[0] != top:
                continue
            for alias in node.names:
                dotted = f"{source_module}.{alias.name}"
                found.add(dotted if _is_module(dotted, root) else source_module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == top)
    found.discard(module)
    return found


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected sets of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            members = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                members.append(member)
                if member == node:
                    break
            if len(members) > 1:
                circles.append(sorted(members))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


def test_no_import_circle_between_package_modules():
    """No module of the package imports, directly or through others, a module that imports it,
    an import inside a function included (a lazy import still ties the two modules).
    FAILS if, for one, reprs.py imports the record classes it formats while they import it."""
    graph = {module: module_imports(path.read_text(), module, PACKAGE, path.name == "__init__.py")
             for path, module in package_modules()}
    assert import_circles(graph) == []


def test_the_circle_checker_sees_a_lazy_import(tmp_path):
    root = tmp_path / "pkg"
    root.mkdir()
    sources = {"__init__": "", "a": "from pkg import b\n",
               "b": "def f():\n    from pkg.a import x\n", "c": "import pkg.a\n"}
    for name, source in sources.items():
        (root / f"{name}.py").write_text(source)
    graph = {f"pkg.{name}": module_imports(source, f"pkg.{name}", root)
             for name, source in sources.items() if name != "__init__"}
    assert graph == {"pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}, "pkg.c": {"pkg.a"}}
    assert import_circles(graph) == [["pkg.a", "pkg.b"]]


# A module longer than this holds more than one thing to read: split it by what each part is
# (docs/design.md, "Layout").
MAX_MODULE_LINES = 600


def _long_modules() -> dict[str, int]:
    return {module: count for path, module in package_modules()
            if (count := len(path.read_text().splitlines())) > MAX_MODULE_LINES}


def test_no_package_module_over_the_line_limit():
    """FAILS if a package module is over ``MAX_MODULE_LINES`` lines (the fused kernel in one
    ``kernels/step.py`` was 825, the decode bench in one ``sizing/decode.py`` 685)."""
    assert _long_modules() == {}
