"""The package's shape: which petite_llm modules import which (at the top or inside a function),
any circle among them, and the modules and functions longer than a reader can hold at once.

`python tools/import_graph.py [PACKAGE_DIR]` prints the graph, the circles (none, we hope), the modules over
MAX_MODULE_LINES and the functions over MAX_FUNCTION_LINES; tests/test_imports.py asserts them.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / 'petite_llm'
GENERATED = {'_modidx'}          # nbdev's index of symbols, not code a reader reads
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 450, 60


def module_name(path: Path) -> str:
    """petite_llm/layers/linear.py -> 'layers.linear'."""
    return '.'.join(path.relative_to(PKG).with_suffix('').parts).removesuffix('.__init__')


def modules() -> dict[str, Path]:
    """Every module of the package by name, the generated ones left out."""
    found = {module_name(p): p for p in sorted(PKG.rglob('*.py'))}
    return {name: p for name, p in found.items() if name not in GENERATED}


def imported(path: Path, known: set[str]) -> set[str]:
    """The package's modules that the module at path imports, anywhere in it."""
    here = module_name(path).split('.')
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding='utf-8'))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            # `from .x import y` in petite_llm/a/b.py names petite_llm.a.x
            if node.level:
                base = here[:len(here) - node.level] + ([node.module] if node.module else [])
                stem = '.'.join(['petite_llm'] + base)
            else:
                stem = node.module or ''
            names.add(stem)
            names.update(f'{stem}.{a.name}' for a in node.names)
    found = {n.removeprefix('petite_llm.') for n in names if n.startswith('petite_llm.')}
    return {n for n in found if n in known} - {module_name(path)}


def import_graph() -> dict[str, set[str]]:
    """module -> the modules of the package it imports."""
    mods = modules()
    return {name: imported(path, set(mods)) for name, path in mods.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle, as the path that closes it (depth-first search)."""
    found, state = [], {}

    def visit(node: str, path: list[str]):
        state[node] = 'open'
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 'open':
                found.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 'done'

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def long_modules() -> dict[str, int]:
    """Modules over MAX_MODULE_LINES lines, with their length."""
    lengths = {n: len(p.read_text(encoding='utf-8').splitlines()) for n, p in modules().items()}
    return {n: k for n, k in lengths.items() if k > MAX_MODULE_LINES}


def long_functions() -> dict[str, int]:
    """Functions and methods over MAX_FUNCTION_LINES lines, as module.name -> length."""
    long = {}
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding='utf-8'))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long[f'{name}.{node.name}'] = length
    return long


def main() -> int:
    global PKG
    if len(sys.argv) > 1:
        PKG = Path(sys.argv[1]).resolve()
    graph = import_graph()
    for name, deps in sorted(graph.items()):
        print(f'{name:16s} -> {", ".join(sorted(deps)) or "-"}')
    found = circles(graph)
    print('circles:', found or 'none')
    print(f'modules over {MAX_MODULE_LINES} lines:', long_modules() or 'none')
    print(f'functions over {MAX_FUNCTION_LINES} lines:', long_functions() or 'none')
    return 1 if found else 0


if __name__ == '__main__':
    sys.exit(main())
