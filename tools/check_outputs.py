"""Fail when a notebook's saved outputs are older than its source (part of `make test`).

`make book` stores sha256(cell source) in each executed code cell's metadata
(`petite_llm.source_hash`). This check fails, naming the notebook and the cell, when
- a code cell that has outputs has no hash, or a hash of a different source
  (the cell was edited after its output was saved), or
- a code cell that `make book` ran (it has a hash) was edited since, even if it prints nothing, or
  a chapter's code cell that `make book` runs has no hash at all (added, never run), or
- a chapter notebook with cells to run has no executed cell at all (the book was never built), or
- a saved output is an error (a traceback would show on the site), or shows what a reader
  should not see: stderr (warnings, log lines, progress bars), a progress bar, or a path of the
  machine that ran it (tools/run_notebooks.py leaves stderr out; print paths relative to the repo).
Fix: `make book` (add FLAGS="slow" or FLAGS="gpu" for flagged cells), or clear the stale outputs.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nbtools import (NBS, ROOT, chapters, noise, read_nb, saved_hash,  # noqa: E402
                     skipped_by, source, source_hash)


def problems(path: Path, is_chapter: bool) -> list[str]:
    """Every stale or missing output in one notebook, one message each."""
    nb = read_nb(path)
    res, never_run, executed = [], [], 0
    for i, cell in enumerate(nb['cells']):
        if cell.get('cell_type') != 'code':
            continue
        outs, h = cell.get('outputs') or [], saved_hash(cell)
        first = (source(cell).strip().splitlines() or [''])[0][:60]
        where = f'{path.name}: cell {i} (id {cell.get("id", "?")}, "{first}")'
        if h is not None:
            executed += 1
        if any(o.get('output_type') == 'error' for o in outs):
            res.append(f'{where} has an error saved as its output')
        for why in dict.fromkeys(w for o in outs for w in noise(o)):
            res.append(f'{where} shows {why}')
        if h is None and outs:
            flag = skipped_by(cell)
            hint = ''
            if flag in ('slow', 'gpu'):
                hint = f' (a `{flag}` cell: `make book FLAGS={flag}` runs it)'
            res.append(f'{where} has outputs but no source hash: '
                       f'saved by hand, not by `make book`{hint}')
        elif h is not None and h != source_hash(cell):
            res.append(f'{where} was edited after `make book` saved its output')
        elif h is None and is_chapter and source(cell).strip() and not skipped_by(cell):
            never_run.append(f'{where} was never run by `make book` (a new cell?)')
    runnable = any(c.get('cell_type') == 'code' and source(c).strip() and not skipped_by(c)
                   for c in nb['cells'])
    if is_chapter and runnable and executed == 0:
        res.append(f'{path.name}: no cell was executed by `make book` (the book was never built)')
    elif executed:
        res += never_run              # a built chapter whose newer cells were not run with it
    return res


def main(argv=None) -> int:
    """Check the given notebooks (default: all of nbs/); non-zero when any output is stale."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('notebooks', nargs='*', type=Path)
    args = ap.parse_args(argv)
    nbs = args.notebooks or sorted(p for p in NBS.glob('*.ipynb')
                                   if not p.name.startswith(('_', '.')))
    chs = ({p.resolve() for p in chapters()}
           | {p.resolve() for p in args.notebooks if p.name[:1].isdigit()})
    if not chapters() and not args.notebooks:
        print('check_outputs: no chapter notebooks (NN_name.ipynb) in nbs/', file=sys.stderr)
        return 1
    bad = [m for p in nbs for m in problems(p, p.resolve() in chs)]
    for m in bad:
        print(m)
    if bad:
        print(f'\n{len(bad)} problems with saved outputs in nbs/. Run `make book` '
              '(FLAGS="slow" / FLAGS="gpu" for flagged cells) and commit the notebooks.')
        return 1
    print(f'saved outputs are fresh in {len(nbs)} notebooks')
    return 0


if __name__ == '__main__':
    sys.exit(main())
