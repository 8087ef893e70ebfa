"""The package's shape: its parts and the arrows between them, which modules import which (at the
top or inside a function), any circle, any module without a docstring, and the modules and
functions longer than a reader can hold at once.

The parts import one way, lowest first (LEVELS): model, then engine and parallel (which may import
each other), serve, bench, cli; the package's own __init__ may import any of them.
`python tools/import_graph.py [PACKAGE_DIR]` prints all of it and exits 1 on an arrow against the
direction, a circle, a module without a docstring or one that is too long; tests/test_imports.py
asserts the same.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / 'petite_llm'
GENERATED = {'_modidx'}          # nbdev's index of symbols, not code a reader reads
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 450, 60
# the parts of the package, lowest first: a module imports from its own level and those below
LEVELS = [('model',), ('engine', 'parallel'), ('serve',), ('bench',), ('cli',)]
TOP = '__init__'                 # petite_llm/__init__.py: the public API, above every part


def module_name(path: Path) -> str:
    """petite_llm/model/layers/linear.py -> 'model.layers.linear'."""
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


def part(module: str) -> str:
    """The part a module belongs to: 'engine' for engine.runner; TOP for the package's __init__."""
    return module.split('.')[0]


def level(name: str) -> int:
    """A part's level in LEVELS (TOP above them all); -1 for a module outside every part."""
    if name == TOP:
        return len(LEVELS)
    return next((i for i, parts in enumerate(LEVELS) if name in parts), -1)


def outside_parts() -> list[str]:
    """Modules that belong to no part of LEVELS."""
    return [name for name in modules() if level(part(name)) < 0]


def part_arrows(graph: dict[str, set[str]]) -> dict[tuple[str, str], int]:
    """(importing part, imported part) -> how many module imports make that arrow."""
    arrows: dict[tuple[str, str], int] = {}
    for name, deps in graph.items():
        for dep in deps:
            if part(dep) != part(name):
                key = (part(name), part(dep))
                arrows[key] = arrows.get(key, 0) + 1
    return arrows


def wrong_arrows(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Module imports that point up the levels: (importer, imported)."""
    return sorted((name, dep) for name, deps in graph.items() for dep in deps
                  if level(part(dep)) > level(part(name)))


def undocumented() -> list[str]:
    """Modules (subpackages' __init__ included) that do not open with a docstring."""
    return [name for name, path in modules().items()
            if ast.get_docstring(ast.parse(path.read_text(encoding='utf-8'))) is None]


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
    print('parts, lowest first:', ' | '.join(', '.join(parts) for parts in LEVELS))
    for (src, dst), count in sorted(part_arrows(graph).items(),
                                    key=lambda kv: (-level(kv[0][0]), kv[0])):
        print(f'  {src:9s} -> {dst:9s} ({count} import{"s" * (count > 1)})')
    for name, deps in sorted(graph.items()):
        print(f'{name:24s} -> {", ".join(sorted(deps)) or "-"}')
    problems = {'arrows against the direction': wrong_arrows(graph),
                'modules outside every part': outside_parts(),
                'circles': circles(graph), 'modules without a docstring': undocumented(),
                f'modules over {MAX_MODULE_LINES} lines': long_modules(),
                f'functions over {MAX_FUNCTION_LINES} lines': long_functions()}
    for what, found in problems.items():
        print(f'{what}:', found or 'none')
    return 1 if any(problems.values()) else 0


if __name__ == '__main__':
    sys.exit(main())
