"""Chapter 13's fused decode path: qk_norm_rope_store against chapters 01, 02 and 11, silu_and_mul
against chapter 04, fused_add_rms_norm without a residual, and the engine's fused layer ops on the
`triton` backend against transformers (greedy tokens in float64) and in kernel launches.

Without a GPU the kernels run in Triton's interpreter (tests/conftest.py switches it on before
the kernel modules define them); shapes stay small, as each program instance costs
milliseconds.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")        # before the kernels are defined

import pytest
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings, strategies as st

from petite_llm.engine.backends import store_kv
from petite_llm.bench.host import launches_per_layer
from petite_llm.engine.llm_engine import LLMEngine
from petite_llm.kernels.fused import fused_add_rms_norm, qk_norm_rope_store, silu_and_mul
from petite_llm.engine.triton_backend import TritonAttentionBackend, cos_sin_cache
from petite_llm.model.qwen3 import LayerKernels
from petite_llm.model.layers.norm import RMSNorm
from petite_llm.model.layers.rope import RotaryEmbedding
from petite_llm.model.sampling_params import SamplingParams
from test_parity import hf_greedy, make_checkpoint, prompts

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FEW = settings(max_examples=25, deadline=None, derandomize=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

pytestmark = pytest.mark.usefixtures("one_thread")


def reference(qkv, positions, rotary, norms, num_heads, kv_cache, slot_mapping):
    "Chapter 03's steps (split, QK-norm, RoPE), then chapter 11's store_kv: q [T, nh, hd]."
    T = qkv.shape[0]
    num_kv_heads, head_dim = kv_cache[0].shape[2:]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim,
                         num_kv_heads * head_dim], dim=-1)
    q, k, v = (x.reshape(T, -1, head_dim) for x in (q, k, v))
    if norms is not None:
        q, k = norms[0](q), norms[1](k)
    q, k = rotary(positions, q, k)
    store_kv(k, v, *kv_cache, slot_mapping)
    return q


def qk_inputs(T, num_heads, num_kv_heads, head_dim, dtype, seed, max_position=64):
    "Random qkv [T, (nh + 2 nkv) hd], positions, slots (some -1), QK-norms and an empty pool."
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(T, (num_heads + 2 * num_kv_heads) * head_dim, generator=g) * 3)
    positions = torch.randint(0, max_position, (T,), generator=g)
    num_slots = 2 * T + 3
    slot_mapping = torch.randperm(num_slots, generator=g)[:T]
    slot_mapping[torch.rand(T, generator=g) < 0.3] = -1                      # padding
    norms = [RMSNorm(head_dim) for _ in range(2)]
    with torch.no_grad():
        for norm in norms:
            norm.weight.copy_(1 + 0.3 * torch.randn(head_dim, generator=g))
    pool = torch.zeros(num_slots, 1, num_kv_heads, head_dim, dtype=dtype, device=DEVICE)
    return (qkv.to(dtype).to(DEVICE), positions.to(DEVICE), slot_mapping.to(DEVICE),
            [n.to(DEVICE, dtype) for n in norms], pool)


@FEW
@given(head_dim=st.sampled_from([8, 16, 48, 80]), num_kv_heads=st.integers(1, 3),
       group=st.integers(1, 3), T=st.integers(1, 6), qk_norm=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.float64]),
       seed=st.integers(0, 2**16))
def test_qk_norm_rope_store_matches_chapters_01_02_11(head_dim, num_kv_heads, group, T, qk_norm,
                                                      dtype, seed):
    "RoPE and the store bit for bit; with QK-norm within 4 units in the last place of the norm."
    num_heads = group * num_kv_heads
    qkv, positions, slots, norms, pool = qk_inputs(T, num_heads, num_kv_heads, head_dim, dtype,
                                                   seed)
    rotary = RotaryEmbedding(head_dim, rope_theta=1e4 + seed, max_position=64).to(DEVICE)
    ref_cache, cache = (pool.clone(), pool.clone()), (pool.clone(), pool.clone())
    weights = (norms[0].weight, norms[1].weight, norms[0].eps) if qk_norm else ()
    with torch.no_grad():
        expected = reference(qkv, positions, rotary, norms if qk_norm else None, num_heads,
                             ref_cache, slots)
        q = qk_norm_rope_store(qkv, positions, cos_sin_cache(rotary, dtype), *cache, slots,
                               num_heads, *weights)
    assert q.shape == (T, num_heads, head_dim) and q.dtype == dtype
    assert torch.equal(cache[1], ref_cache[1])                 # v copied, padding skipped
    if not qk_norm:
        assert torch.equal(q, expected) and torch.equal(cache[0], ref_cache[0])
        return
    # the mean of squares sums in another order than torch's, and rsqrt is another
    # implementation: a normalised value may move by a unit in the last place (of float32 for
    # float64, whose statistics chapter 01 takes in float32), which RoPE's sum can double
    ulp = torch.finfo(torch.float32 if dtype == torch.float64 else dtype).eps
    for out, ref in ((q, expected), (cache[0], ref_cache[0])):
        torch.testing.assert_close(out, ref, rtol=0, atol=4 * ulp * ref.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_qk_norm_rope_store_rounds_after_every_op(dtype):
    "Torch's rounding, not one rounding of an exact rotation: a check that tells the two apart."
    qkv, positions, slots, _, pool = qk_inputs(64, 4, 2, 16, dtype, seed=1)
    rotary = RotaryEmbedding(16, max_position=64).to(DEVICE)
    ref_cache = (pool.clone(), pool.clone())
    with torch.no_grad():
        expected = reference(qkv, positions, rotary, None, 4, ref_cache, slots)
        q = qk_norm_rope_store(qkv, positions, cos_sin_cache(rotary, dtype), pool, pool.clone(),
                               slots, 4)
    x = qkv[:, :4 * 16].reshape(64, 4, 16).double()
    cos, sin = (t.double()[:, None] for t in rotary.cos_sin(positions, dtype))
    x1, x2 = x.chunk(2, dim=-1)
    once = (x * cos + torch.cat((-x2, x1), dim=-1) * sin).to(dtype)         # rounded once
    assert torch.equal(q, expected)
    assert (once != expected).any()


def test_cos_sin_cache_holds_chapter_02s_values():
    rotary = RotaryEmbedding(48, rope_theta=1e6, max_position=300).to(DEVICE)
    positions = torch.tensor([0, 1, 77, 299], device=DEVICE)
    for dtype in (torch.float32, torch.float16, torch.float64):
        table = cos_sin_cache(rotary, dtype)
        cos, sin = rotary.cos_sin(positions, dtype)                           # each [4, 48]
        assert table.shape == (300, 48) and table.dtype == dtype
        assert torch.equal(table[positions], torch.cat((cos[:, :24], sin[:, :24]), dim=-1))
        assert torch.equal(cos[:, :24], cos[:, 24:])                # why half a row suffices


@FEW
@given(intermediate=st.sampled_from([1, 7, 100, 300]), rows=st.integers(1, 5),
       block=st.sampled_from([16, 1024]),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.float64]),
       seed=st.integers(0, 2**16))
def test_silu_and_mul_matches_chapter_04(intermediate, rows, block, dtype, seed):
    "Within a few units in the last place: exp is another implementation than torch's."
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, 2 * intermediate, generator=g) * 4).to(dtype).to(DEVICE)
    gate, up = x.chunk(2, dim=-1)
    out = silu_and_mul(x, block=block)
    assert out.shape == (rows, intermediate) and out.dtype == dtype
    # a GPU computes float32's exp from an approximate exp2 whose error grows with |x| (|gate| is
    # up to ~16 here): 32 units in float32, 4 where the dtype's own rounding dominates
    units = 32 if dtype == torch.float32 else 4
    torch.testing.assert_close(out, F.silu(gate) * up, rtol=units * torch.finfo(dtype).eps, atol=0)


def test_silu_and_mul_keeps_leading_shape():
    x = torch.randn(2, 3, 20, device=DEVICE)
    out = silu_and_mul(x)
    assert out.shape == (2, 3, 10)
    torch.testing.assert_close(out, F.silu(x[..., :10]) * x[..., 10:], rtol=1e-6, atol=0)


def test_fused_add_rms_norm_without_residual_only_normalises():
    "The first layer: out = RMSNorm(x), and the residual stream is x itself, not a copy."
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(100)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(100, generator=g))
    norm = norm.to(DEVICE)
    x = torch.randn(5, 100, generator=g).to(DEVICE)
    with torch.no_grad():
        out, residual = fused_add_rms_norm(x, None, norm.weight, norm.eps)
        torch.testing.assert_close(out, norm(x), rtol=4 * torch.finfo(torch.float32).eps, atol=0)
    assert residual.data_ptr() == x.data_ptr() and torch.equal(residual, x)


# --- the fused layer in the engine --------------------------------------------------------------

BASE = dict(vocab_size=320, num_hidden_layers=2, rms_norm_eps=1e-6, max_position_embeddings=512,
            tie_word_embeddings=False)
# Qwen3 with QK-norm, head_dim 48 (half 24: no power of two); Qwen2 without, biases on q/k/v
MODELS = {'qwen3-gqa-qk-norm': ('qwen3', dict(hidden_size=64, intermediate_size=96,
                                              num_attention_heads=4, num_key_value_heads=2,
                                              head_dim=48, rope_theta=1e6)),
          'qwen2-gqa-bias': ('qwen2', dict(hidden_size=80, intermediate_size=112,
                                           num_attention_heads=4, num_key_value_heads=2,
                                           rope_theta=1e4))}


@pytest.fixture(scope="module", params=list(MODELS))
def checkpoint(request, tmp_path_factory):
    "A random-weight checkpoint (unit-scale activations) and transformers' model of it, float64."
    model_type, kw = MODELS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    hf_model = make_checkpoint(path, model_type, seed=3, **BASE, **kw)
    return path, hf_model.to(torch.float64)


def test_fused_layer_gives_transformers_greedy_tokens(checkpoint):
    "Prompts generated together (chunks beside decodes) on the triton backend's fused ops: HF's."
    path, hf_model = checkpoint
    engine = LLMEngine.from_pretrained(path, dtype=torch.float64, device=DEVICE,
                                       attention_backend='triton', block_size=4,
                                       kv_cache_memory=2**21, max_num_batched_tokens=16)
    batch = prompts(BASE['vocab_size'], [1, 5, 23], seed=1)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in batch]
    done = {}
    while engine.has_unfinished_requests():
        done.update({out.request_id: out for out in engine.step() if out.finished})
    ours = [done[i].token_ids for i in ids]
    assert ours == [hf_greedy(hf_model, p, 10) for p in batch]
    assert len({t for tokens in ours for t in tokens}) > 5     # varied tokens, not one repeated
    # the layers share one RoPE, so the backend made one table for the whole model
    rotary = engine.runner.model.model.layers[0].self_attn.rotary_emb
    assert list(engine.runner.backend.rope_tables) == [(rotary, torch.float64)]


class UnfusedTriton(TritonAttentionBackend):
    "The triton backend's attention under chapter 05's torch operations."
    add_rms_norm = LayerKernels.add_rms_norm
    attention = LayerKernels.attention
    silu_and_mul = LayerKernels.silu_and_mul


def test_fused_ops_give_the_torch_ops_hidden_states_and_pool(checkpoint):
    "One forward, two sets of operations: a prefill chunk and a decode agree, and so do the pools."
    path, _ = checkpoint
    engine = LLMEngine.from_pretrained(path, dtype=torch.float64, device=DEVICE,
                                       attention_backend='triton', block_size=4,
                                       kv_cache_memory=2**21)
    runner, tokens = engine.runner, torch.tensor([3, 14, 15, 92, 65, 35], device=DEVICE)

    @torch.inference_mode()
    def prefill_then_decode(backend):
        for cache in runner.kv_caches:
            for pool in cache:
                pool.zero_()
        hidden = []
        for computed, new in ((0, 5), (5, 1)):
            md = backend.build_metadata([[0, 1]], [computed], [new], 4, DEVICE)
            hidden.append(runner.forward(tokens[computed:computed + new], md.positions, md))
        return torch.cat(hidden), torch.stack([p.clone() for c in runner.kv_caches for p in c])

    fused, unfused = prefill_then_decode(runner.backend), prefill_then_decode(UnfusedTriton())
    for f, u in zip(fused, unfused):
        # the fused norms take their float32 statistics in another order than torch's
        assert ((f - u).abs().max() / u.abs().max()).item() < 1e-6
        assert not torch.equal(u, torch.zeros_like(u))


def test_fused_layer_launches_at_most_10_kernels_per_layer():
    "Chapter 13's goal, counted as chapter 18 counts it: 9 with unified attention."
    figures = launches_per_layer((1, 2), ('triton',), device=DEVICE)['triton']
    assert figures['per_layer'] == 9
    assert figures['per_layer_ops']['triton._qk_norm_rope_store_kernel'] == 1
    assert figures['per_layer_ops']['triton._fused_add_rms_norm_kernel'] == 2
