"""The package's import graph between its top-level subpackages and modules, its cycles and its longest modules.

    python tools/import_graph.py            # edges, cycles, longest modules
    python tools/import_graph.py --top 20   # more of the longest modules

Every import counts, in-function ones included (the graph is built by grimp, import-linter's engine).
The layer contract itself is checked by ``lint-imports`` (see ``.importlinter``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

import grimp

PACKAGE = "megatron_tawpipe"


def top_level(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else parts[0]


def subpackage_edges(graph) -> dict:
    edges = defaultdict(set)
    for module in graph.modules:
        for imported in graph.find_modules_directly_imported_by(module):
            a, b = top_level(module), top_level(imported)
            if a != b and a != PACKAGE and b != PACKAGE:
                edges[a].add(b)
    return edges


def strongly_connected(edges: dict) -> list:
    """Tarjan's algorithm; the components of more than one node are the import cycles."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    counter = [0]
    nodes = sorted(set(edges) | {b for bs in edges.values() for b in bs})

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                item = stack.pop()
                on_stack.discard(item)
                component.append(item)
                if item == node:
                    break
            out.append(sorted(component))

    sys.setrecursionlimit(10000)
    for node in nodes:
        if node not in index:
            visit(node)
    return [c for c in out if len(c) > 1]


def longest_modules(root: str, top: int) -> list:
    sizes = []
    for folder, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8") as handle:
                    sizes.append((sum(1 for _ in handle), path))
    return sorted(sizes, reverse=True)[:top]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=10, help="how many of the longest modules to list (default 10)")
    args = parser.parse_args(argv)
    graph = grimp.build_graph(PACKAGE, cache_dir=None)
    edges = subpackage_edges(graph)
    short = lambda name: name[len(PACKAGE) + 1:]  # noqa: E731
    nodes = sorted({top_level(m) for m in graph.modules} - {PACKAGE})
    print(f"{len(nodes)} top-level subpackages and modules of {PACKAGE}; imports between them:")
    for node in nodes:
        targets = ", ".join(short(t) for t in sorted(edges.get(node, ()))) or "-"
        print(f"  {short(node):<22} -> {targets}")
    cycles = strongly_connected(edges)
    print(f"import cycles: {len(cycles)}")
    for cycle in cycles:
        print(f"  {len(cycle)} in one cycle: {', '.join(short(c) for c in cycle)}")
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", PACKAGE)
    print("longest modules (lines):")
    for lines, path in longest_modules(root, args.top):
        print(f"  {lines:5d} {os.path.relpath(path, os.path.join(root, '..'))}")
    return 1 if cycles else 0


if __name__ == "__main__":
    sys.exit(main())
