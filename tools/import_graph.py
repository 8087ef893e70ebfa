"""The package's shape: its parts and the arrows between them, which modules import which (at the
top or inside a function), any circle, any module without a docstring, the modules and
functions longer than a reader can hold at once, and any class not written once, complete in
its body: a @patch or `Class.attr = ...` outside it, a method defined twice in it, an object's
class swapped.

The parts import one way, lowest first (LEVELS): kernels (tensors and ints in, nothing else of
the package), model, then engine and parallel (which may import each other), serve, bench, cli;
the package's own __init__ may import any of them.
`python tools/import_graph.py [PACKAGE_DIR]` prints all of it and exits 1 on an arrow against the
direction, a circle, a module without a docstring, one that is too long or a redefinition;
tests/test_imports.py asserts the same.
"""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / 'petite_llm'
GENERATED = {'_modidx'}          # nbdev's index of symbols, not code a reader reads
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 450, 60
# the parts of the package, lowest first: a module imports from its own level and those below
LEVELS = [('kernels',), ('model',), ('engine', 'parallel'), ('serve',), ('bench',), ('cli',)]
TOP = '__init__'                 # petite_llm/__init__.py: the public API, above every part


def module_name(path: Path) -> str:
    """petite_llm/model/layers/linear.py -> 'model.layers.linear'."""
    return '.'.join(path.relative_to(PKG).with_suffix('').parts).removesuffix('.__init__')


def modules() -> dict[str, Path]:
    """Every module of the package by name, the generated ones left out."""
    found = {module_name(p): p for p in sorted(PKG.rglob('*.py'))}
    return {name: p for name, p in found.items() if name not in GENERATED}


def import_from(node: ast.ImportFrom, here: str) -> str:
    """The absolute module a `from ... import` names, in the module called here."""
    if not node.level:
        return node.module or ''
    # `from .x import y` in petite_llm/a/b.py names petite_llm.a.x
    parts = here.split('.')
    base = parts[:len(parts) - node.level] + ([node.module] if node.module else [])
    return '.'.join(['petite_llm'] + base)


def imported(path: Path, known: set[str]) -> set[str]:
    """The package's modules that the module at path imports, anywhere in it."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding='utf-8'))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            stem = import_from(node, module_name(path))
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


# A class is written once, complete in its body: what adds to it or redefines it elsewhere
PATCH = re.compile(r'fastcore(\.\w+)*\.patch')    # fastcore's @patch, wherever it is imported from
ACCESSORS = ('setter', 'getter', 'deleter')      # @x.setter def x: one property, not two


def dotted(node: ast.expr) -> str | None:
    """'a.b.C' for the expression a.b.C or the string annotation 'a.b.C'; None for any other."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = dotted(node.value)
        return head and f'{head}.{node.attr}'
    return None


def absolute(module: str) -> str:
    """The importable name of a module: 'petite_llm.engine.scheduler', 'petite_llm' for TOP."""
    return 'petite_llm' if module == TOP else f'petite_llm.{module}'


def bindings(tree: ast.Module, module: str) -> dict[str, str]:
    """Names a module imports (anywhere in it) or defines as classes -> their absolute names."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            stem = import_from(node, module)
            names.update({a.asname or a.name: f'{stem}.{a.name}' for a in node.names
                          if a.name != '*'})
        elif isinstance(node, ast.Import):
            # `import a.b` binds a; `import a.b as c` binds c to a.b
            names.update({a.asname: a.name for a in node.names if a.asname})
            names.update({a.name.split('.')[0]: a.name.split('.')[0] for a in node.names
                          if not a.asname})
    names.update({node.name: f'{absolute(module)}.{node.name}' for node in tree.body
                  if isinstance(node, ast.ClassDef)})
    return names


def expand(text: str | None, names: dict[str, str]) -> str | None:
    """A dotted name written in a module, as the absolute name its first part is bound to."""
    head, _, rest = (text or '').partition('.')
    if head not in names:
        return None
    return f'{names[head]}.{rest}' if rest else names[head]


def class_at(name: str | None, trees: dict[str, ast.Module],
             names: dict[str, dict[str, str]]) -> tuple[str, str] | None:
    """The package's class (module, class name) an absolute name means, through re-exports."""
    seen = set()
    while name and name not in seen:
        seen.add(name)
        stem, _, attr = name.rpartition('.')
        module = TOP if stem == 'petite_llm' else stem.removeprefix('petite_llm.')
        if module not in trees:
            return None
        if any(isinstance(node, ast.ClassDef) and node.name == attr for node in trees[module].body):
            return module, attr
        name = names[module].get(attr)       # imported there: follow it
    return None


def body_attributes(node: ast.ClassDef) -> tuple[dict[str, int], list[tuple[str, int, int]]]:
    """What a class body defines (methods, class attributes, fields, nested classes, what its
    methods assign to their first parameter) -> line, and each method defined twice in it as
    (name, line, line of the first)."""
    defined, twice = {}, []
    for stmt in node.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            decorators = [dotted(d.func if isinstance(d, ast.Call) else d) or ''
                          for d in stmt.decorator_list]
            accessor = any(d == f'{stmt.name}.{kind}' for d in decorators for kind in ACCESSORS)
            if stmt.name in defined and not isinstance(stmt, ast.ClassDef) and not accessor:
                twice.append((stmt.name, stmt.lineno, defined[stmt.name]))
            # an @overload stub is not the definition: the def after it is
            if not any(d.split('.')[-1] == 'overload' for d in decorators):
                defined.setdefault(stmt.name, stmt.lineno)
        targets = stmt.targets if isinstance(stmt, ast.Assign) else (
            [stmt.target] if isinstance(stmt, ast.AnnAssign) else [])
        for target in targets:
            for name in ast.walk(target):
                if isinstance(name, ast.Name):
                    defined.setdefault(name.id, stmt.lineno)
    for method in node.body:
        if isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)):
            params = method.args.posonlyargs + method.args.args
            owner = params[0].arg if params else None
            for sub in ast.walk(method):
                if (isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store)
                        and isinstance(sub.value, ast.Name) and sub.value.id == owner):
                    defined.setdefault(sub.attr, sub.lineno)
    return defined, twice


def annotated_classes(annotation: ast.expr | None) -> list[ast.expr]:
    """The classes an annotation names: C, (C, D) or C | D (fastcore patches each)."""
    if isinstance(annotation, ast.Tuple):
        return annotation.elts
    if isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):
        return annotated_classes(annotation.left) + annotated_classes(annotation.right)
    return [] if annotation is None else [annotation]


def additions(tree: ast.Module, names: dict[str, str]) -> list[tuple[int, str, ast.expr, str]]:
    """What a module adds to classes outside their bodies, in source order: (line, attribute,
    the class expression, how) for each @patch and each `Class.attr = ...`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            decorators = [d.func if isinstance(d, ast.Call) else d for d in node.decorator_list]
            params = node.args.posonlyargs + node.args.args
            if params and any(PATCH.fullmatch(expand(dotted(d), names) or '') for d in decorators):
                found += [(node.lineno, node.name, cls, '@patch')
                          for cls in annotated_classes(params[0].annotation)]
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found += [(node.lineno, target.attr, target.value, 'assignment')
                      for each in targets for target in ast.walk(each)
                      if isinstance(target, ast.Attribute) and isinstance(target.ctx, ast.Store)]
    return sorted(found, key=lambda item: item[0])


def execution_order(graph: dict[str, set[str]]) -> list[str]:
    """The modules, each after the modules it imports (the order Python runs them in)."""
    order, started = [], set()

    def visit(module: str):
        if module in started:
            return                        # run already, or a circle (circles() reports it)
        started.add(module)
        for dep in sorted(graph[module]):
            visit(dep)
        order.append(module)

    for module in sorted(graph):
        visit(module)
    return order


def redefinitions() -> list[tuple[str, int, str, str, str]]:
    """Each attribute a class gets outside its body or a second time, as (module, line, class,
    attribute, what): a second def in a class body; any @patch or `Class.attr = ...` (over what
    the body, an earlier @patch or assignment defined: what names that line); and an object's
    class swapped (`obj.__class__ = C`: every method replaced)."""
    trees = {name: ast.parse(path.read_text(encoding='utf-8')) for name, path in modules().items()}
    names = {module: bindings(tree, module) for module, tree in trees.items()}
    found = []
    known = {}           # (module, class) -> attribute -> 'module:line' of its first definition
    for module, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                defined, twice = body_attributes(node)
                if node in tree.body:
                    known[module, node.name] = {attr: f'{module}:{line}'
                                                for attr, line in defined.items()}
                found += [(module, line, node.name, attr, f'second def over {module}:{first}')
                          for attr, line, first in twice]
    for module in execution_order(import_graph()):
        for line, attr, target, how in additions(trees[module], names[module]):
            cls = class_at(expand(dotted(target), names[module]), trees, names)
            here = f'{module}:{line}'
            if cls is not None and (first := known[cls].setdefault(attr, here)) != here:
                found.append((module, line, cls[1], attr, f'{how} over {first}'))
            elif cls is not None:
                found.append((module, line, cls[1], attr, f'{how} outside the class body'))
            if attr == '__class__':
                found.append((module, line, dotted(target) or '?', attr, 'class swap'))
    return sorted(found)


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
                f'functions over {MAX_FUNCTION_LINES} lines': long_functions(),
                'redefinitions': [f'{module}:{line} {cls}.{attr}: {how}'
                                  for module, line, cls, attr, how in redefinitions()]}
    for what, found in problems.items():
        if what == 'redefinitions' and found:
            print(f'{what}:', *found, sep='\n  ')       # one a line: each is long
        else:
            print(f'{what}:', found or 'none')
    return 1 if any(problems.values()) else 0


if __name__ == '__main__':
    sys.exit(main())
