"""Batch invariance (chapter 21) for mixture-of-experts models (chapter 23): with
batch_invariant=True a prompt's tokens and logits are the same bits alone and inside batches of
other sizes and compositions, chunked by other step budgets, for Qwen3-MoE and Qwen2-MoE (its
shared expert). On the torch backend every stack (float, int8, or in bfloat16 on a CPU whose
oneDNN computes it `PackedExperts`) runs chapter 21's `one_token_at_a_time` kernel (one token per
product); on the triton backend float stacks run the fused-MoE kernel `fused_invariant`, with one
tile height and the top-k sum in slot order (its bits checked on a GPU). Both give transformers' greedy tokens in
float64 (the triton backend in Triton's interpreter on a CPU). Every product, sum and layout is
the same whatever the batch, so bit equality is what the mode guarantees, not one machine's
behaviour; and on any CPU, whatever its library does with other shapes, every matrix product of
an invariant step is checked to take one row.
"""
from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from petite_llm import LLM, SamplingParams
# the modules that register the invariant experts kernels: the torch backend's, the triton one's
from petite_llm.engine import batch_invariant, triton_backend  # noqa: F401
from petite_llm.model.moe import EXPERTS_KERNELS, SparseMoeBlock
from test_moe import VOCAB, _engine_tokens, _pool, checkpoints  # noqa: F401 (a fixture)
from test_parity import hf_greedy, prompts

pytestmark = pytest.mark.usefixtures("one_thread")

CASES = ['qwen3-norm', 'qwen2-shared']
TARGET = prompts(VOCAB, [13], seed=11)[0]
OTHERS = prompts(VOCAB, [5, 21, 9, 2, 17, 30], seed=12)
# (step budget, the batch around TARGET): alone, beside one, in the middle of five, last of
# seven; small budgets chunk the prompts differently
BATCHES = [(64, [TARGET]), (8, [TARGET, OTHERS[0]]),
           (16, OTHERS[1:3] + [TARGET] + OTHERS[3:5]), (64, OTHERS + [TARGET])]


def _llm(path, backend, dtype, budget=64, **options):
    return LLM(path, dtype=dtype, batch_invariant=True, attention_backend=backend, block_size=4,
               max_num_batched_tokens=budget, kv_cache_memory=_pool(path, 256), **options)


def _blocks(llm):
    "The sparse blocks of the engine's model."
    return [layer.mlp for layer in llm.engine.model.model.layers
            if isinstance(layer.mlp, SparseMoeBlock)]


def _target_run(path, backend, dtype, budget, batch, record_logits, max_tokens, **options):
    "TARGET's tokens and its rows of logits [n, V] when it runs inside batch."
    llm = _llm(path, backend, dtype, budget, **options)
    rows = record_logits(llm)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(batch, params, use_tqdm=False)
    return outs[batch.index(TARGET)].token_ids, torch.stack(rows[tuple(TARGET)])


# the triton backend on a GPU only: compiled, a tile's product computes each of its rows alike,
# while the interpreter's NumPy matmul may round a row differently at another place of a tile
@pytest.mark.parametrize('quantization', [None, 'int8'])
@pytest.mark.parametrize('backend', ['torch', pytest.param('triton', marks=pytest.mark.gpu)])
@pytest.mark.parametrize('case', CASES)
def test_a_prompt_keeps_its_tokens_and_logits_in_any_batch(checkpoints, case, backend,
                                                          quantization, record_logits):
    "bfloat16 (int8 experts too): TARGET alone, beside one, among five, last of seven."
    path, max_tokens = checkpoints[case][0], 6
    runs = [_target_run(path, backend, torch.bfloat16, budget, batch, record_logits,
                        max_tokens, quantization=quantization) for budget, batch in BATCHES]
    (tokens, logits), others = runs[0], runs[1:]
    assert logits.shape[0] == max_tokens
    for other_tokens, other_logits in others:
        assert other_tokens == tokens
        assert torch.equal(other_logits, logits)


@pytest.mark.parametrize('backend', ['torch', 'triton'])
@pytest.mark.parametrize('case', CASES)
def test_greedy_tokens_are_transformers(checkpoints, case, backend, monkeypatch):
    "float64, chunked prompts: transformers' tokens, through the backend's invariant kernel."
    path, hf = checkpoints[case]
    name = {'torch': 'one_token_at_a_time', 'triton': 'fused_invariant'}[backend]
    kernel, calls = EXPERTS_KERNELS[name], []

    def counted(stack, x, *args):
        calls.append(x.shape[0])                                # the step's token count
        return kernel.run(stack, x, *args)
    monkeypatch.setitem(EXPERTS_KERNELS, name, replace(kernel, run=counted))
    batch = [TARGET, OTHERS[0]] if backend == 'triton' else [TARGET] + OTHERS[:3]
    llm = _llm(path, backend, torch.float64, budget=16)
    blocks = _blocks(llm)
    assert blocks and all(block.experts_kernel == name for block in blocks)
    assert _engine_tokens(llm, batch, 5) == [hf_greedy(hf, p, 5) for p in batch]
    assert calls and max(calls) > 1                             # prefill chunks ran through it


# 2-D matrix products, and which argument holds the activations' rows
PRODUCTS = {'mm': 0, 'addmm': 1, 'linear': 0, 'matmul': 0, 'mkldnn_linear': 0,
            '_linear_pointwise': 0, '_weight_int8pack_mm': 0}


class ProductRows(TorchDispatchMode):
    "Records how many rows of activations each 2-D matrix product is handed."
    def __init__(self):
        super().__init__()
        self.rows = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split('.')[0]
        if name in PRODUCTS:
            x = args[PRODUCTS[name]]
            self.rows.add(x.reshape(-1, x.shape[-1]).shape[0])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize('case', CASES)
def test_every_product_of_an_invariant_step_has_one_row(checkpoints, case):
    "CPU, torch backend: the linears and each expert's products take one row; the plain ones not."
    path = checkpoints[case][0]

    def product_rows(invariant):
        llm = LLM(path, dtype=torch.bfloat16, device='cpu', batch_invariant=invariant,
                  kv_cache_memory=_pool(path, 256))
        with ProductRows() as log:
            _engine_tokens(llm, OTHERS, 2)
        return log.rows
    assert product_rows(True) == {1}
    assert max(product_rows(False)) > 1
