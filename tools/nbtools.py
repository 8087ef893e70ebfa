"""Helpers shared by the book's tools: which notebooks are chapters, directives, source hashes."""
from __future__ import annotations

import configparser
import hashlib
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NBS = ROOT / 'nbs'
IMAGES = ROOT / 'images'
# The cell metadata key; settings.ini's allowed_cell_metadata_keys lets nbdev_clean keep it
HASH_KEY = 'petite_llm'

_directive_line = re.compile(r'^\s*#\s*\|')
_chapter_name = re.compile(r'^\d+[a-z]?_.+\.ipynb$')


# what a saved output must not show: the machine that ran it, or a progress bar redrawn in place
_machine_path = re.compile(r'/tmp/|/work/|/root/|/home/|/Users/|site-packages|pytest-of-')
_progress_bar = re.compile(r'\r|\d+%\|')


def output_text(output: dict) -> str:
    """The text an output shows: a stream's, or a result's text/plain."""
    text = output.get('text', output.get('data', {}).get('text/plain', ''))
    return ''.join(text) if isinstance(text, list) else text


def noise(output: dict) -> list[str]:
    """Why a saved output does not belong in the book: stderr, a progress bar, a machine path."""
    text, why = output_text(output), []
    if output.get('output_type') == 'stream' and output.get('name') == 'stderr':
        why.append('stderr (a warning, a log line or a progress bar)')
    if _progress_bar.search(text):
        why.append('a progress bar')
    if _machine_path.search(text):
        why.append('a path of the machine that ran it (print paths relative to the repository)')
    return why


def without_stderr(outputs: list[dict]) -> list[dict]:
    """The outputs a reader sees: stdout, results and pictures; stderr (logs, bars) left out."""
    return [o for o in outputs if not (o.get('output_type') == 'stream'
                                       and o.get('name') == 'stderr')]


def settings() -> configparser.SectionProxy:
    """The [DEFAULT] section of settings.ini."""
    cfg = configparser.ConfigParser(delimiters=['='])
    cfg.read(ROOT / 'settings.ini', encoding='utf-8')
    return cfg['DEFAULT']


def test_flags() -> set[str]:
    """The flags (`slow`, `gpu`) whose cells CI does not run, from settings.ini's tst_flags."""
    return set(settings().get('tst_flags', '').split())


def chapters(nbs: Path = NBS) -> list[Path]:
    """Chapter notebooks (`NN_name.ipynb`, or `NNb_name.ipynb` after NN) in book order."""
    return sorted(p for p in nbs.glob('*.ipynb') if _chapter_name.match(p.name))


def book_notebooks(nbs: Path = NBS) -> list[Path]:
    """The landing page then every chapter: the pages of the book."""
    index = nbs / 'index.ipynb'
    return ([index] if index.exists() else []) + chapters(nbs)


def read_nb(path: Path) -> dict:
    """A notebook as plain JSON (cell sources joined into one string)."""
    nb = json.loads(Path(path).read_text(encoding='utf-8'))
    for c in nb['cells']:
        c['source'] = source(c)
    return nb


def source(cell: dict) -> str:
    """A cell's source as one string, whether stored as a string or a list of lines."""
    s = cell.get('source', '')
    return ''.join(s) if isinstance(s, list) else s


def source_hash(cell: dict) -> str:
    """sha256 of a cell's source: stored with its outputs so stale outputs can be found."""
    return hashlib.sha256(source(cell).encode('utf-8')).hexdigest()


def saved_hash(cell: dict) -> str | None:
    """The source hash stored in the cell's metadata by `make book`, if any."""
    return (cell.get('metadata', {}).get(HASH_KEY) or {}).get('source_hash')


def split_directives(src: str) -> tuple[list[str], str]:
    """A code cell's leading `#|` directive lines and the code after them (nbdev's rule)."""
    lines = src.splitlines(True)
    i = 0
    while i < len(lines) and (lines[i].strip() == '' or _directive_line.match(lines[i])):
        i += 1
    dirs = [l for l in lines[:i] if _directive_line.match(l)]
    return dirs, ''.join(lines[i:])


def directives(cell: dict) -> dict[str, list[str]]:
    """The cell's directives: `#| slow` -> {'slow': []}, `#| eval: false` -> {'eval': ['false']}."""
    if cell.get('cell_type') != 'code':
        return {}
    res = {}
    for line in split_directives(source(cell))[0]:
        words = _directive_line.sub('', line).replace(':', ' ').split()
        if words:
            res[words[0].lower()] = [w.lower() for w in words[1:]]
    return res


def skipped_by(cell: dict, run_flags: set[str] = frozenset()) -> str | None:
    """Why `make book`/`nbdev_test` would skip this code cell (a flag, `eval: false`), or None."""
    d = directives(cell)
    for flag in sorted(test_flags() - set(run_flags)):
        if flag in d:
            return flag
    if d.get('eval', [''])[0] == 'false':
        return 'eval: false'
    if 'nbdev_export(' in source(cell):
        return 'nbdev_export'
    return None


def promises_picture(nb: dict) -> bool:
    """A chapter promises a picture when its code saves a figure or its text refers to images/.

    A `#| gpu` cell that never ran (no saved output) promises nothing on a CPU-built site.
    """
    for c in nb['cells']:
        s = source(c)
        if 'savefig' not in s and 'images/' not in s:
            continue
        if c.get('cell_type') == 'code' and 'gpu' in directives(c) and not c.get('outputs'):
            continue
        return True
    return False


def book_view(nb: dict) -> dict:
    """The notebook as a reader sees it: `#|` lines stripped, `#| hide` cells dropped, outputs kept.

    `#| include: false` drops a cell too; `#| echo: false` hides its code and `#| output: false`
    its outputs (jupyter-book's remove-input / remove-output tags).
    """
    cells = []
    for c in nb['cells']:
        c = dict(c, source=source(c), metadata=dict(c.get('metadata', {})))
        if c['cell_type'] == 'code':
            d = directives(c)
            if 'hide' in d or d.get('include', [''])[0] == 'false':
                continue
            c['source'] = split_directives(c['source'])[1].rstrip('\n')
            tags = set(c['metadata'].get('tags', []))
            if d.get('echo', [''])[0] == 'false' or 'hide_input' in d:
                tags.add('remove-input')
            if d.get('output', [''])[0] == 'false':
                tags.add('remove-output')
            if tags:
                c['metadata']['tags'] = sorted(tags)
            if not c['source'].strip() and not c.get('outputs'):
                continue
        cells.append(c)
    meta = dict(nb.get('metadata', {}))
    meta.setdefault('kernelspec',
                    {'name': 'python3', 'display_name': 'Python 3', 'language': 'python'})
    meta.setdefault('language_info', {'name': 'python'})
    return dict(nb, cells=cells, metadata=meta)
