"""Build the book's website offline with jupyter-book 1, from the outputs saved in the notebooks.

Copies _config.yml, _toc.yml, images/ and every notebook of the table of contents into
_build/book_src/ (ignored by git) as a reader should see them (`#|` directive lines stripped,
`#| hide` cells dropped; see nbtools.book_view), then runs `jupyter-book build` with execution
off. Markdown images `../images/x.png` resolve because images/ sits beside nbs/ there too (and
images/ is copied beside the built pages for raw-HTML <img> tags).
The HTML lands in _build/site/_build/html (SITE_HTML).
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nbtools import IMAGES, ROOT, book_notebooks, book_view, read_nb  # noqa: E402

SRC = ROOT / '_build' / 'book_src'
OUT = ROOT / '_build' / 'site'
SITE_HTML = OUT / '_build' / 'html'


def prepare() -> list[Path]:
    """Fill _build/book_src with the reader's view of the book; the notebooks written."""
    if SRC.exists():
        shutil.rmtree(SRC)
    (SRC / 'nbs').mkdir(parents=True)
    for name in ('_config.yml', '_toc.yml'):
        shutil.copy(ROOT / name, SRC / name)
    if IMAGES.exists():
        shutil.copytree(IMAGES, SRC / 'images')
    css = ROOT / 'nbs' / 'styles.css'
    if css.exists():
        (SRC / '_static').mkdir()
        shutil.copy(css, SRC / '_static' / 'styles.css')
    written = []
    for p in book_notebooks():
        dest = SRC / 'nbs' / p.name
        view = book_view(read_nb(p))
        dest.write_text(json.dumps(view, indent=1, ensure_ascii=False), encoding='utf-8')
        written.append(dest)
    return written


def main(argv=None) -> int:
    """Check the table of contents, prepare the sources, run jupyter-book; non-zero on failure."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--no-toc-check', action='store_true',
                    help='build even if _toc.yml is out of date')
    args = ap.parse_args(argv)
    if not args.no_toc_check:
        rc = subprocess.call([sys.executable, str(ROOT / 'tools' / 'toc.py'), '--check'])
        if rc:
            return rc
    nbs = prepare()
    print(f'prepared {len(nbs)} notebooks in {SRC.relative_to(ROOT)}', flush=True)
    jb = Path(sys.executable).with_name('jupyter-book')
    cmd = [str(jb) if jb.exists() else 'jupyter-book', 'build', str(SRC),
           '--path-output', str(OUT), '--all']
    rc = subprocess.call(cmd, cwd=ROOT)
    if rc:
        print(f'jupyter-book build failed (exit {rc})', file=sys.stderr)
        return rc
    if IMAGES.exists():  # raw-HTML <img src="../images/x.png"> in a page resolves too
        shutil.copytree(IMAGES, SITE_HTML / 'images', dirs_exist_ok=True)
    missing = [p.stem for p in nbs if not (SITE_HTML / 'nbs' / f'{p.stem}.html').exists()]
    if missing:
        print(f'jupyter-book wrote no page for: {", ".join(missing)}', file=sys.stderr)
        return 1
    print(f'site built: {SITE_HTML.relative_to(ROOT)}/nbs/index.html ({len(nbs)} pages)')
    return 0


if __name__ == '__main__':
    sys.exit(main())
