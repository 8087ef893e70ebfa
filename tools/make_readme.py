"""Generate README.md from nbs/index.ipynb (`make readme`); `--check` fails when README.md is stale.

nbconvert's MarkdownExporter on the reader's view of the notebook (`#|` lines stripped, `#| hide`
cells dropped); links to chapters and images are rewritten to work from the top of the repository.
"""
from __future__ import annotations

import argparse
import difflib
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nbtools import NBS, ROOT, book_view, read_nb, settings  # noqa: E402

README = ROOT / 'README.md'
HEADER = ('<!-- Generated from nbs/index.ipynb by `make readme`; '
          'edit the notebook, not this file. -->\n\n')


def readme_text() -> str:
    """README.md's text as generated from the landing page notebook."""
    import nbformat
    from nbconvert import MarkdownExporter

    nb = nbformat.from_dict(book_view(read_nb(NBS / settings().get('readme_nb', 'index.ipynb'))))
    exporter = MarkdownExporter(exclude_input_prompt=True, exclude_output_prompt=True)
    body, _ = exporter.from_notebook_node(nb)
    body = re.sub(r'\]\((\d+_[^)\s]+\.ipynb)', r'](nbs/\1', body)  # chapter links live in nbs/
    body = body.replace('](../images/', '](images/')
    body = re.sub(r'\n{3,}', '\n\n', body).strip() + '\n'
    return HEADER + body


def main(argv=None) -> int:
    """Write README.md, or with --check fail (with a diff) where it differs from what is made."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--check', action='store_true')
    args = ap.parse_args(argv)
    new = readme_text()
    if args.check:
        old = README.read_text(encoding='utf-8') if README.exists() else ''
        if old != new:
            sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), new.splitlines(True),
                                                       'README.md',
                                                       'generated from nbs/index.ipynb'))
            print('\nREADME.md is out of date with nbs/index.ipynb: '
                  'run `make readme` and commit it.')
            return 1
        print('README.md is in sync with nbs/index.ipynb')
        return 0
    README.write_text(new, encoding='utf-8')
    print('wrote README.md from nbs/index.ipynb')
    return 0


if __name__ == '__main__':
    sys.exit(main())
