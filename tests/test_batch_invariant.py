"""Batch invariance (chapter 21): with batch_invariant=True a request's tokens and logits equal its
lone run, whatever runs beside it, however its prompt is chunked, after a prefix hit or not, on any
block size. Checked in bfloat16 on a random Qwen3 wide enough (hidden 256) that the plain engine's
rows do change with the batch: the same checks without the flag fail, and a test below shows it.
"""
import random

import pytest
import torch
import torch.nn.functional as F
import transformers
from hypothesis import HealthCheck, given, settings, strategies as st

from petite_llm.engine.backends import AttentionMetadata, TorchAttentionBackend
from petite_llm.engine.batch_invariant import (BatchInvariantAttention, BatchInvariantLinear,
                                        make_batch_invariant)
from petite_llm.engine.llm_engine import LLM
from petite_llm.model.layers.linear import PackedLinear, packed_linear_available
from petite_llm.model.sampling_params import SamplingParams

VOCAB = 1000
# tiny models: one torch thread (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("one_thread")
SLOW_EXAMPLES = settings(max_examples=6, deadline=None,
                         suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def bf16_path(tmp_path_factory):
    "A random bf16 Qwen3: 2 layers, hidden 256, 8 query heads on 2 KV heads."
    path = tmp_path_factory.mktemp("qwen3_bf16")
    kw = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=768, num_hidden_layers=2,
              num_attention_heads=8, num_key_value_heads=2, head_dim=32,
              max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1,
              eos_token_id=2, pad_token_id=0, initializer_range=0.05)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**kw))
    model.to(torch.bfloat16).save_pretrained(path)
    return path


def _prompts(seed: int, n: int, shared: int = 0, longest: int = 90) -> list[list[int]]:
    "n random prompts of 5 to `longest` tokens; the first `shared` tokens common to all."
    rng = random.Random(seed)
    prefix = [rng.randrange(3, VOCAB) for _ in range(shared)]
    return [prefix + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(5, longest))]
            for _ in range(n)]


def _params(n: int) -> list[SamplingParams]:
    "Greedy and seeded sampling, alternating, 12 tokens each."
    return [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True) if i % 2 == 0 else
            SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=12, ignore_eos=True)
            for i in range(n)]


def _llm(path, invariant=True, **options) -> LLM:
    return LLM(path, dtype='bfloat16', kv_cache_memory=2**24, batch_invariant=invariant,
               **options)


@pytest.fixture(scope="module")
def lone(bf16_path):
    "Each prompt alone, in an engine of 16-token blocks and the default step budget."
    llm = _llm(bf16_path)
    prompts = _prompts(0, 8, shared=20)
    outs = [llm.generate([p], sp, use_tqdm=False)[0].token_ids
            for p, sp in zip(prompts, _params(len(prompts)))]
    return prompts, outs


@SLOW_EXAMPLES
@given(data=st.data(), block_size=st.sampled_from([1, 4, 16]),
       budget=st.sampled_from([7, 32, 2048]))
def test_tokens_equal_lone_run(bf16_path, lone, data, block_size, budget):
    "Any subset, in any order, any chunk budget and block size, prefix hits: the lone tokens."
    prompts, want = lone
    order = data.draw(st.permutations(range(len(prompts))))
    order = order[:data.draw(st.integers(2, len(prompts)))]
    llm = _llm(bf16_path, block_size=block_size, max_num_batched_tokens=budget)
    if data.draw(st.booleans()):     # warm the prefix cache with the shared prefix
        llm.generate([prompts[0][:20]], SamplingParams(max_tokens=1), use_tqdm=False)
    params = _params(len(prompts))
    outs = llm.generate([prompts[i] for i in order], [params[i] for i in order], use_tqdm=False)
    assert [o.token_ids for o in outs] == [want[i] for i in order]


def test_plain_engine_changes_tokens(bf16_path, lone):
    "The check above can tell: without the flag, a batch with chunked prompts changes some tokens."
    prompts = lone[0]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * len(prompts)
    plain = _llm(bf16_path, invariant=False)
    alone = [plain.generate([p], sp, use_tqdm=False)[0].token_ids for p, sp in zip(prompts, params)]
    batched = _llm(bf16_path, invariant=False, block_size=4, max_num_batched_tokens=32)
    outs = batched.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] != alone


def test_preemption_keeps_tokens(bf16_path, lone):
    "A pool too small for the batch: preempted requests recompute their K/V to the same bits."
    prompts, want = lone
    llm = LLM(bf16_path, dtype='bfloat16', block_size=4, kv_cache_memory=2**24,
              batch_invariant=True, max_num_batched_tokens=64)
    num_blocks = llm.engine.num_kv_blocks
    small = LLM(bf16_path, dtype='bfloat16', block_size=4, batch_invariant=True,
                kv_cache_memory=2**24 * 60 // num_blocks, max_num_batched_tokens=64)
    outs = small.generate(prompts, _params(len(prompts)), use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == want


def _logit_rows(llm, batches, record_logits) -> dict:
    "Each prompt's sampled rows of logits, each batch of prompts run in one generate call."
    rows = record_logits(llm)
    for prompts in batches:
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                     use_tqdm=False)
    return {p: torch.stack(r) for p, r in rows.items()}


@pytest.mark.parametrize("invariant", [False, True])
def test_logits_bits(bf16_path, record_logits, invariant):
    "The test can tell: plain rows change with the batch in bf16; batch-invariant rows never do."
    prompts = _prompts(1, 12)
    alone = _logit_rows(_llm(bf16_path, invariant), [[p] for p in prompts], record_logits)
    together = _logit_rows(_llm(bf16_path, invariant, max_num_batched_tokens=40), [prompts],
                           record_logits)
    same = [torch.equal(alone[tuple(p)], together[tuple(p)]) for p in prompts]
    assert all(same) if invariant else not all(same)


def test_speculation_keeps_tokens(bf16_path, lone):
    "n-gram speculation on, in a batch: the greedy requests' tokens of the lone runs without it."
    prompts, want = lone
    llm = _llm(bf16_path, speculative_config={'method': 'ngram', 'num_speculative_tokens': 3,
                                              'prompt_lookup_min': 1, 'prompt_lookup_max': 3})
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(prompts[::2], greedy, use_tqdm=False)
    assert [o.token_ids for o in outs] == want[::2]


def test_int8_weights(bf16_path):
    "int8 linears keep the property: each request alone equals the batch."
    prompts = _prompts(2, 6)
    llm = _llm(bf16_path, quantization='int8', max_num_batched_tokens=32)
    sp = _params(len(prompts))
    alone = [llm.generate([p], s, use_tqdm=False)[0].token_ids for p, s in zip(prompts, sp)]
    assert [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == alone


def test_refuses_torch_compile(bf16_path):
    with pytest.raises(ValueError, match="batch_invariant=True cannot run with enable_torch_c"):
        _llm(bf16_path, enable_torch_compile=True)


def test_log_names_the_mode(bf16_path, caplog):
    with caplog.at_level('INFO', logger='petite_llm.engine'):
        _llm(bf16_path)
    backend = 'triton' if torch.cuda.is_available() else 'torch'       # each device's default
    assert f"attention backend: {backend} (batch-invariant)" in caplog.text


@settings(max_examples=25, deadline=None)
@given(num_rows=st.integers(1, 40), rows=st.sampled_from([1, 3, 16]),
       packed=st.booleans(), seed=st.integers(0, 2**16))
def test_linear_row_alone(num_rows, rows, packed, seed):
    "A row's output from BatchInvariantLinear is the same bits alone as among num_rows rows."
    torch.manual_seed(seed)
    weight = torch.randn(384, 320, dtype=torch.bfloat16) / 16
    inner = (PackedLinear(weight) if packed and packed_linear_available(torch.bfloat16)
             else torch.nn.Linear(320, 384, bias=False, dtype=torch.bfloat16))
    if isinstance(inner, torch.nn.Linear):
        inner.weight.data.copy_(weight)
    linear = BatchInvariantLinear(inner, rows)
    x = torch.randn(num_rows, 320, dtype=torch.bfloat16)
    out = linear(x)                                                       # [num_rows, 384]
    i = seed % num_rows
    assert torch.equal(linear(x[i:i + 1])[0], out[i])
    torch.testing.assert_close(out, F.linear(x, weight), rtol=2e-2, atol=2e-2)


def test_make_batch_invariant_wraps_once(bf16_path):
    llm = _llm(bf16_path, invariant=False)
    model = llm.engine.model
    num = make_batch_invariant(model, rows=2)
    assert num == 2 * 4 + 1                        # qkv, o, gate_up, down per layer; lm_head
    assert make_batch_invariant(model, rows=2) == 0
    assert isinstance(model.lm_head, BatchInvariantLinear)


def _metadata(lens, block_size, backend, seed=0):
    "Metadata for sequences of (cached, new) tokens, on shuffled blocks of one pool."
    rng = random.Random(seed)
    ids = list(range(128))
    rng.shuffle(ids)
    tables, start = [], 0
    for done, new in lens:
        n = -(-(done + new) // block_size)
        tables.append(ids[start:start + n])
        start += n
    return AttentionMetadata.build(tables, [d for d, _ in lens], [n for _, n in lens],
                                   block_size, None, backend)


@settings(max_examples=20, deadline=None)
@given(block_size=st.sampled_from([1, 4, 8]), split=st.sampled_from([4, 16, 64]),
       seed=st.integers(0, 2**16))
def test_attention_rows(block_size, split, seed):
    "Attention rows: the reference's values (fp32), and the same bits in a chunk, alone or batched."
    torch.manual_seed(seed)
    nh, nkv, hd = 4, 2, 16
    ctx = 3 + seed % 40                           # the checked sequence's whole context
    cache = [torch.randn(128, block_size, nkv, hd) for _ in range(2)]
    q = torch.randn(ctx + 30, nh, hd)
    k, v = torch.randn(2, ctx + 30, nkv, hd)
    inv = BatchInvariantAttention(split_size=split, row_chunk=5)
    lens = [(0, ctx), (0, 30)]                    # the sequence, then a neighbour
    md = _metadata(lens, block_size, inv, seed)
    out = inv.forward(q, k, v, [c.clone() for c in cache], md, 0.25)
    ref = TorchAttentionBackend().forward(q, k, v, [c.clone() for c in cache],
                                          _metadata(lens, block_size, TorchAttentionBackend(),
                                                    seed), 0.25)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # the last token again, as a decode beside another decode, after its prefix is cached
    pool = [c.clone() for c in cache]
    inv.forward(q[:ctx - 1], k[:ctx - 1], v[:ctx - 1], pool, _metadata([(0, ctx - 1)],
                                                                      block_size, inv, seed), 0.25)
    rows = torch.cat([q[ctx - 1:ctx], q[ctx:ctx + 1]])
    decode = inv.forward(rows, torch.cat([k[ctx - 1:ctx], k[ctx:ctx + 1]]),
                         torch.cat([v[ctx - 1:ctx], v[ctx:ctx + 1]]), pool,
                         _metadata([(ctx - 1, 1), (0, 1)], block_size, inv, seed), 0.25)
    assert torch.equal(decode[0], out[ctx - 1])


def test_triton_backend(bf16_path, record_logits):
    "The triton backend (its interpreter on a CPU): one tile shape, no split, the same bits."
    prompts = _prompts(3, 3, longest=12)

    def llm(**options):
        return LLM(bf16_path, dtype='float32', kv_cache_memory=2**22, block_size=4,
                   attention_backend='triton', batch_invariant=True, **options)
    alone = _logit_rows(llm(), [[p] for p in prompts], record_logits)
    together = _logit_rows(llm(max_num_batched_tokens=24), [prompts], record_logits)
    assert all(torch.equal(alone[tuple(p)], together[tuple(p)]) for p in prompts)


@pytest.mark.slow
def test_tensor_parallel(bf16_path, lone):
    "Two ranks (chapter 20) add their partial sums as a + b: each request still gets its lone tokens."
    prompts, params = lone[0], _params(len(lone[0]))
    llm = _llm(bf16_path, tensor_parallel_size=2, max_num_batched_tokens=32)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        alone = [llm.generate([p], sp, use_tqdm=False)[0] for p, sp in zip(prompts[:3], params)]
    finally:
        llm.shutdown()
    assert [o.token_ids for o in alone] == [o.token_ids for o in outs[:3]]
    with pytest.raises(ValueError, match="batch_invariant=True with tensor_parallel_size=3"):
        _llm(bf16_path, tensor_parallel_size=3)
