"""Chapter 22's fused-MoE fast path: `moe_align_block_size` lays the sorted assignments out in
tiles of one expert each, and `fused_experts` (two grouped-GEMM launches) equals the torch
reference `Experts.forward` for 4 to 128 experts, top-k 1 to 8 and 1 to 300 tokens, experts with
no token included: float32 and float64 to their rounding, float16 (and bfloat16, on a GPU: the
interpreter has no bfloat16 arithmetic) within a unit or two of the dtype's last place. Through
the engine's triton backend, an MoE model gives transformers' greedy tokens (float64).

Without a GPU the kernels run in Triton's interpreter (tests/conftest.py switches it on before
the kernel modules define them); shapes stay tiny, as each program instance costs milliseconds.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")        # before the kernels are defined

import pytest
from torch import nn

from petite_llm import LLM
from petite_llm.engine import triton_backend
from petite_llm.engine.fused_moe import fused_experts, moe_align_block_size
from petite_llm.model.moe import Experts, route
from test_moe import VOCAB, _engine_tokens, _pool, checkpoints  # noqa: F401 (a fixture)
from test_parity import hf_greedy, prompts

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = pytest.mark.usefixtures("one_thread")

# (experts, top-k, tokens, hidden, intermediate): decode and prefill shapes, odd widths (masked
# tiles), and routings that leave most experts without a token (128 experts, 1 to 3 tokens)
SHAPES = [(4, 1, 1, 16, 16), (4, 4, 300, 32, 24), (8, 2, 5, 48, 16), (16, 8, 64, 16, 64),
          (60, 4, 300, 64, 32), (128, 8, 1, 32, 16), (128, 8, 300, 16, 16), (128, 1, 3, 32, 48),
          (32, 6, 100, 40, 24)]
# a multiple of the reference's magnitude: float32 and float64 differ only in the order of sums
TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def random_case(num_experts, top_k, num_tokens, hidden, intermediate, dtype, seed=0):
    "Unit-scale stacked experts, x [T, H], and a random router's (weights, expert ids) [T, k]."
    g = torch.Generator().manual_seed(seed)
    stack = Experts(num_experts, hidden, intermediate)
    with torch.no_grad():
        stack.gate_up_proj.copy_(torch.randn(stack.gate_up_proj.shape, generator=g) / hidden**.5)
        stack.down_proj.copy_(torch.randn(stack.down_proj.shape, generator=g) / intermediate**.5)
    stack.to(DEVICE, dtype)
    x = torch.randn(num_tokens, hidden, generator=g).to(DEVICE, dtype)
    logits = torch.randn(num_tokens, num_experts, generator=g).to(DEVICE, dtype)
    return stack, x, *route(logits, top_k, norm_topk_prob=True)


@pytest.mark.parametrize("block_m", [4, 16])
@pytest.mark.parametrize("shape", SHAPES)
def test_align_tiles_hold_one_expert_each_and_every_assignment_once(shape, block_m):
    num_experts, top_k, num_tokens = shape[:3]
    _, _, _, chosen = random_case(*shape, torch.float32)
    sorted_ids, tile_experts, num_padded = moe_align_block_size(chosen, block_m, num_experts)
    numel, used = chosen.numel(), num_padded.item()
    flat = chosen.flatten().cpu()
    rows = sorted_ids[:used].cpu()
    assert sorted_ids.numel() % block_m == 0 and used % block_m == 0
    assert tile_experts.numel() == sorted_ids.numel() // block_m
    assert sorted(rows[rows < numel].tolist()) == list(range(numel))    # each exactly once
    assert (sorted_ids[used:] == numel).all()                          # the rest is padding
    for tile in range(used // block_m):
        ids = rows[tile * block_m:(tile + 1) * block_m]
        ids = ids[ids < numel]
        assert len(ids) > 0                                # no tile is padding only
        assert (flat[ids] == tile_experts[tile].item()).all()
    counts = torch.bincount(flat, minlength=num_experts)
    assert used == sum(-(-int(c) // block_m) * block_m for c in counts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64,
                                   pytest.param(torch.bfloat16, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_experts_equals_the_reference(shape, dtype):
    stack, x, weights, chosen = random_case(*shape, dtype)
    with torch.no_grad():
        ref = stack(x, weights, chosen)                             # [T, H]
        out = fused_experts(stack, x, weights, chosen)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    err = (out - ref).abs().max().item()
    assert err <= TOL[dtype] * ref.abs().max().item(), err



@pytest.mark.parametrize('case', ['qwen3-norm', 'qwen2-shared'])
def test_engine_triton_backend_gives_transformers_greedy_tokens(checkpoints, case, monkeypatch):
    "Fused attention and fused experts (Triton's interpreter on a CPU), float64, as test_moe."
    path, hf = checkpoints[case]
    calls = []

    def counted(*args):
        calls.append(args[1].shape[0])                           # the step's token count
        return fused_experts(*args)
    monkeypatch.setattr(triton_backend, 'fused_experts', counted)
    batch = prompts(VOCAB, [3, 9], seed=8)
    llm = LLM(path, dtype=torch.float64, block_size=4, max_num_batched_tokens=16,
              kv_cache_memory=_pool(path, 64), attention_backend='triton')
    assert isinstance(llm.engine.runner.body, triton_backend.FusedModelBody)
    assert _engine_tokens(llm, batch, 5) == [hf_greedy(hf, p, 5) for p in batch]
    assert 12 in calls and 2 in calls                            # the prefill and the decodes
