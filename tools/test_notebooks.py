"""make test's notebook stage: what `nbdev_test` runs, with the longest notebooks started first.

`nbdev_test` (nbdev 2.4) hands the notebooks to its workers in name order, so the book's longest
chapters, which come late (16 to 19), start last and one worker ends running them alone. This runs
the same `nbdev.test.test_nb` on the same notebooks, with settings.ini's flags (cells flagged
slow or gpu skipped) and nbdev_test's pool of workers, in the order LONGEST_FIRST gives, the other
notebooks after them by name. It prints nbdev_test's "Success." or the notebooks that failed, then
each notebook's seconds; it exits non-zero when one failed.
"""
from __future__ import annotations

import sys

from fastcore.parallel import num_cpus, parallel
from fastcore.xtras import working_directory
from nbdev.config import get_config
from nbdev.doclinks import nbglob
from nbdev.test import test_nb

# the longest on two CPU cores (nbdev_test --timing, and the cells' own times), longest first
LONGEST_FIRST = ['17_server.ipynb', '16_speculative.ipynb', '18_benchmarks.ipynb',
                 '19_quantization.ipynb', '15_engine_performance.ipynb',
                 '13_triton_kernels.ipynb', '20_tensor_parallel.ipynb', '14_engine.ipynb',
                 '10_kv_cache.ipynb', '06_weights.ipynb', '09_generate.ipynb']


def main() -> int:
    "Run every notebook nbdev_test would, longest first; 0 when all passed."
    cfg = get_config()
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    files = sorted((f.absolute() for f in nbglob(as_path=True, symlinks=False)),
                   key=lambda f: (rank.get(f.name, len(rank)), f.name))
    with working_directory(cfg.nbs_path):
        results = parallel(test_nb, files, skip_flags=cfg.tst_flags.split(), force_flags=[],
                           n_workers=min(num_cpus(), 8), basepath=cfg.config_path, pause=0.01)
    failed = [f.name for f, (passed, _) in zip(files, results) if not passed]
    if failed:
        print("nbdev Tests Failed On The Following Notebooks:", *failed, sep='\n\t',
              file=sys.stderr)
    else:
        print("Success.")
    for f, (_, seconds) in sorted(zip(files, results), key=lambda fr: -fr[1][1]):
        print(f"{f.name}: {seconds:.0f} s")
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
