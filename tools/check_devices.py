"""Fail when a chapter that reaches a GPU-only path hard-codes the CPU in a cell CI runs.

A compiled Triton kernel reads only CUDA tensors, so on a GPU machine a chapter whose unflagged
cells feed Triton CPU tensors fails there and nowhere else: CI runs the kernels on the CPU under
the interpreter, where every tensor is a CPU tensor. The rules, for every chapter whose unflagged
code (not `slow`, `gpu` or `eval: false`) reaches Triton (`import triton`,
a module of Triton kernels, `TritonAttentionBackend`, or the `'triton'` attention backend by name):

1. it chooses its device once: a top-level assignment in an unflagged, non-exported cell whose
   value asks `torch.cuda.is_available()` (`device = 'cuda' if torch.cuda.is_available() else
   'cpu'`) or calls chapter 00's `resolve_device()`;
2. no unflagged, non-exported cell hard-codes the CPU: no `'cpu'` string (`device='cpu'`,
   `.to('cpu')`, `torch.device('cpu')`) and no `.cpu()` call, except in that assignment;
3. an unflagged cell that asks for the triton backend by name (`attention_backend='triton'`,
   `get_attention_backend('triton', ...)`, `TritonAttentionBackend(...)`) names that device
   variable too: the model it runs must be on the chapter's device.

A deliberate CPU line says why: `# stays on the CPU: <why>` on any line of its statement (the
header of a `def`/`for`/`with`) or on the comment lines just above it; the same comment before a
cell's first statement covers the whole cell. Exported cells are the package's code, whose
defaults pytest checks; they are not read here.

What it cannot catch: tensors made without a device (`torch.randn(3)` is a CPU tensor), modules
built on the CPU and never moved, a CPU default inside a helper the cell calls, `'cpu'` spelt
through a variable, CPU clocks around asynchronous GPU work, and tolerances that only one
machine meets. It reads the source; only a run on a GPU proves the chapter.

    python3 tools/check_devices.py [notebooks...]     # default: every chapter; exit 1 on findings
"""
from __future__ import annotations

import ast
import io
import re
import sys
import tokenize
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nbtools import chapters, directives, read_nb, skipped_by, source, split_directives  # noqa: E402

MARKER = re.compile(r'#\s*stays on the CPU:\s*\S')
_IMPORTS_TRITON = re.compile(r'^\s*(import triton|from triton|'
                             r'from petite_llm\.(kernels|engine\.triton_backend)\b|'
                             r'import petite_llm\.(kernels|engine\.triton_backend)\b|'
                             r'from petite_llm import kernels|'
                             r'from petite_llm\.engine import triton_backend)', re.M)


def _is_resolver(node: ast.AST) -> bool:
    "Whether node asks torch.cuda.is_available(), itself or through the package's resolve_device."
    return any((isinstance(n, ast.Attribute) and n.attr == 'is_available'
                and isinstance(n.value, ast.Attribute) and n.value.attr == 'cuda')
               or (isinstance(n, ast.Call) and getattr(n.func, 'id', None) == 'resolve_device')
               for n in ast.walk(node))


def _asks_triton(tree: ast.AST) -> bool:
    "Whether the code asks for the triton backend by name or builds it."
    for n in ast.walk(tree):
        if not isinstance(n, ast.Call):
            continue
        name = n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, 'id', '')
        if name == 'TritonAttentionBackend':
            return True
        if any(k.arg == 'attention_backend' and isinstance(k.value, ast.Constant)
               and k.value.value == 'triton' for k in n.keywords):
            return True
        if (name == 'get_attention_backend' and n.args and isinstance(n.args[0], ast.Constant)
                and n.args[0].value == 'triton'):
            return True
    return False


def _cpu_uses(tree: ast.AST):
    "(node, what) for every 'cpu' string and .cpu() call in tree."
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and (
                n.value == 'cpu' or n.value.startswith('cpu:')):
            yield n, f"'{n.value}'"
        elif (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
              and n.func.attr == 'cpu' and not n.args):
            yield n, '.cpu()'


def _statement_lines(tree: ast.Module, node: ast.AST) -> tuple[range, ast.stmt]:
    "The lines of the innermost statement holding node (a compound one's header) and that stmt."
    best = None
    for stmt in ast.walk(tree):
        if isinstance(stmt, ast.stmt) and stmt.lineno <= node.lineno <= stmt.end_lineno:
            if best is None or stmt.lineno >= best.lineno:
                best = stmt
    body = getattr(best, 'body', None)
    end = body[0].lineno - 1 if body and isinstance(body, list) else best.end_lineno
    return range(best.lineno, max(end, node.lineno) + 1), best


def _comments(code: str) -> dict[int, str]:
    "line number -> the comment on it."
    out = {}
    try:
        for tok in tokenize.generate_tokens(io.StringIO(code).readline):
            if tok.type == tokenize.COMMENT:
                out[tok.start[0]] = tok.string
    except (tokenize.TokenError, IndentationError):
        pass
    return out


def _marked(lines: range, comments: dict[int, str], code_lines: list[str]) -> bool:
    "Whether a marker sits on these lines or on the comment-only lines just above them."
    if any(MARKER.search(comments.get(i, '')) for i in lines):
        return True
    i = lines.start - 1
    while i >= 1 and code_lines[i - 1].lstrip().startswith('#'):
        if MARKER.search(code_lines[i - 1]):
            return True
        i -= 1
    return False


def reaches_gpu_path(cells: list[dict]) -> bool:
    "Whether these cells (CI runs them) import Triton or its kernels, or ask for its backend."
    for cell in cells:
        if _IMPORTS_TRITON.search(source(cell)):
            return True
        try:
            if _asks_triton(ast.parse(split_directives(source(cell))[1])):
                return True
        except SyntaxError:
            pass
    return False


def problems(nb: dict, name: str = 'notebook') -> list[str]:
    "Every breach of the rules in one notebook, one message each."
    cells = [(i, c) for i, c in enumerate(nb['cells'])
             if c.get('cell_type') == 'code' and not skipped_by(c)]
    if not reaches_gpu_path([c for _, c in cells]):
        return []
    res, device_names, parsed = [], set(), []
    for i, cell in cells:
        if 'export' in directives(cell) or 'exports' in directives(cell):
            continue
        code = split_directives(source(cell))[1]
        offset = source(cell)[:len(source(cell)) - len(code)].count('\n')
        try:
            tree = ast.parse('\n'.join(line for line in code.splitlines()
                                       if not line.lstrip().startswith(('!', '%'))))
        except SyntaxError:
            continue
        parsed.append((i, cell, code, offset, tree))
        for stmt in tree.body:
            if isinstance(stmt, ast.Assign) and _is_resolver(stmt.value):
                device_names.update(t.id for t in stmt.targets if isinstance(t, ast.Name))
    if not device_names:
        res.append(f"{name}: reaches Triton but never chooses its device: add a cell with "
                   "`device = 'cuda' if torch.cuda.is_available() else 'cpu'` and use it")
    for i, cell, code, offset, tree in parsed:
        code_lines, comments = code.splitlines(), _comments(code)
        first = tree.body[0].lineno if tree.body else 1
        if any(MARKER.search(comments.get(n, '')) for n in range(1, first)):
            continue                                  # the whole cell stays on the CPU
        uses = {(node.lineno, what): node for node, what in _cpu_uses(tree)}
        for (_, what), node in sorted(uses.items()):
            lines, stmt = _statement_lines(tree, node)
            if _is_resolver(stmt) or _marked(lines, comments, code_lines):
                continue
            res.append(f"{name}: cell {i} (id {cell.get('id', '?')}), line {node.lineno + offset}"
                       f": {what} hard-codes the CPU in a chapter that reaches Triton: use the "
                       "chapter's device, or say why with `# stays on the CPU: <why>`")
        if _asks_triton(tree) and not device_names & {n.id for n in ast.walk(tree)
                                                       if isinstance(n, ast.Name)}:
            if not any(MARKER.search(c) for c in comments.values()):
                res.append(f"{name}: cell {i} (id {cell.get('id', '?')}) asks for the triton "
                           "backend without naming the chapter's device: put the model (and its "
                           f"inputs) on {' or '.join(sorted(device_names)) or 'it'}")
    return res


def main(argv=None) -> int:
    "Check the given notebooks (default: every chapter); non-zero when any breaks a rule."
    paths = [Path(p) for p in (sys.argv[1:] if argv is None else argv)] or chapters()
    bad = [m for p in paths for m in problems(read_nb(p), p.name)]
    for m in bad:
        print(m)
    if bad:
        print(f'\n{len(bad)} device problems: see tools/check_devices.py for the rules')
        return 1
    print(f'devices: {len(paths)} notebooks choose their device once and feed Triton no CPU '
          'tensor by name')
    return 0


if __name__ == '__main__':
    sys.exit(main())
