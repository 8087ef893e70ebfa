"""Execute the book's notebooks top to bottom and save their outputs (what `make book` runs).

Each notebook runs in its own fresh Python process, in-process through execnb's CaptureShell
(as `nbdev_test` does), with the working directory set to nbs/. Cells flagged with a test flag
(`#| slow`, `#| gpu`) or `#| eval: false` are skipped and KEEP their saved outputs, so a figure
measured on a GPU survives a CPU build; `--flags slow` (or `--flags "slow gpu"`) runs them too.
With `--only-flagged` every cell still runs, but only the flagged ones get new outputs: a GPU
machine records its figures without replacing the CPU build's (`--flags gpu --only-flagged`).
Every cell that runs gets its new outputs (or none; stderr, where warnings, log lines and
progress bars go, is left out of what is saved) and
`metadata.petite_llm.source_hash = sha256(source)`, which tools/check_outputs.py compares with
the source to find outputs older than their cell.
A notebook whose cell raises is not written: the traceback and the cell are printed instead.
`--plan` runs nothing: it says, for each notebook, how many cells would run and be saved.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nbtools import (HASH_KEY, NBS, ROOT, directives, read_nb, settings,  # noqa: E402
                     skipped_by, source_hash, test_flags, without_stderr)


def run_one(path: Path, run_flags: set[str], only_flagged: bool = False) -> int:
    """Execute one notebook in this process and save it; 0 on success."""
    from execnb.nbio import nb2dict, read_nb, write_nb
    from execnb.shell import CaptureShell
    from nbdev.clean import clean_nb

    path = path.resolve()
    os.chdir(path.parent)
    sys.path.insert(0, str(ROOT))
    nb = read_nb(path)
    shell = CaptureShell(path)
    shell._fname = path
    ran = skipped = 0
    start = time.time()
    for cell in nb.cells:
        if cell.cell_type != 'code':
            continue
        why = skipped_by(cell, run_flags)
        if why:
            skipped += 1
            continue
        shell._cell_idx = cell.idx_ + 1
        t0 = time.time()
        outs = shell.run(cell.source)
        if shell.exc is not None:
            first = cell.source.strip().splitlines()[:3]
            sys.stderr.write(f'\n{path.name}: cell {cell.idx_} (id {cell.get("id")}) raised; '
                             'notebook NOT saved.\n--- cell starts:\n'
                             + '\n'.join(first) + '\n---\n'
                             + shell.prettytb(fname=path) + '\n')
            return 1
        ran += 1
        if only_flagged and not run_flags & set(directives(cell)):
            continue                  # ran for the state it leaves; its saved outputs stay
        # the reader's view: no log lines or progress bars (a test or a terminal shows those)
        cell['outputs'] = without_stderr([dict(o) for o in outs])
        cell['execution_count'] = None
        # the hash beside what else the cell's metadata says (tools/avx2_stage.py's cpu_paths)
        cell.setdefault('metadata', {}).setdefault(HASH_KEY, {})['source_hash'] = source_hash(cell)
        if time.time() - t0 > 30 and not skipped_by(cell):
            print(f'  {path.name}: cell {cell.idx_} took {time.time() - t0:.0f}s '
                  '(unflagged cells should take seconds; flag long ones `#| slow`)', flush=True)
    d = nb2dict(nb)
    cfg = settings()  # the normal form of `nbdev_clean`, which keeps outputs and the petite_llm key
    clean_nb(d, clear_all=False, allowed_metadata_keys=cfg.get('allowed_metadata_keys', '').split(),
             allowed_cell_metadata_keys=cfg.get('allowed_cell_metadata_keys', '').split(),
             clean_ids=cfg.get('clean_ids', 'True').lower() == 'true')
    write_nb(d, path)
    print(f'{path.name}: ran {ran} cells, skipped {skipped} flagged, '
          f'{time.time() - start:.1f}s', flush=True)
    return 0


def plan(path: Path, run_flags: set[str], only_flagged: bool = False) -> str:
    """What running one notebook would do, in one line: cells run, saved and skipped."""
    cells = [c for c in read_nb(path)['cells'] if c['cell_type'] == 'code']
    run = [c for c in cells if not skipped_by(c, run_flags)]
    saved = [c for c in run if not only_flagged or run_flags & set(directives(c))]
    return (f'{path.name}: would run {len(run)} cells and save {len(saved)}, '
            f'skip {len(cells) - len(run)}')


def default_notebooks() -> list[Path]:
    """Every notebook in nbs/ (index first, then the chapters), as nbdev_test finds them."""
    nbs = sorted(p for p in NBS.glob('*.ipynb') if not p.name.startswith(('_', '.')))
    return sorted(nbs, key=lambda p: (p.name != 'index.ipynb', p.name))


def main(argv=None) -> int:
    """Run the chosen notebooks, each in a fresh process; non-zero if any failed."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('notebooks', nargs='*', type=Path,
                    help='notebooks to run (default: all of nbs/)')
    ap.add_argument('--flags', default='',
                    help='test flags whose cells to run too, one string: "slow" or "slow gpu"')
    ap.add_argument('--only-flagged', action='store_true',
                    help='save new outputs only in the cells --flags names (the rest still run)')
    ap.add_argument('--plan', action='store_true',
                    help='run nothing: say how many cells each notebook would run and save')
    # child mode: run one notebook in this process
    ap.add_argument('--one', action='store_true', help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    flags = set(args.flags.replace(',', ' ').split())
    if flags - test_flags():
        ap.error(f'unknown flag(s) {sorted(flags - test_flags())}: '
                 f'settings.ini tst_flags has {sorted(test_flags())}'
                 ' (pass several as one string, --flags "slow gpu", before or after the notebooks)')
    if args.only_flagged and not flags:
        ap.error('--only-flagged saves the outputs of the cells --flags names: give --flags too')
    if args.one:
        return run_one(args.notebooks[0], flags, args.only_flagged)
    nbs = args.notebooks or default_notebooks()
    missing = [str(p) for p in nbs if not Path(p).is_file()]
    if missing:
        ap.error(f'no such notebook: {", ".join(missing)}')
    if not nbs:
        print('no notebooks found in nbs/', file=sys.stderr)
        return 1
    if args.plan:
        print('\n'.join(plan(Path(nb), flags, args.only_flagged) for nb in nbs))
        return 0
    failed = []
    for nb in nbs:
        cmd = [sys.executable, __file__, '--one', str(Path(nb).resolve())]
        if flags:
            cmd += ['--flags', ' '.join(sorted(flags))]
        if args.only_flagged:
            cmd.append('--only-flagged')
        # progress bars off for transformers and the hub (they would only be left out)
        env = {**os.environ, 'HF_HUB_DISABLE_PROGRESS_BARS': '1'}
        if subprocess.call(cmd, cwd=ROOT, env=env) != 0:
            failed.append(Path(nb).name)
    print(f'{len(nbs) - len(failed)} notebooks executed and saved, {len(failed)} failed'
          + (f': {", ".join(failed)}' if failed else ''))
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
