"""The package's layout rules: layers that import one way (import-linter's contracts in .importlinter), no
import cycle between subpackages, no private name used across packages, no module over 500 lines; the
measurement lab (tools/tawpipe_lab) outside the package, and no ``ip``/``tc`` command in what is installed."""

import ast
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "megatron_tawpipe")
LAB = os.path.join(ROOT, "tools", "tawpipe_lab")
MAX_LINES = 500


def _modules(packages=(PACKAGE, LAB)):
    for top in packages:
        for folder, _, files in os.walk(top):
            for name in sorted(files):
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    dotted = os.path.relpath(path, os.path.dirname(top))[:-3].replace(os.sep, ".")
                    yield path, dotted[: -len(".__init__")] if dotted.endswith(".__init__") else dotted


def _package_of(dotted: str) -> str:
    """The top-level subpackage (or module) of the package a dotted name belongs to."""
    return ".".join(dotted.split(".")[:2])


def test_import_linter_contracts_are_kept():
    # The lab is a root package of the contracts (the package must not import it): found with tools/ on the path.
    path = os.pathsep.join(p for p in (os.path.join(ROOT, "tools"), ROOT, os.environ.get("PYTHONPATH")) if p)
    result = subprocess.run(["lint-imports", "--config", os.path.join(ROOT, ".importlinter")], cwd=ROOT,
                            capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=path))
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


NETWORK_TOOLS = ("ip", "tc")
NETWORK_COMMAND = re.compile(r"\b(ip|tc)\s+(-n\s+\S+\s+)?(netns|link|addr|address|route|qdisc|class|filter)\b")


def _network_commands(tree: ast.AST):
    """``(line, code)`` of every ``ip``/``tc`` command a module can run: the program's name as a string of
    its own (``["ip", "netns", ...]``, ``shutil.which("tc")``) or a command line in a string
    (``"tc qdisc ..."``); docstrings aside."""
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body \
                and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant):
            docstrings.add(id(node.body[0].value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings \
                and (node.value in NETWORK_TOOLS or NETWORK_COMMAND.search(node.value)):
            yield node.lineno, node.value[:60]


def test_what_is_installed_runs_no_ip_or_tc():
    """The network emulation is the lab's (tools/tawpipe_lab): no module of the installed package, nor
    pretrain_llama.py, starts ``ip`` or ``tc``."""
    paths = [path for path, _ in _modules((PACKAGE,))] + [os.path.join(ROOT, "pretrain_llama.py")]
    found = []
    for path in paths:
        with open(path, encoding="utf-8") as handle:
            tree = ast.parse(handle.read(), path)
        found += [f"{os.path.relpath(path, ROOT)}:{line}: {code!r}" for line, code in _network_commands(tree)]
    assert not found, "\n".join(found)


def test_the_network_command_check_finds_the_labs():
    for name in ("netns.py", "node_network.py", "emulated_cluster.py"):
        with open(os.path.join(LAB, name), encoding="utf-8") as handle:
            assert list(_network_commands(ast.parse(handle.read()))), name
    source = '"""Runs ip netns exec."""\nrun(["tc", "-n", ns, "qdisc", "del"])\nos.system("ip -n x link set eth0 up")\n'
    assert sorted(line for line, _ in _network_commands(ast.parse(source))) == [2, 3]


def test_the_wheel_holds_the_package_and_not_the_lab():
    """setup.py's packages: megatron_tawpipe and its subpackages, which the lab is not one of."""
    from setuptools import find_packages

    with open(os.path.join(ROOT, "setup.py"), encoding="utf-8") as handle:
        tree = ast.parse(handle.read())
    call = next(node for node in ast.walk(tree) if isinstance(node, ast.Call)
                and getattr(node.func, "id", None) == "find_packages")
    include = ast.literal_eval(next(k.value for k in call.keywords if k.arg == "include"))
    packages = find_packages(ROOT, include=include)
    assert "megatron_tawpipe.bench" in packages
    assert all(p == "megatron_tawpipe" or p.startswith("megatron_tawpipe.") for p in packages), packages
    assert all(dotted.startswith("megatron_tawpipe") for _, dotted in _modules((PACKAGE,)))
