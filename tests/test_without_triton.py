"""Without Triton (macOS and Windows have no wheel): the package imports, the default engine runs
on the torch backend, and asking for the triton backend says what is missing and the way out.

A fresh Python with `sys.modules['triton'] = None`, which is what a machine without the package
looks like to the code: `import triton` fails and `importlib.util.find_spec('triton')` is None.
"""
import subprocess
import sys

import pytest

CHILD = r'''
import importlib, pkgutil, sys
sys.modules['triton'] = None                 # no triton to import, as on macOS and Windows
import petite_llm
from petite_llm import LLM, SamplingParams
from petite_llm.model.weights import smollm2_gguf_path
needs = []
for info in pkgutil.walk_packages(petite_llm.__path__, 'petite_llm.'):
    try:
        importlib.import_module(info.name)
    except ImportError:
        needs.append(info.name)
print('NEEDS', ' '.join(sorted(needs)))
llm = LLM(smollm2_gguf_path())
print('BACKEND', type(llm.engine.runner.backend).__name__)
outs = llm.generate(['The capital of France is'], SamplingParams(temperature=0, max_tokens=4),
                    use_tqdm=False)
print('TOKENS', len(outs[0].token_ids))
try:
    LLM(smollm2_gguf_path(), attention_backend='triton')
except ValueError as refusal:
    print('REFUSED', refusal)
'''

# the Triton kernels themselves, and what cannot be without them: nothing on the default path
NEED_TRITON = {'petite_llm.engine.attention_kernels', 'petite_llm.engine.fused',
               'petite_llm.engine.fused_moe', 'petite_llm.engine.kernel_compile',
               'petite_llm.engine.triton_backend'}


@pytest.fixture(scope='module')
def child():
    "What the fresh Python without Triton printed, by line tag."
    run = subprocess.run([sys.executable, '-c', CHILD], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return dict(line.split(' ', 1) for line in run.stdout.splitlines() if ' ' in line)


def test_only_the_kernels_need_triton(child):
    assert set(child['NEEDS'].split()) <= NEED_TRITON, child['NEEDS']
    assert 'petite_llm.engine.attention_kernels' in child['NEEDS'].split()   # triton is hidden


def test_the_default_engine_runs_on_the_torch_backend(child):
    assert child['BACKEND'] == 'TorchAttentionBackend'
    assert int(child['TOKENS']) == 4


def test_the_triton_backend_is_refused_with_the_way_out(child):
    assert 'Triton, which is not installed' in child['REFUSED']
    assert "attention_backend='torch'" in child['REFUSED']
