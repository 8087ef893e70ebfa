"""Chapter 13's Triton kernels against the torch reference (chapter 11's backend and chapter 01's
RMSNorm), on random inputs drawn by hypothesis, and the engine on the `triton` backend against the
engine on the `torch` backend.

Without a GPU the kernels run in Triton's interpreter, which must be switched on before
the kernel modules define them (tests/conftest.py does so too). The interpreter has no
bfloat16, so on a CPU the kernels are checked in float32 (tight), float16 and float64; the bfloat16 checks
are marked `gpu`. Shapes are small: the interpreter runs the programs one after another.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")        # before the kernels are defined

import random
from dataclasses import replace

import pytest
import transformers
from hypothesis import HealthCheck, given, settings, strategies as st

from petite_llm.engine.backends import TorchAttentionBackend, store_kv
from petite_llm.model.config import ModelConfig
from petite_llm.engine.llm_engine import LLMEngine
import petite_llm.engine.triton_backend as triton_backend_module
from petite_llm.kernels.attention import (num_kv_splits, split_kv_attention, triton_store_kv,
                                          unified_attention)
from petite_llm.kernels.fused import fused_add_rms_norm
from petite_llm.engine.triton_backend import TritonAttentionBackend
from petite_llm.model.layers.norm import RMSNorm
from petite_llm.engine.paging import cdiv, kv_bytes_per_block
from petite_llm.model.sampling_params import SamplingParams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# on a GPU the softmax scale arrives as a float32 argument: float64 keeps ~1e-8 of it
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2,
       torch.float64: 1e-6 if DEVICE == "cuda" else 1e-12}
FEW = settings(max_examples=25, deadline=None, derandomize=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# tiny models: one torch thread (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("one_thread")


def random_batch(seqs, block_size, num_heads, num_kv_heads, head_dim, dtype, seed=0):
    "One step over seqs [(cached, new), ...], blocks shuffled over a pool of random K/V."
    num_blocks = [cdiv(cached + new, block_size) for cached, new in seqs]
    pool_blocks = sum(num_blocks) + 2
    perm = torch.randperm(pool_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables = [[perm.pop() for _ in range(n)] for n in num_blocks]
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)

    T = sum(new for _, new in seqs)
    q = rand(T, num_heads, head_dim)
    k, v = rand(T, num_kv_heads, head_dim), rand(T, num_kv_heads, head_dim)
    pool = (pool_blocks, block_size, num_kv_heads, head_dim)
    md = TorchAttentionBackend().build_metadata(tables, [c for c, _ in seqs],
                                                [n for _, n in seqs], block_size, DEVICE)
    return q, k, v, (rand(*pool), rand(*pool)), md


def reference(q, k, v, kv_cache, md):
    "Chapter 11's backend on a copy of the pool."
    kv_cache = tuple(c.clone() for c in kv_cache)
    return md.backend.forward(q, k, v, kv_cache, md, q.shape[-1] ** -0.5)


def graph_batch(contexts, num_padding, block_size, num_heads, num_kv_heads, head_dim, dtype):
    "Decodes of these contexts, then padding rows as a CUDA-graph batch has them (slot -1, 0 keys)."
    batch = random_batch([(n - 1, 1) for n in contexts] + [(0, 1)] * num_padding, block_size,
                         num_heads, num_kv_heads, head_dim, dtype)
    md = batch[-1]
    md.slot_mapping[len(contexts):] = -1
    md.context_lens[len(contexts):] = 0
    return batch


def paged(md):
    "What the paged kernels read of a step's metadata: its tensors and the longest query."
    return md.query_start_loc, md.context_lens, md.block_tables, md.max_query_len


def store_and_attend(q, k, v, kv_cache, md, num_splits=1):
    "What the backend does, with the split chosen: store k and v, then attend."
    triton_store_kv(k, v, *kv_cache, md.slot_mapping)
    scale = q.shape[-1] ** -0.5
    if num_splits == 1:
        return unified_attention(q, *kv_cache, *paged(md), scale)
    return split_kv_attention(q, *kv_cache, *paged(md), scale, num_splits)


@st.composite
def steps(draw, decode_only=False):
    "(cached, new) per sequence: decodes first (a context of one token included), then chunks."
    decodes = [(draw(st.integers(0, 70)), 1) for _ in range(draw(st.integers(0, 3)))]
    num_chunks = 0 if decode_only else draw(st.integers(0 if decodes else 1, 2))
    chunks = [(draw(st.integers(0, 40)), draw(st.integers(2, 24))) for _ in range(num_chunks)]
    return (decodes or [(draw(st.integers(0, 70)), 1)]) + chunks


# (num_kv_heads, query heads per KV head): MHA, GQA with groups 2, 3 and 5, MQA
heads = st.sampled_from([(4, 1), (2, 2), (2, 3), (1, 5), (1, 8)])
head_dims = st.sampled_from([16, 64, 80, 96, 128, 256])
block_sizes = st.sampled_from([1, 3, 16, 256])


@FEW
@given(num_tokens=st.integers(1, 20), num_kv_heads=st.integers(1, 4),
       head_dim=st.sampled_from([16, 80, 128]), block_size=st.sampled_from([1, 3, 16]),
       padding=st.lists(st.booleans(), min_size=20, max_size=20),
       dtype=st.sampled_from([torch.float32, torch.float16]))
def test_store_kv_writes_what_torch_writes(num_tokens, num_kv_heads, head_dim, block_size,
                                           padding, dtype):
    "Bit-equal to chapter 11's store_kv, from strided views, padding slots skipped."
    g = torch.Generator().manual_seed(num_tokens)
    num_slots = cdiv(num_tokens, block_size) * block_size + block_size
    slots = torch.randperm(num_slots, generator=g)[:num_tokens]
    slots[torch.tensor(padding[:num_tokens])] = -1
    kv = torch.randn(num_tokens, 3 * num_kv_heads * head_dim, generator=g).to(dtype)
    k = kv[:, :num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    v = kv[:, 2 * num_kv_heads * head_dim:].view(num_tokens, num_kv_heads, head_dim)
    shape = (num_slots // block_size, block_size, num_kv_heads, head_dim)
    pools = [[torch.randn(shape, generator=g).to(dtype) for _ in range(2)] for _ in range(2)]
    pools[1] = [c.clone() for c in pools[0]]
    k, v, slots = k.to(DEVICE), v.to(DEVICE), slots.to(DEVICE)
    ours, theirs = ([c.to(DEVICE) for c in pool] for pool in pools)
    triton_store_kv(k, v, *ours, slots)
    store_kv(k, v, *theirs, slots)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


@FEW
@given(seqs=steps(), heads=heads, head_dim=head_dims, block_size=block_sizes,
       tile_k=st.sampled_from([16, 32]), dtype=st.sampled_from([torch.float32, torch.float16]))
def test_unified_attention_matches_reference(seqs, heads, head_dim, block_size, tile_k, dtype):
    "Decodes and chunks after cached tokens, any block size, group and head_dim: the reference."
    num_kv_heads, group = heads
    q, k, v, kv_cache, md = random_batch(seqs, block_size, num_kv_heads * group, num_kv_heads,
                                         head_dim, dtype)
    ref = reference(q, k, v, kv_cache, md)
    triton_store_kv(k, v, *kv_cache, md.slot_mapping)
    out = unified_attention(q, *kv_cache, *paged(md), head_dim ** -0.5, tile_k=tile_k)
    torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype])


@settings(FEW, max_examples=12)            # up to 16 segments a row: the interpreter's slowest
@given(seqs=st.one_of(steps(decode_only=True), steps()), heads=heads,
       head_dim=st.sampled_from([16, 80, 128]), block_size=st.sampled_from([1, 3, 16]),
       num_splits=st.sampled_from([2, 4, 8, 16]), tile_k=st.sampled_from([16, 32]))
def test_split_kv_equals_unsplit(seqs, heads, head_dim, block_size, num_splits, tile_k):
    "Split into segments and merged by log-sum-exp: the unsplit result, up to float32 rounding."
    num_kv_heads, group = heads
    q, k, v, kv_cache, md = random_batch(seqs, block_size, num_kv_heads * group, num_kv_heads,
                                         head_dim, torch.float32)
    triton_store_kv(k, v, *kv_cache, md.slot_mapping)
    scale = head_dim ** -0.5
    unsplit = unified_attention(q, *kv_cache, *paged(md), scale, tile_k=tile_k)
    split = split_kv_attention(q, *kv_cache, *paged(md), scale, num_splits, tile_k=tile_k)
    torch.testing.assert_close(split, unsplit, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_padding_rows_write_zeros_and_store_nothing(num_splits):
    "A CUDA-graph batch: real rows as the reference, padding rows zero, only real slots written."
    q, k, v, kv_cache, md = graph_batch([1, 40, 7, 100], 4, 3, 6, 2, 80, torch.float32)
    ref = reference(q, k, v, kv_cache, md)
    before = [c.clone() for c in kv_cache]
    out = store_and_attend(q, k, v, kv_cache, md, num_splits)
    torch.testing.assert_close(out[:4], ref[:4], atol=1e-5, rtol=1e-5)
    assert torch.equal(out[4:], torch.zeros_like(out[4:]))
    for cache, old in zip(kv_cache, before):
        written = (cache != old).flatten(2).any(-1).flatten().nonzero().flatten()
        assert sorted(written.tolist()) == sorted(md.slot_mapping[:4].tolist())


@pytest.mark.parametrize("dtype,num_splits", [
    (torch.float64, 1), (torch.float64, 4),
    pytest.param(torch.bfloat16, 1, marks=pytest.mark.gpu),
    pytest.param(torch.bfloat16, 8, marks=pytest.mark.gpu)])
def test_float64_and_bfloat16_against_the_reference(dtype, num_splits):
    "float64 keeps its precision (greedy parity relies on it); bfloat16, on a GPU, its rounding."
    seqs = [(300, 1), (0, 1), (1000, 1)] + ([(0, 100), (77, 50)] if num_splits == 1 else [])
    q, k, v, kv_cache, md = random_batch(seqs, 16, 16, 8, 128, dtype)     # Qwen3-0.6B's heads
    ref = reference(q, k, v, kv_cache, md)
    out = store_and_attend(q, k, v, kv_cache, md, num_splits)
    torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype])


def test_num_kv_splits():
    "Split only decode-only steps that leave SMs idle, into a power of two of long-enough segments."
    h100 = dict(num_kv_heads=8, num_sms=132)
    assert num_kv_splits(1, max_query_len=1, max_context_len=32768, **h100) == 16
    assert num_kv_splits(4, max_query_len=1, max_context_len=32768, **h100) == 4
    assert num_kv_splits(17, max_query_len=1, max_context_len=32768, **h100) == 1
    assert num_kv_splits(1, max_query_len=2, max_context_len=32768, **h100) == 1    # prefill
    assert num_kv_splits(1, max_query_len=1, max_context_len=300, **h100) == 1     # short
    assert num_kv_splits(1, max_query_len=1, max_context_len=0, **h100) == 1       # padding
    assert num_kv_splits(1, 8, 1, 32768, num_sms=1) == 1                          # a CPU
    for num_seqs in range(1, 20):
        for context in (1, 255, 256, 1000, 5000, 70000):
            n = num_kv_splits(num_seqs, 8, 1, context, 132)
            assert n & (n - 1) == 0 and 1 <= n <= 16
            assert n == 1 or context // n >= 256


@FEW
@given(hidden=st.sampled_from([8, 100, 1000, 1024]), rows=st.integers(1, 9),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.float64]),
       seed=st.integers(0, 2**16))
def test_fused_add_rms_norm_matches_chapter_01(hidden, rows, dtype, seed):
    "The residual sum bit for bit; the norm within a few units in the last place of chapter 01's."
    g = torch.Generator().manual_seed(seed)
    norm = RMSNorm(hidden, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=g))
    norm = norm.to(dtype).to(DEVICE)
    x = torch.randn(rows, hidden, generator=g).to(dtype).to(DEVICE)
    residual = (torch.randn(rows, hidden, generator=g) * 10).to(dtype).to(DEVICE)
    with torch.no_grad():
        expected = norm(residual + x)
        out, residual_out = fused_add_rms_norm(x, residual, norm.weight, norm.eps)
    assert torch.equal(residual_out, residual + x)
    # float64 normalises in float32, as chapter 01 does
    eps = torch.finfo(torch.float32 if dtype == torch.float64 else dtype).eps
    torch.testing.assert_close(out, expected, rtol=4 * eps, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16,
                                   pytest.param(torch.bfloat16, marks=pytest.mark.gpu)])
def test_fused_add_rms_norm_casts_back_before_the_weight(dtype):
    "Chapter 01's cast order: almost no value differs; with the weight applied first, many do."
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(1000, generator=g).to(dtype)
    x, residual = (torch.randn(64, 1000, generator=g).to(dtype) for _ in range(2))
    out, hidden = fused_add_rms_norm(x.to(DEVICE), residual.to(DEVICE), weight.to(DEVICE), 1e-6)
    out, hidden = out.cpu(), hidden.cpu()
    assert torch.equal(hidden, residual + x)
    norm = RMSNorm(1000).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
        expected = norm(hidden)
    h = hidden.float()
    weight_first = (weight.float() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert (weight_first.to(dtype) != expected).float().mean() > 0.1   # the check tells them apart
    assert (out != expected).float().mean() < 1e-3


def test_fused_add_rms_norm_keeps_leading_shape():
    x, residual, weight = torch.randn(2, 3, 16), torch.randn(2, 3, 16), torch.randn(16)
    out, residual_out = fused_add_rms_norm(x.to(DEVICE), residual.to(DEVICE), weight.to(DEVICE),
                                           1e-6)
    assert out.shape == residual_out.shape == (2, 3, 16)


@pytest.mark.parametrize("block_size,num_sms", [(1, 1), (3, 64), (16, 64)])
def test_backend_matches_torch_backend_step_by_step(block_size, num_sms, monkeypatch):
    "A chunk after 1100 cached tokens, decodes beside chunks, decode-only steps: the same outputs."
    splits, split_kv = [], split_kv_attention
    monkeypatch.setattr(triton_backend_module, "split_kv_attention",
                        lambda *args: splits.append(args[-1]) or split_kv(*args))
    cached = {0: 1100, 1: 0, 2: 30, 3: 0}
    steps_ = [[(0, 7), (1, 17)], [(0, 1), (1, 14), (2, 5)], [(0, 1), (1, 1), (2, 11), (3, 1)]]
    steps_ += [[(0, 1), (1, 1), (2, 1), (3, 1)]] * 2
    lengths = dict(cached)
    for step in steps_:
        for seq, new in step:
            lengths[seq] += new
    # block ids interleaved across sequences
    tables = {seq: list(range(seq, 4 * cdiv(n, block_size), 4)) for seq, n in lengths.items()}
    shape = (4 * max(cdiv(n, block_size) for n in lengths.values()), block_size, 2, 80)
    g = torch.Generator().manual_seed(block_size)
    torch_pool = [torch.randn(shape, generator=g).to(DEVICE) for _ in range(2)]   # cached K/V
    triton_pool = [c.clone() for c in torch_pool]
    torch_backend, triton_backend = TorchAttentionBackend(), TritonAttentionBackend(num_sms)
    assert triton_backend.name == 'triton' and triton_backend.supports_cuda_graphs
    done = dict(cached)
    for step in steps_:
        T = sum(new for _, new in step)
        q, k, v = (torch.randn(T, h, 80, generator=g).to(DEVICE) for h in (6, 2, 2))
        args = ([tables[s] for s, _ in step], [done[s] for s, _ in step], [n for _, n in step],
                block_size, DEVICE)
        ref = torch_backend.forward(q, k, v, torch_pool, torch_backend.build_metadata(*args),
                                    80 ** -0.5)
        # what the triton backend must not read (a CUDA graph could not replay it)
        md = replace(triton_backend.build_metadata(*args), query_start_loc_cpu=None,
                     context_lens_cpu=None)
        assert md.backend is triton_backend
        out = triton_backend.forward(q, k, v, triton_pool, md, 80 ** -0.5)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        assert all(torch.equal(a, b) for a, b in zip(triton_pool, torch_pool))
        for seq, new in step:
            done[seq] += new
    # the two decode-only steps went through split-KV, in 4 segments, where SMs were left idle
    assert splits == ([4, 4] if num_sms == 64 else [])


# --- the engine on the triton backend ----------------------------------------------------------

VOCAB, EOS = 300, 2


@pytest.fixture(scope="module")
def qwen3_f64(tmp_path_factory):
    "A random-weight Qwen3 saved by transformers: 2 layers, 4 query heads on 2 KV heads, float64."
    path = tmp_path_factory.mktemp("qwen3_kernels")
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=256, bos_token_id=1,
                                   eos_token_id=EOS, pad_token_id=0, initializer_range=0.2)
    transformers.Qwen3ForCausalLM(cfg).to(torch.float64).save_pretrained(path)
    return path


def _prompts(shared):
    "7 prompts of 1 to 30 tokens; all but the first two start with the same `shared` tokens."
    rng = random.Random(0)
    prefix = [rng.randrange(3, VOCAB) for _ in range(shared)]
    return [(prefix if i >= 2 else []) + [rng.randrange(3, VOCAB) for _ in range(n)]
            for i, n in enumerate([1, 30, 3, 9, 17, 4, 12])]


def _greedy_tokens(engine, prompts, max_tokens=6):
    "Each prompt's greedy tokens, all generated together."
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=max_tokens))
           for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        done.update({out.request_id: out for out in engine.step() if out.finished})
    return [done[i].token_ids for i in ids]


# pools too small for all 7 requests at once: preemptions happen
@pytest.mark.parametrize("block_size,budget,num_blocks,shared",
                         [(1, 16, 48, 0), (3, 8, 20, 9), (16, 32, 5, 16)])
def test_engine_triton_backend_gives_the_torch_tokens(qwen3_f64, block_size, budget, num_blocks,
                                                      shared):
    "Greedy tokens equal the torch backend's: chunked prefill, prefix hits, preemption."
    kv_bytes = num_blocks * kv_bytes_per_block(ModelConfig.from_pretrained(qwen3_f64), block_size,
                                               torch.float64)
    outs = {}
    for backend in ("torch", "triton"):
        engine = LLMEngine.from_pretrained(qwen3_f64, device=DEVICE, block_size=block_size,
                                           max_num_batched_tokens=budget,
                                           kv_cache_memory=kv_bytes, attention_backend=backend)
        # twice: the second pass hits the prefix cache for every prompt's full blocks
        outs[backend] = [_greedy_tokens(engine, _prompts(shared)) for _ in range(2)]
        stats = engine.stats
    assert outs["triton"] == outs["torch"]
    assert stats.prefix_cache_hit_rate > 0 and stats.num_preemptions > 0
