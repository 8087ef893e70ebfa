"""Export the notebooks to petite_llm/: nbdev_export, made repeatable, every module documented.

nbdev 2 writes a notebook's `#| default_exp` module afresh (its docstring: the notebook's
`> summary`), but *appends* the cells of `#| export other` to an existing `other.py`, and refuses
to create it. A module that no notebook names in `#| default_exp` (petite_llm/engine/backends.py,
fed by chapter 11; petite_llm/model/layers/linear.py, fed by chapters 03 and 15) would so gain a
second copy of its cells at every export. This script first resets each such module to a header
whose docstring is the `# petite_llm.NAME: what it holds` line of the first cell that exports to
it (a default_exp module with such a line gets it too, in place of the summary), writes each subpackage's `__init__.py` from PACKAGES, then runs nbdev_export, so `make export`
(and the sync check of `make test`) gives the same files every time.
`python tools/export.py --check` lists the modules it would reset and exits.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nbtools import NBS, ROOT, read_nb, source  # noqa: E402

LIB = ROOT / 'petite_llm'
EXPORT_TO = re.compile(r'^#\|\s*export\s+([\w.]+)\s*$', re.M)
DEFAULT_EXP = re.compile(r'^#\|\s*default_exp\s+([\w.]+)\s*$', re.M)
MODULE_DOC = re.compile(r'^# petite_llm\.([\w.]+): (.+)$', re.M)
# each subpackage's docstring after "The model (chapters ...): ", the chapters read from the notebooks
# that export into it: what lives there, and which parts it may import (one way: cli -> bench ->
# serve -> engine and parallel -> model -> kernels; tools/import_graph.py checks it)
PACKAGES = {
    'kernels': ("The Triton kernels", "paged attention, the fused layer ops, the fused experts, "
                "matmuls on GGUF's packed codes, LoRA's shrink and expand, and their ahead-of-time "
                "compile check, each a function of tensors and ints. Imports no other part."),
    'model': ("The model", "config, layers, Qwen3 and its mixture of experts, weights, "
              "quantization, tokenizer, sampling, generation without an engine (the loop, then "
              "with a contiguous KV cache), and what this CPU computes. Imports no other part."),
    'model.layers': ("The decoder's layers", "RMSNorm, RoPE, attention, the MLP and the linear "
                     "layers they share."),
    'engine': ("The engine", "the paged KV pool, scheduler, attention backends (the triton one on "
               "the kernels), the model runner, LLMEngine and LLM, speculative decoding, batch "
               "invariance, structured outputs and LoRA adapters. Imports model and kernels, and "
               "parallel for tensor-parallel workers."),
    'parallel': ("Tensor parallelism", "sharding, row-parallel layers, collectives and worker "
                 "processes. Imports model and engine."),
    'serve': ("The OpenAI-compatible server", "AsyncLLMEngine, the protocol, the HTTP server, its "
              "limits and metrics. Imports engine, parallel and model."),
    'bench': ("Benchmarks", "offline against transformers, host work, profiles, real models, load "
              "and soak tests of the server. Imports serve and below."),
    'cli': ("The petite-llm command", "its subcommands and their options. Imports every other "
                                    "part."),
}


def module_names() -> tuple[set[str], dict[str, str]]:
    """Modules named by `#| default_exp`, and the others `#| export mod` feeds (-> first notebook).
    """
    defaults, others = set(), {}
    for path in sorted(NBS.glob('*.ipynb')):
        for cell in read_nb(path)['cells']:
            if cell['cell_type'] != 'code':
                continue
            defaults.update(DEFAULT_EXP.findall(source(cell)))
            for name in EXPORT_TO.findall(source(cell)):
                others.setdefault(name, path.name)
    return defaults, {k: v for k, v in others.items() if k not in defaults}


def module_docs() -> dict[str, str]:
    """The `# petite_llm.NAME: ...` line of each module, from the cells that export to it."""
    docs = {}
    for path in sorted(NBS.glob('*.ipynb')):
        for cell in read_nb(path)['cells']:
            if cell['cell_type'] == 'code':
                for name, doc in MODULE_DOC.findall(source(cell)):
                    docs.setdefault(name, doc.strip())
    return docs


def docstring(text: str) -> str:
    """A one-line module docstring: the text as a sentence."""
    text = text[0].upper() + text[1:]
    return f'"""{text if text.endswith(".") else text + "."}"""\n\n'


def empty_module(name: str, notebook: str, doc: str) -> str:
    """nbdev's header with no cells yet (what it appends to), annotations postponed for them all."""
    up = '../' * (name.count('.') + 1)
    # a __future__ import must come first, so the appended cells cannot bring their own
    return (f'{docstring(doc)}# AUTOGENERATED! DO NOT EDIT! File to edit: {up}nbs/{notebook}.\n\n'
            'from __future__ import annotations\n\n# %% auto 0\n__all__ = []\n')


def redoc_defaults(defaults: set[str], docs: dict[str, str]):
    """A `#| default_exp` module with a `# petite_llm.NAME:` line opens on it, not on the summary."""
    for name in sorted(defaults & set(docs)):
        path = LIB / (name.replace('.', '/') + '.py')
        text = path.read_text(encoding='utf-8')
        end = text.index('"""', 3) + 3                  # nbdev's docstring: the chapter's summary
        path.write_text(docstring(docs[name]).rstrip('\n') + text[end:], encoding='utf-8')


def chapters(numbers) -> str:
    """[0, 1, 2, 3, 17, 18] -> 'chapters 00-03, 17 and 18': three or more in a row as a range."""
    runs = []
    for n in sorted(numbers):
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    parts = [part for a, b in runs                 # two in a row are two, three or more a range
             for part in ([f'{a:02d}'] if a == b else [f'{a:02d}', f'{b:02d}'] if b == a + 1
                          else [f'{a:02d}-{b:02d}'])]
    word = 'chapter' if len(parts) == 1 and '-' not in parts[0] else 'chapters'
    return f"{word} {', '.join(parts[:-1]) + ' and ' if len(parts) > 1 else ''}{parts[-1]}"


def package_chapters() -> dict[str, set[int]]:
    """Each subpackage of PACKAGES -> the numbered chapters whose cells export into it."""
    found = {name: set() for name in PACKAGES}
    for path in sorted(NBS.glob('[0-9]*.ipynb')):
        number = int(path.name.split('_')[0])
        for cell in read_nb(path)['cells']:
            if cell['cell_type'] != 'code':
                continue
            for module in DEFAULT_EXP.findall(source(cell)) + EXPORT_TO.findall(source(cell)):
                for name in found:
                    if module.startswith(name + '.'):
                        found[name].add(number)
    return found


def package_doc(name: str, numbers: set[int]) -> str:
    """'The model (chapters 00-09, 15 and 19): what lives there.'"""
    title, holds = PACKAGES[name]
    return f"{title} ({chapters(numbers)}): {holds}"


def write_packages():
    """Each subpackage's __init__.py: its docstring, nothing else (no import at package level)."""
    for name, numbers in package_chapters().items():
        path = LIB / name.replace('.', '/') / '__init__.py'
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f'"""{package_doc(name, numbers)}"""\n# AUTOGENERATED by tools/export.py '
                        '(PACKAGES): do not edit.\n', encoding='utf-8')


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--check', action='store_true',
                        help='list the modules to reset; export nothing')
    args = parser.parse_args()
    defaults, others = module_names()
    docs = module_docs()
    if missing := sorted(set(others) - set(docs)):
        print(f"no docstring line for {', '.join(missing)}: add `# petite_llm.NAME: what it holds` "
              "under `#| export NAME` in the first cell that exports to it", file=sys.stderr)
        return 1
    for name, notebook in sorted(others.items()):
        path = LIB / (name.replace('.', '/') + '.py')
        print(f'{path.relative_to(ROOT)}: fed by `#| export {name}` (first in {notebook})')
        if not args.check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(empty_module(name, notebook, docs[name]), encoding='utf-8')
    if args.check:
        return 0
    write_packages()
    if rc := subprocess.call([str(Path(sys.executable).parent / 'nbdev_export')], cwd=ROOT):
        return rc
    redoc_defaults(defaults, docs)
    return 0


if __name__ == '__main__':
    sys.exit(main())
