"""make test's AVX2 stage: the package's CPU-specific paths at the vector level of most laptops.

On a CPU with AVX-512 this runs Python under Debian's qemu-user emulating a Haswell (AVX2, FMA,
F16C; no AVX-512), so that every op checks an AVX2 CPU's own feature flags, as it would on a
reader's laptop; on a CPU without AVX-512 the native stages of `make test` already run at that
level, and this says so and stops. Under the emulation (importing torch takes about 25 s there)
one Python runs:
- the tests marked `cpu_paths`: the one place that answers for the CPU (`model/cpu.py`), the int8
  kernel, packing refused and its fallback, PyTorch's int4 kernel on GGUF's 4-bit blocks, the
  default engine answering on SmolLM2;
- each chapter's cells marked `cpu_paths` in their metadata, with every exported or hidden cell
  before them (the definitions and imports they stand on), as the chapter would run them.
`python tools/avx2_stage.py` runs it; `--inside` is the part that runs under the emulation.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nbtools import NBS, ROOT, directives, read_nb, source, split_directives  # noqa: E402

# the files whose tests carry the `cpu_paths` marker
TEST_FILES = ['tests/test_cpu.py', 'tests/test_quantization.py', 'tests/test_quantized.py']
CPU = 'Haswell'                               # AVX2, FMA, F16C; no AVX-512, no AVX-NE-CONVERT


def host_has_avx512() -> bool:
    "Whether this CPU has AVX-512 (then the stage emulates one without)."
    flags = Path('/proc/cpuinfo').read_text().split() if Path('/proc/cpuinfo').exists() else []
    return 'avx512f' in flags


def marked(cell: dict) -> bool:
    "A chapter cell that takes a CPU-specific path, marked for this stage."
    return bool(cell.get('metadata', {}).get('petite_llm', {}).get('cpu_paths'))


def stage_cells(nb: dict) -> list[dict]:
    "The marked code cells, and every exported or hidden code cell before the last of them."
    cells = [c for c in nb['cells'] if c['cell_type'] == 'code']
    last = max((i for i, c in enumerate(cells) if marked(c)), default=-1)
    return [c for i, c in enumerate(cells[:last + 1])
            if marked(c) or {'export', 'exports', 'hide'} & directives(c).keys()]


def run_chapter(path: Path) -> int:
    "Run a chapter's stage cells in one namespace, from nbs/ as the book does; how many ran."
    cells = stage_cells(read_nb(path))
    namespace = {'__name__': '__main__'}
    cwd = os.getcwd()
    os.chdir(NBS)
    try:
        for cell in cells:
            exec(compile(split_directives(source(cell))[1], f'{path.name}', 'exec'), namespace)
    finally:
        os.chdir(cwd)
    return sum(marked(c) for c in cells)


def inside() -> int:
    "The stage itself, under the emulation: the marked tests, then the marked chapter cells."
    import pytest
    import torch
    from petite_llm.model.cpu import cpu_support
    print(f"emulated CPU: {cpu_support()}", flush=True)
    if torch.backends.cpu.get_cpu_capability() != 'AVX2' or cpu_support().native_bf16:
        print("the emulation is not at the AVX2 level: nothing here would test it")
        return 1
    if rc := pytest.main(['-q', '-p', 'no:cacheprovider', '-m', 'cpu_paths', *TEST_FILES]):
        return rc
    for path in sorted(NBS.glob('*.ipynb')):
        if any(marked(c) for c in read_nb(path)['cells']):
            start = time.perf_counter()
            print(f"{path.name}: {run_chapter(path)} marked cells ran "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
    return 0


def main() -> int:
    "Emulate an AVX2 CPU where this one has AVX-512; say why not otherwise."
    if '--inside' in sys.argv:
        return inside()
    if not host_has_avx512():
        print("this CPU has no AVX-512: the native stages already ran at its vector level")
        return 0
    qemu = shutil.which('qemu-x86_64')
    if qemu is None:
        print("qemu-x86_64 is missing: install Debian's qemu-user (make debian-packages)")
        return 1
    env = {**os.environ, 'TRITON_INTERPRET': '1', 'PYTHONPATH': str(ROOT)}
    run = subprocess.run([qemu, '-cpu', CPU, sys.executable, __file__, '--inside'], env=env,
                         cwd=ROOT, stderr=subprocess.PIPE, text=True)
    # qemu warns once per CPUID feature its TCG lacks (pcid, x2apic, ...): not our business
    sys.stderr.write(''.join(line for line in run.stderr.splitlines(keepends=True)
                             if "TCG doesn't support requested feature" not in line))
    return run.returncode


if __name__ == '__main__':
    sys.exit(main())
