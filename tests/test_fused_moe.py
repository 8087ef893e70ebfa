"""Chapter 23's fused-MoE fast path: `moe_align_block_size` lays the sorted assignments out in
tiles of one expert each, and `fused_experts` (two grouped-GEMM launches) equals the torch
reference `Experts.forward` for 4 to 128 experts, top-k 1 to 8 and 1 to 300 tokens, experts with
no token included: float32 and float64 to their rounding, float16 (and bfloat16, on a GPU: the
interpreter has no bfloat16 arithmetic) within a unit or two of the dtype's last place. Through
the engine's triton backend, an MoE model gives transformers' greedy tokens (float64).
What lets a CUDA graph capture it: its sizes follow from shapes alone (it runs on the `meta`
device, which has shapes and no values) and it reads nothing back to the host. With
`invariant=True` (the `fused_invariant` kernel of chapter 21's mode) it keeps one tile height for
every batch, and (on a GPU) a token's output is the same bits alone and in any batch.

Without a GPU the kernels run in Triton's interpreter (tests/conftest.py switches it on before
the kernel modules define them); shapes stay tiny, as each program instance costs milliseconds.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")        # before the kernels are defined

from dataclasses import replace

import pytest
from torch import nn

from petite_llm import LLM
# the registry's entries are registered by the modules that define them: chapter 21's too
from petite_llm.engine import batch_invariant, triton_backend  # noqa: F401
from petite_llm.engine.triton_backend import fused_stack
from petite_llm.kernels.fused_moe import moe_align_block_size, tile_height, topk_sum
from petite_llm.engine.loading import get_attention_backend
from petite_llm.model.moe import EXPERTS_KERNELS, Experts, experts_kernel, route
from petite_llm.model.quantization import Int8Experts
from host_reads import HostReads
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


@pytest.mark.parametrize("dtype, invariant", [
    (torch.float32, False), (torch.float16, False), (torch.float64, False),
    pytest.param(torch.bfloat16, False, marks=pytest.mark.gpu), (torch.float32, True)])
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_experts_equals_the_reference(shape, dtype, invariant):
    "Tiles by the batch (16 or 64 rows), or 64 rows always for batch-invariant experts."
    stack, x, weights, chosen = random_case(*shape, dtype)
    with torch.no_grad():
        ref = stack(x, weights, chosen)                             # [T, H]
        out = fused_stack(stack, x, weights, chosen, invariant)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    err = (out - ref).abs().max().item()
    assert err <= TOL[dtype] * ref.abs().max().item(), err


@pytest.mark.parametrize("shape", SHAPES[:4])
def test_align_sizes_follow_from_shapes_alone(shape):
    "On the meta device (shapes, no values) it runs, and gives the sizes it gives on real ids."
    num_experts, top_k, num_tokens = shape[:3]
    chosen = random_case(*shape, torch.float32)[3]
    for block_m in (16, 64):
        real = moe_align_block_size(chosen, block_m, num_experts)
        meta = moe_align_block_size(chosen.to('meta'), block_m, num_experts)
        assert [t.shape for t in meta] == [t.shape for t in real]
        numel = num_tokens * top_k                      # the worst case: every run padded
        assert real[0].numel() >= numel + min(num_experts, numel) * (block_m - 1)


def _refuse(*args):
    raise AssertionError("read back to the host")


def test_fused_experts_reads_nothing_back(monkeypatch):
    "No .item(), .tolist() or op of HostReads; the reference's bincount().tolist() is caught."
    stack, x, weights, chosen = random_case(16, 4, 20, 32, 16, torch.float32)
    with torch.no_grad():
        ref = stack(x, weights, chosen)
        monkeypatch.setattr(torch.Tensor, 'tolist', _refuse)
        monkeypatch.setattr(torch.Tensor, 'item', _refuse)
        with HostReads() as reads:
            out = fused_stack(stack, x, weights, chosen)
        assert reads.found == []
        with HostReads() as reads, pytest.raises(AssertionError, match='host'):
            stack(x, weights, chosen)
        assert reads.found == ['aten.bincount']
    assert (out - ref).abs().max() <= TOL[torch.float32] * ref.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_topk_sum_adds_in_slot_order(dtype):
    "Slot 0 + slot 1 + … in the accumulation dtype, rounded once: IEEE additions, exactly."
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    # big + small rounds back to big in the accumulation dtype: in slot order small is lost
    big, small = {torch.float16: (6e4, 2.0 ** -24), torch.float32: (2.0 ** 30, 1.0),
                  torch.float64: (2.0 ** 60, 1.0)}[dtype]
    x = torch.randn(7, 3, 40, dtype=dtype)
    x[0, :, 0] = torch.tensor([big, small, -big])
    x = x.to(DEVICE)
    want = (x[:, 0].to(acc) + x[:, 1].to(acc) + x[:, 2].to(acc)).to(dtype)
    out = topk_sum(x)
    assert torch.equal(out, want) and out[0, 0].item() == 0.0
    assert torch.equal(topk_sum(x[:, :1]), x[:, 0])


def test_batch_invariant_experts_take_one_tile_height():
    "Plain stacks: 16-row tiles for a decode's few rows, 64 for a prefill; invariant ones: 64."
    assert [tile_height(8, n) for n in (1, 32, 33, 600)] == [16, 16, 64, 64]
    assert [tile_height(8, n, invariant=True) for n in (1, 32, 33, 600)] == [64] * 4


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_batch_invariant_fused_experts_keep_a_tokens_bits(dtype):
    """A token alone, then at other places in batches of other sizes (experts shared): the same
    bits. Compiled, a tile's product computes each of its rows alike; the interpreter's NumPy
    matmul need not (a row can round differently at another place of a tile), hence the GPU."""
    stack, x, weights, chosen = random_case(8, 2, 150, 32, 16, dtype)
    fused = EXPERTS_KERNELS['fused_invariant'].run
    with torch.no_grad():
        alone = fused(stack, x[:1], weights[:1], chosen[:1])[0]
        for others in [range(1, 3), range(1, 150), range(5, 40), range(149, 150)]:
            batch = torch.tensor([others[0], 0, *others[1:]], device=DEVICE)   # token 0 second
            out = fused(stack, x[batch], weights[batch], chosen[batch])
            assert torch.equal(out[1], alone), others


@pytest.mark.parametrize('case', ['qwen3-norm', 'qwen2-shared'])
def test_engine_triton_backend_gives_transformers_greedy_tokens(checkpoints, case, monkeypatch):
    "Fused attention and fused experts (Triton's interpreter on a CPU), float64, as test_moe."
    path, hf = checkpoints[case]
    kernel, calls = EXPERTS_KERNELS['fused'], []

    def counted(stack, x, *args):
        calls.append(x.shape[0])                                 # the step's token count
        return kernel.run(stack, x, *args)
    monkeypatch.setitem(EXPERTS_KERNELS, 'fused', replace(kernel, run=counted))
    batch = prompts(VOCAB, [3, 9], seed=8)
    llm = LLM(path, dtype=torch.float64, block_size=4, max_num_batched_tokens=16,
              kv_cache_memory=_pool(path, 64), attention_backend='triton')
    assert isinstance(llm.engine.runner.backend, triton_backend.TritonAttentionBackend)
    assert _engine_tokens(llm, batch, 5) == [hf_greedy(hf, p, 5) for p in batch]
    assert 12 in calls and 2 in calls                            # the prefill and the decodes


@pytest.mark.parametrize('invariant', [False, True])
@pytest.mark.parametrize('backend', ['torch', 'triton'])
def test_each_backend_gets_an_experts_kernel_it_can_run(backend, invariant):
    """The registry's rule: the backend's own kernel for float stacks (fused, capturable), the
    reference or one token at a time for int8 ones; an invariant kernel iff the backend is."""
    engine_backend = get_attention_backend(backend, 'cpu', batch_invariant=invariant)
    stack = random_case(4, 2, 1, 16, 16, torch.float32)[0]
    for stack, fused in [(stack, backend == 'triton'), (Int8Experts.from_experts(stack), False)]:
        kernel = EXPERTS_KERNELS[experts_kernel(stack, engine_backend)]
        assert kernel.invariant == invariant and kernel.capturable == fused
        assert kernel.backend == ('triton' if fused else None)
