"""The package's layout rules: layers that import one way (import-linter's contracts in .importlinter), no
import cycle between subpackages, no private name used across packages, no module over 500 lines."""

import ast
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "megatron_tawpipe")
MAX_LINES = 500


def _modules():
    for folder, _, files in os.walk(PACKAGE):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                yield path, dotted[: -len(".__init__")] if dotted.endswith(".__init__") else dotted


def _package_of(dotted: str) -> str:
    """The top-level subpackage (or module) of the package a dotted name belongs to."""
    return ".".join(dotted.split(".")[:2])


def test_import_linter_contracts_are_kept():
    result = subprocess.run(["lint-imports", "--config", os.path.join(ROOT, ".importlinter")], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout, result.stdout[-4000:]


def test_no_import_cycle_between_subpackages():
    result = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "import_graph.py")], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "import cycles: 0" in result.stdout


def _private_uses(tree: ast.AST, own_package: str, module: str):
    """``(line, name)`` of private names this module takes from another subpackage: ``from x import _y``, and
    ``alias._y`` where ``alias`` is a module of another subpackage imported here."""
    foreign_aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.startswith("megatron_tawpipe"):
            other = _package_of(node.module) != own_package
            for alias in node.names:
                if other and alias.name.startswith("_") and not alias.name.startswith("__"):
                    yield node.lineno, f"{node.module}.{alias.name}"
                full = f"{node.module}.{alias.name}"
                if _package_of(full) != own_package:
                    foreign_aliases[alias.asname or alias.name] = full
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("megatron_tawpipe") and alias.asname \
                        and _package_of(alias.name) != own_package:
                    foreign_aliases[alias.asname] = alias.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id in foreign_aliases and node.attr.startswith("_") \
                and not node.attr.startswith("__"):
            yield node.lineno, f"{foreign_aliases[node.value.id]}.{node.attr}"


def test_no_private_name_crosses_a_package():
    found = []
    for path, dotted in _modules():
        with open(path, encoding="utf-8") as handle:
            tree = ast.parse(handle.read(), path)
        for line, name in _private_uses(tree, _package_of(dotted), dotted):
            found.append(f"{os.path.relpath(path, ROOT)}:{line} uses {name}")
    assert not found, "\n".join(found)


def test_the_private_name_check_finds_a_crossing():
    source = "from megatron_tawpipe.runtime.weight_pipe_model import _normalised\n" \
             "from megatron_tawpipe.emulation import compute as c\nc._slept\n"
    found = list(_private_uses(ast.parse(source), "megatron_tawpipe.bench", "megatron_tawpipe.bench.x"))
    assert [name for _, name in found] == ["megatron_tawpipe.runtime.weight_pipe_model._normalised",
                                           "megatron_tawpipe.emulation.compute._slept"]
    inside = list(_private_uses(ast.parse(source), "megatron_tawpipe.runtime", "megatron_tawpipe.runtime.x"))
    assert [name for _, name in inside] == ["megatron_tawpipe.emulation.compute._slept"]   # within runtime: allowed


def test_no_module_is_over_the_line_limit():
    long = []
    for path, _ in _modules():
        with open(path, encoding="utf-8") as handle:
            lines = sum(1 for _ in handle)
        if lines > MAX_LINES:
            long.append(f"{os.path.relpath(path, ROOT)}: {lines} lines")
    assert not long, "\n".join(long)
