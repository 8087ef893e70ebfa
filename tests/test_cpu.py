"""Every CPU-dependent choice reads `cpu_support()` (chapter 15), and it answers what the ops ask.

- oneDNN's packed bfloat16 linear packs exactly where `cpu_support().onednn_bf16` says yes: the
  check is the op's own, not a stand-in such as the vector level torch reports;
- the default dtype, packing and `PackedLinear` follow that answer on any CPU (another CPU's
  answer is given by replacing `cpu_support` where it is read);
- a GPU that emulates bfloat16 (a T4) runs float16 by default;
- the default engine answers on SmolLM2 with what this CPU picks.
"""
import pytest
import torch
from torch import nn

from petite_llm.engine import loading
from petite_llm.model import cpu
from petite_llm.model.cpu import CpuSupport, cpu_support
from petite_llm.model.layers import linear
from petite_llm.model.layers.linear import PackedLinear, packed_linear_available, prepack_linears
from petite_llm.model.quantized import Int4Linear, int4_kernel_available

pytestmark = pytest.mark.cpu_paths           # all of them run on an emulated AVX2 CPU too


def packs(dtype) -> bool:
    "Whether oneDNN's reorder, the op PackedLinear calls, takes a weight of dtype here."
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.ones(8, 16, dtype=dtype), 1)
        return True
    except RuntimeError:
        return False


def test_the_answer_is_the_ops_own():
    support = cpu_support()
    assert support is cpu_support()                       # asked once per process
    assert support.onednn_bf16 == (support.onednn and packs(torch.bfloat16))
    assert packed_linear_available(torch.bfloat16) == support.onednn_bf16
    assert packed_linear_available(torch.float32) == support.onednn
    assert support.name in str(support)
    if support.native_bf16:                     # AMX and AVX512-BF16 CPUs have AVX-512 BW/VL/DQ
        assert support.onednn_bf16 or not support.onednn


def another_cpu(native=None, onednn_bf16=False):
    "A CPU's answer: native bf16 ('AMX', 'AVX512-BF16' or None) and oneDNN's bf16."
    return CpuSupport('a reader CPU', 'AVX2', native, True, onednn_bf16)


@pytest.mark.parametrize('native,onednn_bf16,want', [
    ('AMX', True, torch.bfloat16), ('AVX512-BF16', True, torch.bfloat16),
    (None, True, torch.bfloat16), (None, False, torch.float32)],
    ids=['amx', 'avx512-bf16', 'avx512-or-avx-ne-convert', 'avx2'])
def test_default_dtype_follows_what_the_cpu_computes(monkeypatch, native, onednn_bf16, want):
    "bfloat16 where the CPU multiplies it or oneDNN widens it; float32 where neither does."
    monkeypatch.setattr(loading, 'cpu_support', lambda: another_cpu(native, onednn_bf16))
    assert loading.default_dtype('cpu') == want
    assert loading.native_bf16('cpu') == native


def test_without_onednn_bf16_nothing_is_packed(monkeypatch):
    "A bf16 model on such a CPU keeps its nn.Linears and runs; PackedLinear says why it refuses."
    monkeypatch.setattr(linear, 'cpu_support', another_cpu)
    model = nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 4)).to(torch.bfloat16)
    assert prepack_linears(model) == 0
    assert all(isinstance(layer, nn.Linear) for layer in model)
    assert model(torch.ones(2, 16, dtype=torch.bfloat16)).shape == (2, 4)
    with pytest.raises(ValueError, match='oneDNN packs no torch.bfloat16 weight.*a reader CPU'):
        PackedLinear(model[0].weight)


def test_a_gpu_that_emulates_bfloat16_runs_float16(monkeypatch):
    "A T4: PyTorch says it supports bfloat16 (by emulation); the default asks for hardware."
    monkeypatch.setattr(torch.cuda, 'is_bf16_supported',
                        lambda including_emulation=True: including_emulation)
    assert loading.native_bf16('cuda') is None
    assert loading.default_dtype('cuda') == torch.float16
    monkeypatch.setattr(torch.cuda, 'is_bf16_supported', lambda including_emulation=True: True)
    assert loading.default_dtype('cuda') == torch.bfloat16


def test_the_module_is_the_one_place():
    "The package asks torch about the CPU in petite_llm/model/cpu.py only."
    from pathlib import Path
    root = Path(cpu.__file__).parent.parent
    probes = ('_is_mkldnn_bf16_supported', '_is_avx512_bf16_supported', '_is_amx_tile_supported',
              'get_cpu_capability', '/proc/cpuinfo')
    askers = {path.relative_to(root).as_posix() for path in root.rglob('*.py')
              for probe in probes if probe in path.read_text()}
    assert askers == {'model/cpu.py', 'model/config.py'}, askers


def test_the_default_engine_answers_on_smollm2():
    "The default model and options, as `make demo` runs them: this CPU's dtype, packed or not."
    from petite_llm import LLM, SamplingParams
    from petite_llm.model.weights import smollm2_gguf_path
    llm = LLM(smollm2_gguf_path())
    model = llm.engine.model
    assert next(model.parameters()).dtype == loading.default_dtype('cpu')
    packed = any(isinstance(m, PackedLinear) for m in model.modules())
    assert packed == (loading.default_dtype('cpu') == torch.bfloat16 and cpu_support().onednn_bf16)
    # the Q4_1 projections stay packed where PyTorch's int4 kernel is vectorized for the dtype
    int4 = any(isinstance(m, Int4Linear) for m in model.modules())
    assert int4 == int4_kernel_available(loading.default_dtype('cpu'))
    question = [{'role': 'user', 'content': 'What is the capital of France?'}]
    out = llm.chat(question, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert 'Paris' in out[0].text
