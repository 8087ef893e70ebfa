"""Without Triton (there are no wheels of it for macOS or Windows): torch and the package import,
the default engine answers on SmolLM2 on the torch backend, only the modules the README names need
Triton, and asking for the triton backend, in Python or on the command line, says what is missing
and the way out.

A fresh Python sets `sys.modules['triton'] = None` before it imports anything else: that is what a
machine without Triton shows the code, `import triton` and `import triton.language` fail with
ModuleNotFoundError and `importlib.util.find_spec('triton')` is None. (A `sys.meta_path` finder
that raises would make find_spec raise too, which no machine without Triton does: torch and
engine/loading.py ask find_spec.)
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

CHILD = r'''
import sys
sys.modules['triton'] = None                 # no triton to import, as on macOS and Windows
import contextlib, importlib, io, pkgutil
import torch
from torch.utils._triton import has_triton_package
print('TORCH_SEES_TRITON', has_triton_package())
import petite_llm
from petite_llm import LLM, SamplingParams
from petite_llm.cli.main import main
from petite_llm.model.weights import smollm2_gguf_path
print('PACKAGE', petite_llm.__file__)
llm = LLM(smollm2_gguf_path())                 # the default options
print('BACKEND', llm.engine.runner.backend.name)
outs = llm.generate(['The capital of France is'], SamplingParams(temperature=0, max_tokens=4),
                    use_tqdm=False)
print('TOKENS', len(outs[0].token_ids))
try:
    LLM(llm.engine.model, attention_backend='triton')
except ValueError as refusal:
    print('REFUSED', refusal)
err = io.StringIO()
with contextlib.redirect_stderr(err):
    status = main(['generate', '--attention-backend', 'triton', '--max-tokens', '2', 'Hi'])
print('CLI', status, [line for line in err.getvalue().splitlines() if 'error' in line][-1])
needs = {}
for info in pkgutil.walk_packages(petite_llm.__path__, 'petite_llm.'):
    try:
        importlib.import_module(info.name)
    except ImportError as e:
        needs[info.name] = e.name
print('NEEDS', ' '.join(f'{module}:{missing}' for module, missing in sorted(needs.items())))
'''


@pytest.fixture(scope='module')
def child():
    "What the fresh Python without Triton printed, by line tag."
    # this checkout's package, whichever one the environment has installed
    path = os.pathsep.join([str(ROOT), os.environ.get('PYTHONPATH', '')])
    run = subprocess.run([sys.executable, '-c', CHILD], capture_output=True, text=True,
                         timeout=300, env={**os.environ, 'PYTHONPATH': path})
    assert run.returncode == 0, run.stderr[-3000:]
    return dict(line.split(' ', 1) for line in run.stdout.splitlines() if ' ' in line)


def test_torch_imports_and_sees_no_triton(child):
    assert child['TORCH_SEES_TRITON'] == 'False'
    assert child['PACKAGE'].startswith(str(ROOT / 'petite_llm'))     # this checkout's package


def test_the_default_engine_runs_on_the_torch_backend(child):
    assert child['BACKEND'] == 'torch'
    assert int(child['TOKENS']) == 4


def test_only_the_modules_the_readme_names_need_triton(child):
    "Each module that does not import names triton as what is missing, and the README says so."
    needs = dict(pair.split(':') for pair in child['NEEDS'].split())
    readme = (ROOT / 'README.md').read_text(encoding='utf-8')
    section = readme.split('## Where it runs')[1].split('\n## ')[0]
    assert 'petite_llm.kernels.attention' in needs         # triton is hidden
    for module, missing in needs.items():
        assert missing.partition('.')[0] == 'triton', (module, missing)
        assert f"`{module.removeprefix('petite_llm.')}`" in section, module


def test_the_triton_backend_is_refused_with_the_way_out(child):
    assert 'Triton, which is not installed' in child['REFUSED']
    assert "attention_backend='torch'" in child['REFUSED']
    status, line = child['CLI'].split(' ', 1)
    assert status == '1'
    assert line.startswith('petite-llm generate: error: ') and 'not installed' in line
    assert '--attention-backend torch' in line
