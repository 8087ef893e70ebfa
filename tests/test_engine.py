"""The engine against transformers: greedy tokens (fp64), logits (fp32), sampling, errors, text.

Random-weight Qwen3 checkpoints are built with transformers and saved to a temporary folder, without
tokenizer files: prompts are token ids. transformers' own `generate(do_sample=False)` on each prompt
*alone* is the oracle; the engine runs all prompts together, with small blocks, tiny prefill
budgets, prefix hits, preemption and mixed priorities. Greedy identity is checked in float64 (random
weights give near-ties that fp32 rounding could flip); fp32 is checked on the logits of every
generated position, within 1e-4 * max|logit|.
"""
import functools
import logging
import random
from dataclasses import replace

import pytest
import torch
import transformers

from petite_llm.model.config import ModelConfig
from petite_llm.engine.llm_engine import LLM, LLMEngine
from petite_llm.engine.config import EngineConfig
from petite_llm.engine.outputs import merge_outputs
from petite_llm.model.layers.linear import PackedLinear, packed_linear_available, prepack_linears
from petite_llm.engine.paging import kv_bytes_per_block
from petite_llm.model.sampling_params import SamplingParams
from petite_llm.engine.scheduler import SchedulerStats
from petite_llm.model.weights import load_model
from host_reads import HostReads

VOCAB, EOS = 300, 2


# tiny models: one torch thread (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("one_thread")


def _checkpoint(path, dtype, seed=0, **overrides):
    "Save a random-weight Qwen3 (2 layers, hidden 64, 4 q on 2 KV heads); return HF's eager model."
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=256, tie_word_embeddings=False,
              bos_token_id=1, eos_token_id=EOS, pad_token_id=0,
              initializer_range=0.2)   # large init: varied tokens
    kw.update(overrides)
    torch.manual_seed(seed)
    transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**kw)).to(dtype).save_pretrained(path)
    hf = transformers.Qwen3ForCausalLM.from_pretrained(path, dtype=dtype,
                                                       attn_implementation="eager")
    return hf.eval()


@pytest.fixture(scope="module")
def f64(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_f64")
    return path, _checkpoint(path, torch.float64)


@pytest.fixture(scope="module")
def f32(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_f32")
    return path, _checkpoint(path, torch.float32, seed=1, tie_word_embeddings=True,
                             num_key_value_heads=1)


LENGTHS = [1, 2, 3, 7, 8, 9, 15, 16, 17, 24, 31, 32, 33, 48, 64, 70]

def _prompts(seed=0, shared=0):
    "16 prompts of mixed lengths (1 to 70 tokens); with `shared`, 14 share their first tokens."
    rng = random.Random(seed)
    lengths = rng.sample(LENGTHS, len(LENGTHS))
    prefix = [rng.randrange(3, VOCAB) for _ in range(shared)]
    return [(prefix if shared and i >= 2 else []) + [rng.randrange(3, VOCAB) for _ in range(n)]
            for i, n in enumerate(lengths)]

def _max_tokens(seed=0):
    rng = random.Random(seed + 100)
    return [rng.randint(3, 12) for _ in LENGTHS]

_hf_cache = {}

def hf_greedy(hf, prompt, max_new_tokens):
    "transformers' greedy continuation of one prompt alone (stopping at eos, as the engine does)."
    key = (id(hf), tuple(prompt), max_new_tokens)
    if key not in _hf_cache:
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids),
                              max_new_tokens=max_new_tokens, do_sample=False,
                              eos_token_id=EOS, pad_token_id=0)
        _hf_cache[key] = out[0, len(prompt):].tolist()
    return _hf_cache[key]

def _pool(path, num_blocks, block_size, dtype=torch.float64) -> int:
    "kv_cache_memory bytes for exactly num_blocks blocks."
    return num_blocks * kv_bytes_per_block(ModelConfig.from_pretrained(path), block_size, dtype)

def _check_greedy(llm, hf, prompts, max_tokens, priority=None):
    "All prompts in one generate call; each must equal transformers' greedy tokens for it alone."
    sps = [SamplingParams(temperature=0, max_tokens=m) for m in max_tokens]
    outs = llm.generate(prompts, sps, priority=priority, use_tqdm=False)
    for i, (p, m, o) in enumerate(zip(prompts, max_tokens, outs)):
        want = hf_greedy(hf, p, m)
        assert o.token_ids == want, \
            f"prompt {i} ({len(p)} tokens): engine {o.token_ids} != transformers {want}"
        assert o.finish_reason == ('stop' if want[-1] == EOS else 'length')
        assert o.prompt_token_ids == p
    return outs


@pytest.mark.parametrize("block_size,budget", [(16, 2048), (1, 2048), (4, 8), (16, 8)])
def test_greedy_parity_f64(f64, block_size, budget):
    "16 prompts together == each alone in transformers, whatever the block size and prefill budget."
    path, hf = f64
    llm = LLM(path, block_size=block_size, max_num_batched_tokens=budget,
              kv_cache_memory=_pool(path, 4096 // block_size, block_size))
    _check_greedy(llm, hf, _prompts(0), _max_tokens(0), priority=[i % 3 for i in range(16)])
    s = llm.stats
    assert s.kv_blocks_used == 0 and s.num_running == s.num_waiting == 0
    assert s.num_generated_tokens == sum(len(hf_greedy(hf, p, m))
                                         for p, m in zip(_prompts(0), _max_tokens(0)))
    if budget == 8:
        assert s.num_steps > sum(LENGTHS) // 8   # prompts really were chunked


def test_prefix_hits_and_full_hit_f64(f64):
    "A shared 40-token prefix hits the prefix cache; a repeated whole-block prompt is a full hit."
    path, hf = f64
    llm = LLM(path, block_size=4, max_num_batched_tokens=48, kv_cache_memory=_pool(path, 512, 4))
    prompts, mt = _prompts(1, shared=40), _max_tokens(1)
    _check_greedy(llm, hf, prompts, mt, priority=[(i * 7) % 4 for i in range(16)])
    bm = llm.engine.block_manager
    assert bm.num_hit_tokens >= 40 and llm.stats.prefix_cache_hit_rate > 0
    # a second pass: every full block of every prompt is cached now, except each prompt's
    # last-token block
    hits = bm.num_hit_tokens
    _check_greedy(llm, hf, prompts, mt)
    assert bm.num_hit_tokens - hits == sum((len(p) - 1) // 4 * 4 for p in prompts)
    # the full hit: 32 tokens = 8 whole blocks, all cached; the last token must still be computed
    full = prompts[0][:32] if len(prompts[0]) >= 32 else prompts[2][:32]
    _check_greedy(llm, hf, [full], [6])
    hits = bm.num_hit_tokens
    _check_greedy(llm, hf, [full], [6])
    assert bm.num_hit_tokens - hits == 28


def test_preemption_parity_f64(f64):
    "A pool of 24 blocks of 4 tokens for 16 requests: preemptions happen and change no token."
    path, hf = f64
    llm = LLM(path, block_size=4, max_num_batched_tokens=64, kv_cache_memory=_pool(path, 24, 4))
    _check_greedy(llm, hf, _prompts(0), [12] * 16, priority=[(i * 5) % 3 for i in range(16)])
    assert llm.stats.num_preemptions > 0
    assert llm.stats.kv_blocks_used == 0


@pytest.mark.parametrize("block_size,budget,num_blocks",
                         [(4, 64, 24), (1, 8, 4096), (16, 2048, 64)])
def test_logits_f32(f32, block_size, budget, num_blocks, record_logits):
    "fp32, any block size, 8-token chunks, preemption: each position's logits match HF within 1e-4."
    path, hf = f32
    llm = LLM(path, dtype=torch.float32, block_size=block_size, max_num_batched_tokens=budget,
              kv_cache_memory=_pool(path, num_blocks, block_size, torch.float32))
    rows = record_logits(llm)
    prompts = _prompts(2)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8),
                        priority=[i % 2 for i in range(16)], use_tqdm=False)
    if num_blocks == 24:
        assert llm.stats.num_preemptions > 0
    for p, o in zip(prompts, outs):
        full = torch.tensor([p + o.token_ids])
        with torch.inference_mode():
            want = hf(full).logits[0, len(p) - 1:len(p) - 1 + len(o.token_ids)]   # [n, V]
        got = torch.stack(rows[tuple(p)])
        assert got.shape == want.shape
        err = (got - want).abs().max().item()
        assert err <= 1e-4 * want.abs().max().item(), \
            f"{len(p)}-token prompt: max |logit difference| {err:.2e}"


def test_seeded_sampling_is_batch_and_preemption_invariant(f64):
    "A seeded request draws the same tokens alone, in any batch order, and after preemption."
    path, hf = f64
    prompts = _prompts(3)
    sps = [SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=100 + i, max_tokens=10)
           for i in range(16)]
    llm = LLM(path, block_size=4, kv_cache_memory=_pool(path, 1024, 4))
    alone = {i: llm.generate([prompts[i]], sps[i], use_tqdm=False)[0].token_ids for i in (0, 5, 11)}
    batch = [o.token_ids for o in llm.generate(prompts, sps, use_tqdm=False)]
    assert all(batch[i] == alone[i] for i in alone)
    rev = [o.token_ids for o in llm.generate(prompts[::-1], sps[::-1], use_tqdm=False)][::-1]
    assert rev == batch
    tiny = LLM(path, block_size=4, max_num_batched_tokens=128, kv_cache_memory=_pool(path, 24, 4))
    squeezed = tiny.generate(prompts, sps, priority=[i % 2 for i in range(16)], use_tqdm=False)
    squeezed = [o.token_ids for o in squeezed]
    assert tiny.stats.num_preemptions > 0
    assert squeezed == batch
    unseeded = llm.generate(prompts[:2], SamplingParams(temperature=0.9, max_tokens=10),
                            use_tqdm=False)
    assert all(len(o.token_ids) >= 1 for o in unseeded)


def test_n_samples(f64):
    "n > 1: n completions; greedy ones equal transformers; seeded ones are reproducible and differ."
    path, hf = f64
    llm = LLM(path, block_size=4, kv_cache_memory=_pool(path, 256, 4))
    p = _prompts(4)[0] + [7] * 9
    out = llm.generate([p], SamplingParams(n=3, temperature=0, max_tokens=6), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(c.token_ids == hf_greedy(hf, p, 6) for c in out.outputs)
    sp = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=8)
    a = [c.token_ids for c in llm.generate(p, sp, use_tqdm=False)[0].outputs]
    b = [c.token_ids for c in llm.generate(p, sp, use_tqdm=False)[0].outputs]
    assert a == b and len({tuple(x) for x in a}) > 1
    assert llm.stats.kv_blocks_used == 0


def test_refusals_keep_the_engine_running(f64, caplog):
    "Too long for max_model_len or the pool: a clear ValueError before scheduling; then all runs."
    path, hf = f64
    with caplog.at_level(logging.INFO, logger="petite_llm.engine"):
        llm = LLM(path, block_size=4, kv_cache_memory=_pool(path, 16, 4), max_model_len=128)
    assert "KV cache: 16 blocks" in caplog.text and llm.kv_cache_memory == _pool(path, 16, 4)
    with pytest.raises(ValueError, match=r"200 tokens.*max_model_len=128"):
        llm.generate([[5] * 200], SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError, match=r"needs 20 KV blocks but the whole pool has 16"):
        llm.generate([[5] * 40], SamplingParams(max_tokens=41), use_tqdm=False)
    with pytest.raises(ValueError, match=r"token ids"):
        llm.generate([[5, VOCAB]], use_tqdm=False)
    with pytest.raises(ValueError, match=r"without a tokenizer"):
        llm.generate("hello", use_tqdm=False)
    with pytest.raises(ValueError, match=r"3 prompts, 2 sampling_params"):
        llm.generate([[5], [6], [7]], [SamplingParams(), SamplingParams()], use_tqdm=False)
    # one bad prompt in a batch: nothing of the call stays queued
    with pytest.raises(ValueError):
        llm.generate([[5] * 4, [5] * 200], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests() and llm.stats.kv_blocks_used == 0
    _check_greedy(llm, hf, [[5, 6, 7, 8, 9]], [8])


def test_step_abort_and_deltas(f64):
    "step() streams deltas that add up to the output; abort frees blocks, the next step reports it."
    path, hf = f64
    llm = LLM(path, block_size=4, kv_cache_memory=_pool(path, 64, 4))
    eng = llm.engine
    keep = eng.add_request([11, 12, 13, 14, 15], SamplingParams(temperature=0, max_tokens=9),
                           priority=1)
    drop = eng.add_request(list(range(20, 50)), SamplingParams(temperature=0, max_tokens=9))
    deltas, final = [], {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.request_id == keep:
                deltas += out.outputs[0].delta_token_ids
            if out.finished:
                final[out.request_id] = out
        if eng.stats.num_steps == 2:
            assert eng.abort(drop) and not eng.abort("no-such-request")
    assert final[drop].finish_reason == "abort" and final[drop].finished
    assert deltas == final[keep].token_ids == hf_greedy(hf, [11, 12, 13, 14, 15], 9)
    m = final[keep].metrics
    assert m.time_to_first_token > 0 and m.num_output_tokens == len(deltas)
    assert len(deltas) < 2 or m.time_per_output_token > 0
    assert eng.stats.kv_blocks_used == 0


def test_final_only_reports_each_request_once_with_the_cumulative_answer(f64):
    "output_kind='final_only': no output before a request ends, then the same as cumulative's last."
    path, hf = f64
    eng = LLM(path, block_size=4, kv_cache_memory=_pool(path, 64, 4)).engine
    prompts = [[11, 12, 13, 14, 15], list(range(20, 33)), [7, 8]]
    ids = {}
    for kind in ('cumulative', 'final_only'):
        for i, p in enumerate(prompts):
            sp = SamplingParams(temperature=0, max_tokens=4 + 2 * i, output_kind=kind)
            ids[eng.add_request(p, sp)] = (kind, i)
    seen, final = {rid: 0 for rid in ids}, {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            seen[out.request_id] += 1
            if out.finished:
                final[ids[out.request_id]] = out
    for i, p in enumerate(prompts):
        last, only = final['cumulative', i], final['final_only', i]
        assert only.token_ids == last.token_ids == hf_greedy(hf, p, 4 + 2 * i)
        assert only.outputs[0].delta_token_ids == only.token_ids    # all of it, at once
        assert only.finish_reason == last.finish_reason
    assert all(seen[rid] == 1 for rid, (kind, _) in ids.items() if kind == 'final_only')
    assert all(seen[rid] > 1 for rid, (kind, _) in ids.items() if kind == 'cumulative')
    with pytest.raises(ValueError, match="output_kind must be one of"):
        SamplingParams(output_kind='deltas')


def test_delta_outputs_hold_only_what_is_new(f64):
    """output_kind='delta': each output holds only the step's ids and logprobs, which add up to
    the cumulative answer (two samples, logprobs); a stream of n tokens copies n, not ~n²/2."""
    path, _ = f64
    eng = LLM(path, block_size=4, kv_cache_memory=_pool(path, 64, 4)).engine
    outs = {}
    for kind in ('cumulative', 'delta'):        # one at a time: the same steps, the same bits
        sp = SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=12, logprobs=2,
                            ignore_eos=True, output_kind=kind)
        eng.add_request([11, 12, 13, 14, 15], sp)
        outs[kind] = [out for _ in range(40) for out in eng.step()]
        assert not eng.has_unfinished_requests()
    answer, deltas = outs['cumulative'][-1], outs['delta']
    assert deltas[-1].finished and {o.output_kind for o in deltas} == {'delta'}
    for whole in answer.outputs:
        pieces = [out.outputs[whole.index] for out in deltas]
        assert all(p.token_ids == p.delta_token_ids for p in pieces)
        assert sum((p.token_ids for p in pieces), []) == whole.token_ids
        assert sum((p.logprobs for p in pieces), []) == whole.logprobs
    copied = {kind: sum(len(c.token_ids) for out in seen for c in out.outputs)
              for kind, seen in outs.items()}
    assert copied['delta'] == 2 * 12 < copied['cumulative']
    merged = functools.reduce(merge_outputs, deltas)       # a reader that fell behind
    for whole, got in zip(answer.outputs, merged.outputs):
        assert (got.token_ids, got.logprobs) == (whole.token_ids, whole.logprobs)


def test_generate_asks_for_final_outputs_and_streams_still_get_deltas(f64):
    "LLM.generate reads final outputs only; a stream beside it still gets its tokens step by step."
    path, hf = f64
    llm = LLM(path, block_size=4, kv_cache_memory=_pool(path, 64, 4))
    stream = llm.stream_outputs([11, 12, 13], SamplingParams(temperature=0, max_tokens=6))
    first = next(stream)
    assert len(first.token_ids) == 1 and not first.finished
    outs = llm.generate([[5, 6, 7], [9, 10]], SamplingParams(temperature=0, max_tokens=5),
                        use_tqdm=False)
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 5) for p in ([5, 6, 7], [9, 10])]
    rest = [out.outputs[0].delta_token_ids for out in stream]
    assert first.token_ids + sum(rest, []) == hf_greedy(hf, [11, 12, 13], 6)


def test_logprobs_match_transformers(f64):
    "logprobs=k: the raw top-k (and the chosen token) at every step, as transformers computes it."
    path, hf = f64
    llm = LLM(path, block_size=4, kv_cache_memory=_pool(path, 64, 4))
    p = [3, 1, 4, 1, 5, 9, 2, 6]
    o = llm.generate([p], SamplingParams(temperature=0, max_tokens=5, logprobs=3),
                     use_tqdm=False)[0]
    lps = o.outputs[0].logprobs
    assert len(lps) == len(o.token_ids)
    with torch.inference_mode():
        want = hf(torch.tensor([p + o.token_ids])).logits[0, len(p) - 1:-1].float().log_softmax(-1)
    for step, (d, t) in enumerate(zip(lps, o.token_ids)):
        top = want[step].topk(3)
        assert list(d)[:3] == top.indices.tolist() and t in d
        assert max(abs(d[i] - want[step, i].item()) for i in d) < 1e-5


@pytest.fixture(scope="module")
def qwen3_text_path(tmp_path_factory):
    "A random-weight Qwen3 folder (float64) with the real Qwen3 tokenizer: outputs carry text."
    qwen3_tokenizer = pytest.importorskip("qwen3_tokenizer")
    path = tmp_path_factory.mktemp("qwen3_text")
    try:
        qwen3_tokenizer.write_qwen3_tokenizer(path)
    except Exception as e:
        pytest.skip(f"no offline Qwen3 tokenizer here: {e}")
    _checkpoint(path, torch.float64, vocab_size=151936, hidden_size=32, intermediate_size=64,
                num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
                bos_token_id=151643, eos_token_id=151645, initializer_range=0.5)
    return path


@pytest.fixture(scope="module")
def qwen3_text(qwen3_text_path):
    "The engine over qwen3_text_path."
    return LLM(qwen3_text_path, block_size=8, kv_cache_memory=64 * 2**20)


def test_text_stop_strings_chat_and_stream(qwen3_text):
    "Real Qwen3 tokenizer: text == decode(tokens); stop strings; chat; stream; closing it aborts."
    llm = qwen3_text
    tok = llm.tokenizer
    sp = SamplingParams(temperature=0, max_tokens=24)
    out = llm.generate("Hello, world", sp, use_tqdm=False)[0]
    assert out.prompt == "Hello, world"
    assert out.prompt_token_ids == tok.encode("Hello, world", add_special_tokens=True)
    assert out.text == tok.decode(out.token_ids) and out.finish_reason in ("length", "stop")
    text = out.text
    stop = next(text[i:i + 2] for i in range(len(text) // 2, len(text) - 1)
                if text[i:i + 2].strip() == text[i:i + 2])
    cut = llm.generate("Hello, world", replace(sp, stop=[stop]), use_tqdm=False)[0]
    assert cut.finish_reason == "stop" and cut.outputs[0].stop_reason == stop
    assert cut.text == text[:text.index(stop)] and len(cut.token_ids) <= len(out.token_ids)
    # chat: the prompt is the chat template's rendering
    conv = [{"role": "user", "content": "Hi!"}]
    c = llm.chat(conv, sp, enable_thinking=False, use_tqdm=False)[0]
    assert c.prompt_token_ids == tok.apply_chat_template(conv, enable_thinking=False, tokenize=True)
    # stream: deltas add up to the text generate() gives
    assert "".join(llm.stream(conv, sp, enable_thinking=False)) == c.text
    it = llm.stream("Hello, world", sp)
    next(iter(it), None)
    it.close()   # the caller stops listening: the request is aborted and its blocks freed
    assert not llm.engine.requests and llm.stats.kv_blocks_used == 0


def _read_in_turn(streams, max_rounds=500):
    "Read one piece from each live stream in turn until all end (bounded); the texts, rounds used."
    texts, live = [''] * len(streams), list(range(len(streams)))
    for rounds in range(max_rounds):
        if not live:
            return texts, rounds
        for i in list(live):
            piece = next(streams[i], None)
            if piece is None:
                live.remove(i)
            else:
                texts[i] += piece
    raise AssertionError(f"streams {live} still running after {max_rounds} rounds")


def test_streams_read_in_turn_each_get_their_own_text(qwen3_text):
    "Two streams read alternately both finish, each with the text its prompt gets alone."
    llm = qwen3_text
    sp = SamplingParams(temperature=0, max_tokens=16)
    prompts = ["Hello, world", "The sea is", "One, two, three,"]
    alone = [llm.generate(p, sp, use_tqdm=False)[0].text for p in prompts]
    texts, _ = _read_in_turn([llm.stream(p, sp) for p in prompts])
    assert texts == alone
    assert not llm.engine.requests and llm.stats.kv_blocks_used == 0


def test_a_stream_left_waiting_during_generate_keeps_its_text(qwen3_text):
    "generate() steps the engine for its own batch; a paused stream's tokens wait for it, merged."
    llm = qwen3_text
    sp = SamplingParams(temperature=0, max_tokens=16)
    alone = llm.generate(["Hello, world", "The sea is"], sp, use_tqdm=False)
    waiting = llm.stream("Hello, world", sp)
    head = next(waiting)
    during = llm.generate("The sea is", sp, use_tqdm=False)[0]
    assert during.text == alone[1].text
    assert head + "".join(waiting) == alone[0].text
    assert not llm.engine.requests and llm.stats.kv_blocks_used == 0


def test_the_package_root_offers_the_api():
    "`from petite_llm import LLM, SamplingParams` works, as vLLM users type it."
    import petite_llm
    from petite_llm import LLM as RootLLM, LLMEngine, SamplingParams as RootSamplingParams
    assert RootLLM is LLM and RootSamplingParams is SamplingParams
    assert LLMEngine is LLM.__init__.__globals__["LLMEngine"]
    assert {"LLM", "LLMEngine", "SamplingParams"} <= set(petite_llm.__all__)


def test_engine_stats_extend_the_scheduler_stats(f64):
    "One stats API: EngineStats carries the scheduler's counters under the same names."
    path, hf = f64
    llm = LLM(path, block_size=4, kv_cache_memory=_pool(path, 64, 4))
    engine = llm.engine
    engine.add_request([5] * 9, SamplingParams(temperature=0, max_tokens=4))
    engine.step()
    scheduler_stats, engine_stats = engine.scheduler.stats, engine.stats
    assert isinstance(engine_stats, SchedulerStats)
    assert {k: getattr(engine_stats, k) for k in vars(scheduler_stats)} == vars(scheduler_stats)
    assert engine_stats.num_running == 1 and engine_stats.kv_blocks_used == 3
    assert engine_stats.num_steps == 1 and engine_stats.num_prompt_tokens == 9
    assert engine_stats.kv_cache_usage == 3 / 64


def test_default_kv_budget_is_logged(f64, caplog):
    "Without kv_cache_memory the CPU budget comes from available memory (capped), and is logged."
    path, hf = f64
    with caplog.at_level(logging.INFO, logger="petite_llm.engine"):
        llm = LLM(path, max_num_seqs=4)
    assert "available memory" in caplog.text
    per_token = kv_bytes_per_block(ModelConfig.from_pretrained(path), 1, torch.float64)
    assert 0 < llm.kv_cache_memory <= 4 * 256 * per_token
    _check_greedy(llm, hf, _prompts(0)[:4], _max_tokens(0)[:4])


# --------------------------------------------- bfloat16 on a CPU: linear layers packed for oneDNN

@pytest.mark.skipif(not packed_linear_available(torch.bfloat16),
                    reason="this CPU's oneDNN has no bfloat16 kernels")
# Qwen3 with a tied lm_head; Qwen2 untied, with q/k/v biases
@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_packed_bf16_engine_packs_every_linear(tmp_path, arch):
    "A bf16 folder's engine packs every linear layer; its logits are the plain model's, to bf16."
    if arch == "qwen3":
        _checkpoint(tmp_path, torch.bfloat16, seed=3, tie_word_embeddings=True)
    else:
        torch.manual_seed(3)
        cfg = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, max_position_embeddings=256,
                                       tie_word_embeddings=False, bos_token_id=1, eos_token_id=EOS,
                                       initializer_range=0.2)
        model = transformers.Qwen2ForCausalLM(cfg)
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, torch.nn.Linear) and m.bias is not None:
                    m.bias.normal_(0, 0.2)   # biases start at 0: make them count
        model.to(torch.bfloat16).save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), kv_cache_memory=1 << 20, max_num_batched_tokens=16)
    packed, plain = llm.engine.model, load_model(tmp_path)
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in plain.modules())
    assert n_linear == 4 * 2 + 1
    assert sum(isinstance(m, PackedLinear) for m in packed.modules()) == n_linear
    assert not any(isinstance(m, torch.nn.Linear) for m in packed.modules())
    prompts = _prompts(seed=4)[:6]
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor(p)
            positions = torch.arange(len(p))
            # every position's logits: another kernel may add in another order, so to bf16's
            # rounding, not bit for bit (on some CPUs the two are identical, on others not)
            want = plain(ids, positions).float()
            torch.testing.assert_close(packed(ids, positions).float(), want, rtol=0,
                                       atol=2**-6 * want.abs().max().item())
    # a model passed in is not packed
    plain_llm = LLM(plain, kv_cache_memory=1 << 20, max_num_batched_tokens=16)
    assert not any(isinstance(m, PackedLinear) for m in plain_llm.engine.model.modules())


def test_only_bf16_is_packed(f32):
    "float32 and float64 keep F.linear: packing would change fp32's last bits; fp64 has no kernel."
    for dtype in (torch.float32, torch.float64):
        model = load_model(f32[0], dtype=dtype)
        assert prepack_linears(model) == 0
        assert not any(isinstance(m, PackedLinear) for m in model.modules())


def test_dtype_names_come_from_the_one_table(f32, f64):
    "dtype= takes any spelling of the table; None and 'auto' run float32 in the default dtype."
    from petite_llm.engine.loading import default_dtype
    path = f32[0]
    for dtype, want in [('FP64', torch.float64), ('torch.float64', torch.float64),
                        ('fp32', torch.float32),
                        ('auto', default_dtype('cpu')), (None, default_dtype('cpu'))]:
        llm = LLM(path, dtype=dtype, kv_cache_memory=1 << 20)
        assert next(llm.engine.model.parameters()).dtype == want
    # a float64 checkpoint was stored so on purpose: the default keeps it
    llm = LLM(f64[0], kv_cache_memory=1 << 20)
    assert next(llm.engine.model.parameters()).dtype == torch.float64
    with pytest.raises(ValueError, match="unknown dtype 'int3'"):
        LLM(path, dtype='int3')


def test_quantization_int8_through_llm(f32):
    "LLM(quantization='int8'): no float linear is left and it generates; bad values are refused."
    from petite_llm.model.quantization import Int8Linear
    path, hf = f32
    llm = LLM(path, dtype=torch.float32, quantization='int8', kv_cache_memory=1 << 20)
    linears = [m for m in llm.engine.model.modules() if isinstance(m, torch.nn.Linear)]
    assert not linears and any(isinstance(m, Int8Linear) for m in llm.engine.model.modules())
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=4),
                       use_tqdm=False)[0]
    assert len(out.token_ids) == 4
    with pytest.raises(ValueError, match="unknown quantization 'int4'"):
        LLM(path, quantization='int4')
    with pytest.raises(ValueError, match="quantization applies to a model the engine loads"):
        LLM(llm.engine.model, quantization='int8')


def test_quantization_reads_q8_0_from_a_gguf_in_a_folder(tmp_path, caplog):
    "A folder holding one .gguf is that file: its Q8_0 matrix (SmolLM2's head) comes from its blocks."
    from petite_llm.model.weights import smollm2_gguf_path
    (tmp_path/'model.gguf').symlink_to(smollm2_gguf_path())
    with caplog.at_level(logging.INFO, logger="petite_llm.engine"):
        LLM(tmp_path, quantization='int8', kv_cache_memory=1 << 20)
    assert "(1 of them read from Q8_0 blocks)" in caplog.text


def test_compiled_engine_greedy_parity_f64(f64):
    "With enable_torch_compile, chunked prefill and decode still give transformers' greedy tokens."
    path, hf = f64
    llm = LLM(path, block_size=4, max_num_batched_tokens=16, enable_torch_compile=True,
              kv_cache_memory=_pool(path, 1024, 4))
    assert llm.engine.runner.compiled is not None
    _check_greedy(llm, hf, _prompts(2)[:6], _max_tokens(2)[:6])


def test_compile_refusals(f64, monkeypatch):
    "torch.compile is refused off the CPU and without a C++ compiler, each with what to do."
    config = ModelConfig.from_pretrained(f64[0])
    compiled = EngineConfig(enable_torch_compile=True)
    assert any("CUDA graphs" in p for p in compiled.check(config, torch.device('meta')))
    monkeypatch.setenv('CXX', 'no-such-c++-compiler')
    with pytest.raises(ValueError, match="install g\\+\\+"):
        LLM(f64[0], enable_torch_compile=True)


# --- one EngineConfig; the GPU memory rule, on fake readings -----------------------------------

def test_engine_config_is_what_llm_and_the_engine_keep(f64):
    "Keyword options update the default EngineConfig (the device's choice of overlap filled in)."
    path, _ = f64
    llm = LLM(path, block_size=4, kv_cache_memory=1 << 20, max_num_batched_tokens=32)
    assert llm.engine.config == EngineConfig(block_size=4, kv_cache_memory=1 << 20,
                                             max_num_batched_tokens=32, async_scheduling=False)
    assert llm.engine.scheduler.max_num_seqs == 32    # no more sequences than tokens a step
    config = EngineConfig(block_size=8, kv_cache_memory=1 << 20)
    assert (LLM(path, config, max_model_len=64).engine.config ==
            config.updated(max_model_len=64, async_scheduling=False))
    with pytest.raises(TypeError, match="max_model_len"):
        LLM(path, max_model_length=64)
    with pytest.raises(ValueError, match="from_pretrained"):
        LLMEngine(llm.engine.model, dtype='float32')


class FakeGPU:
    "A GPU's memory as readings: total, and what the engines on it have allocated."
    def __init__(self, total):
        self.total, self.used = total, 0

    def allocate(self, num_bytes):
        assert self.used + num_bytes <= self.total, "the fake GPU ran out of memory"
        self.used += num_bytes


def _start(gpu, utilization, weights=3 * 2**30, activations=2**30):
    "An engine's start: its weights, then the KV pool the rule sizes from the readings."
    from petite_llm.engine.sizing import gpu_kv_cache_budget
    gpu.allocate(weights)
    kv = gpu_kv_cache_budget(gpu.total, gpu.total - gpu.used, weights, activations, utilization)
    gpu.allocate(kv)
    return kv


def test_gpu_memory_utilization_composes():
    "Two engines at 0.3 fit on one GPU; a third that does not fit is refused before its pool."
    gpu = FakeGPU(80 * 2**30)
    first, second = _start(gpu, 0.3), _start(gpu, 0.3)
    # each takes 0.3 of the GPU in all: weights + activations + KV, whatever the other holds
    assert first == second == int(80 * 2**30 * 0.3) - 4 * 2**30
    used = gpu.used
    with pytest.raises(ValueError) as e:
        _start(gpu, 0.5)
    assert gpu.used - used == 3 * 2**30          # its weights only: no KV pool was allocated
    message = str(e.value)
    assert 'only 31.00 GiB of the GPU is free' in message and 'weights' in message
    # the fix it names: at most (free + weights) / total, which then fits
    most = float(message.split('at most ')[1].split(',')[0])
    assert most == 0.42                          # (31 + 3) / 80, rounded down
    gpu.used = used
    _start(gpu, most - 0.01)


@pytest.mark.parametrize("device_type,total_gib,name,want", [
    ('cpu', 0, '', (2048, 256)),
    ('cuda', 80, 'NVIDIA H100 80GB HBM3', (16384, 1024)),
    ('cuda', 141, 'NVIDIA H200', (16384, 1024)),
    ('cuda', 80, 'NVIDIA A100-SXM4-80GB', (8192, 256)),     # vLLM keeps the A100 at the smaller
    ('cuda', 24, 'NVIDIA L4', (8192, 256))])
def test_batch_defaults_follow_the_device(device_type, total_gib, name, want):
    "Unset batch limits: vLLM's LLM-class defaults by GPU memory and name; the CPU's own."
    from petite_llm.engine.config import batch_defaults
    assert batch_defaults(device_type, total_gib * 2**30, name) == want


def test_batch_limits_given_win_and_seqs_never_exceed_tokens():
    "A given limit is kept; max_num_seqs defaults to no more than max_num_batched_tokens."
    from petite_llm.engine.config import EngineConfig
    assert EngineConfig().batch_limits('cpu') == (2048, 256)
    assert EngineConfig(max_num_batched_tokens=64).batch_limits('cpu') == (64, 64)
    assert EngineConfig(max_num_seqs=8).batch_limits('cpu') == (2048, 8)


def test_conflicting_options_are_refused_together():
    "EngineConfig names every rule a combination breaks, each with its way out, before any load."
    with pytest.raises(ValueError) as refused:
        EngineConfig(tensor_parallel_size=3, async_scheduling=True, batch_invariant=True,
                     enable_torch_compile=True)
    for rule in ("batch_invariant=True cannot run with enable_torch_compile=True",
                 "tensor_parallel_size=3 does not run with async_scheduling=True",
                 "tensor_parallel_size=3 does not run with enable_torch_compile",
                 "use tensor_parallel_size 1 or 2"):
        assert rule in str(refused.value)
    ngram = {'method': 'ngram', 'num_speculative_tokens': 2}
    assert EngineConfig(tensor_parallel_size=2, speculative_config=ngram).check() == []
    assert EngineConfig(tensor_parallel_size=2, batch_invariant=True).check() == []


def test_too_little_room_names_the_sizes_and_the_fix():
    from petite_llm.engine.sizing import gpu_kv_cache_budget
    with pytest.raises(ValueError, match=r"weights take 30.00 GiB.*raise gpu_memory_utilization"):
        gpu_kv_cache_budget(80 * 2**30, 79 * 2**30, 30 * 2**30, 2**30, 0.3)


def test_engine_sizes_its_pool_before_allocating(f64, monkeypatch):
    "A refused budget leaves nothing allocated: the KV pool is sized before the runner exists."
    import petite_llm.engine.runner as runner
    import petite_llm.engine.sizing as sizing
    path, _ = f64
    model = LLM(path, kv_cache_memory=1 << 20).engine.model
    allocated = []
    monkeypatch.setattr(runner, 'allocate_kv_cache', lambda *a: allocated.append(a))

    def refuse(models, utilization, max_num_batched_tokens, max_num_seqs):
        raise ValueError("the KV cache would take more than is free")
    monkeypatch.setattr(sizing, 'default_kv_cache_memory', refuse)
    with pytest.raises(ValueError, match="more than is free"):
        LLMEngine(model, gpu_memory_utilization=0.5)
    assert allocated == []


# --- async scheduling: step n+1 scheduled and launched before step n's tokens are on the host ---

def _both(path, **kw):
    "The same engine options, with async scheduling off and on."
    return LLM(path, **kw), LLM(path, async_scheduling=True, **kw)

def _ids(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def _runner_calls(engine) -> list[tuple[str, object]]:
    "Record the runner's launch and resolve calls, with the StepInFlight each made or took."
    calls, runner = [], engine.runner
    launch, resolve = runner.launch, runner.resolve

    def recording_launch(scheduled, prev=None):
        step = launch(scheduled, prev)
        calls.append(('launch', step))
        return step

    def recording_resolve(step):
        calls.append(('resolve', step))
        return resolve(step)
    runner.launch, runner.resolve = recording_launch, recording_resolve
    return calls


def test_the_serial_step_is_resolve_of_launch(f64):
    "Serial: every step is launch then resolve of that step; async: resolved after the next launch."
    path, _ = f64
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    for llm in _both(path, block_size=4, kv_cache_memory=_pool(path, 64, 4)):
        calls = _runner_calls(llm.engine)
        llm.generate([[1, 2, 3], [4, 5, 6, 7]], params, use_tqdm=False)
        launched = [step for kind, step in calls if kind == 'launch']
        resolved = [step for kind, step in calls if kind == 'resolve']
        assert resolved == launched and len(launched) == 5        # each step resolved once
        if llm.engine.config.async_scheduling:
            # step k's resolve comes after step k + 1's launch
            assert calls[:3] == [('launch', launched[0]), ('launch', launched[1]),
                                 ('resolve', launched[0])]
        else:
            assert calls == [(kind, step) for step in launched for kind in ('launch', 'resolve')]


@pytest.mark.parametrize("block_size,budget", [(16, 8), (1, 2048), (4, 8)])
def test_async_greedy_parity_f64(f64, block_size, budget):
    "16 prompts, chunked prefill, any block size: async tokens == transformers == async off."
    path, hf = f64
    off, on = _both(path, block_size=block_size, max_num_batched_tokens=budget,
                    kv_cache_memory=_pool(path, 4096 // block_size, block_size))
    prio = [i % 3 for i in range(16)]
    want = _check_greedy(off, hf, _prompts(0), _max_tokens(0), priority=prio)
    got = _check_greedy(on, hf, _prompts(0), _max_tokens(0), priority=prio)
    assert _ids(got) == _ids(want)
    s = on.stats
    assert s.kv_blocks_used == 0 and s.num_running == s.num_waiting == 0
    assert not on.engine.has_unfinished_requests()
    assert s.num_generated_tokens == off.stats.num_generated_tokens
    assert s.num_prompt_tokens == off.stats.num_prompt_tokens


def test_async_prefix_hits_and_preemption_f64(f64):
    "Shared prefixes hit the cache, and a 24-block pool preempts: async tokens == transformers."
    path, hf = f64
    on = LLM(path, block_size=4, max_num_batched_tokens=48, kv_cache_memory=_pool(path, 512, 4),
             async_scheduling=True)
    prompts, mt = _prompts(1, shared=40), _max_tokens(1)
    _check_greedy(on, hf, prompts, mt, priority=[(i * 7) % 4 for i in range(16)])
    _check_greedy(on, hf, prompts, mt)
    assert on.engine.block_manager.num_hit_tokens >= 40
    tiny = LLM(path, block_size=4, max_num_batched_tokens=64, kv_cache_memory=_pool(path, 24, 4),
               async_scheduling=True)
    _check_greedy(tiny, hf, _prompts(0), [12] * 16, priority=[(i * 5) % 3 for i in range(16)])
    assert tiny.stats.num_preemptions > 0 and tiny.stats.kv_blocks_used == 0


def test_async_stops_at_random_points_f64(f64):
    "Stop tokens met mid-flight: the step already launched after them emits nothing."
    path, hf = f64
    off, on = _both(path, block_size=4, max_num_batched_tokens=32,
                    kv_cache_memory=_pool(path, 40, 4))
    prompts, rng = _prompts(5), random.Random(5)
    full = [hf_greedy(hf, p, 12) for p in prompts]
    sps = [SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[rng.choice(ids)])
           for ids in full]
    want = off.generate(prompts, sps, use_tqdm=False)
    got = on.generate(prompts, sps, use_tqdm=False)
    assert _ids(got) == _ids(want)
    for o, ids, sp in zip(got, full, sps):
        stop = sp.stop_token_ids[0]
        assert o.token_ids == ids[:ids.index(stop) + 1]
        assert o.finish_reason == 'stop' and o.outputs[0].stop_reason == stop
    assert on.stats.kv_blocks_used == 0


def test_async_seeded_samples_and_penalties_f64(f64):
    "n > 1 seeded, min_tokens, then penalties (counted on the device) too: the tokens of async off."
    path, hf = f64
    off, on = _both(path, block_size=4, max_num_batched_tokens=64,
                    kv_cache_memory=_pool(path, 48, 4))
    prompts = _prompts(6)[:8]
    sps = [SamplingParams(n=3, temperature=0.9, top_k=50, top_p=0.95, seed=7 + i, max_tokens=10,
                          min_tokens=3) for i in range(8)]
    want = off.generate(prompts, sps, use_tqdm=False)
    got = on.generate(prompts, sps, use_tqdm=False)
    assert _ids(got) == _ids(want) and on.stats.num_preemptions > 0
    sps[3] = replace(sps[3], repetition_penalty=1.3)
    sps[5] = replace(sps[5], presence_penalty=0.8, frequency_penalty=0.5)
    sps[6] = replace(sps[6], temperature=0, repetition_penalty=1.2)    # greedy, penalized
    calls = _runner_calls(on.engine)
    assert _ids(on.generate(prompts, sps, use_tqdm=False)) == \
        _ids(off.generate(prompts, sps, use_tqdm=False))
    launched = [step for kind, step in calls if kind == 'launch']
    assert calls[:3] == [('launch', launched[0]), ('launch', launched[1]),
                         ('resolve', launched[0])]              # they overlap
    assert all(step.output is None for step in launched)          # none sampled on the host


def test_async_penalties_count_the_pending_token_f64(f64):
    "Penalties that pay for repeating (each count adds): the token still on the device counts."
    path, _ = f64
    off, on = _both(path, block_size=4, kv_cache_memory=_pool(path, 64, 4))
    prompts = _prompts(7)[:4]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                            frequency_penalty=-2.0, repetition_penalty=0.5)
    want = [o.token_ids for o in off.generate(prompts, params, use_tqdm=False)]
    assert [o.token_ids for o in on.generate(prompts, params, use_tqdm=False)] == want


def test_launch_reads_nothing_back_whatever_the_request_asks(f64):
    """Greedy, Qwen3's own sampling, seeded samples, min_tokens, logprobs, penalties: no launch
    reads a tensor back (on a CPU, .tolist() cannot be seen; .item(), masks and the rest can)."""
    path, _ = f64
    llm = LLM(path, block_size=4, kv_cache_memory=_pool(path, 64, 4), async_scheduling=True)
    runner, reads = llm.engine.runner, []
    launch = runner.launch

    def recording(scheduled, prev=None):
        with HostReads() as mode:
            step = launch(scheduled, prev)
        reads.append(mode.found)
        return step
    runner.launch = recording
    qwen3 = SamplingParams(temperature=0.6, top_k=20, top_p=0.95, max_tokens=5)
    # the shared generator of unseeded rows is seeded once, from torch's own (a CPU draw)
    llm.generate([[1, 2, 3]], qwen3, use_tqdm=False)
    for params in [SamplingParams(temperature=0, max_tokens=5), qwen3,
                   SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=5),
                   SamplingParams(temperature=0.7, min_tokens=3, max_tokens=5),
                   SamplingParams(temperature=0.7, logprobs=2, max_tokens=5),
                   SamplingParams(temperature=0.7, repetition_penalty=1.2, presence_penalty=0.5,
                                  max_tokens=5)]:
        reads.clear()
        llm.generate([[1, 2, 3], [4, 5, 6, 7, 8]], params, use_tqdm=False)
        assert len(reads) >= 5 and all(found == [] for found in reads), (params, reads)


def test_async_logprobs_overlap_and_match_serial_steps(f64):
    """logprobs are found on the device and read in resolve: a step asking for them still
    launches before the one in flight resolves, and they equal the serial engine's."""
    path, _ = f64
    off, on = _both(path, block_size=4, kv_cache_memory=_pool(path, 64, 4))
    sps = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3),
           SamplingParams(temperature=0.8, seed=5, max_tokens=6, ignore_eos=True, logprobs=0),
           SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)]
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
    want = off.generate(prompts, sps, use_tqdm=False)
    calls = _runner_calls(on.engine)
    got = on.generate(prompts, sps, use_tqdm=False)
    launched = [step for kind, step in calls if kind == 'launch']
    assert calls[:3] == [('launch', launched[0]), ('launch', launched[1]),
                         ('resolve', launched[0])]
    assert all(step.output is None for step in launched)          # none sampled on the host
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids and g.outputs[0].logprobs == w.outputs[0].logprobs
    assert [len(lp) for lp in got[0].outputs[0].logprobs] == [3] * 6     # the chosen is a top 3
    assert all(len(lp) == 1 for lp in got[1].outputs[0].logprobs)        # logprobs=0: the chosen
    assert got[2].outputs[0].logprobs is None


def test_async_abort_mid_flight(f64):
    "A request aborted while its step is out: reported once as aborted; the other runs on exactly."
    path, hf = f64
    eng = LLM(path, block_size=4, kv_cache_memory=_pool(path, 64, 4), async_scheduling=True).engine
    keep = eng.add_request([11, 12, 13, 14, 15], SamplingParams(temperature=0, max_tokens=9),
                           priority=1)
    drop = eng.add_request(list(range(20, 50)), SamplingParams(temperature=0, max_tokens=9))
    assert eng.step() == []                       # the first step is launched, not resolved
    deltas, final, aborted = [], {}, False
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.request_id == keep:
                deltas += out.outputs[0].delta_token_ids
            if out.finished:
                assert out.request_id not in final
                final[out.request_id] = out
        if eng.stats.num_steps == 2 and not aborted:
            assert eng._in_flight is not None
            assert eng.abort(drop)
            aborted = True
    assert final[drop].finish_reason == "abort"
    assert deltas == final[keep].token_ids == hf_greedy(hf, [11, 12, 13, 14, 15], 9)
    assert eng.stats.kv_blocks_used == 0


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_async_attention_backends(f64, backend):
    "Both attention backends (triton in its interpreter on a CPU) give transformers' tokens."
    path, hf = f64
    on = LLM(path, block_size=4, max_num_batched_tokens=16, kv_cache_memory=_pool(path, 64, 4),
             attention_backend=backend, async_scheduling=True)
    assert on.engine.runner.backend.name == backend
    _check_greedy(on, hf, _prompts(0)[:4], [5] * 4)


def test_async_scheduling_refuses_speculative_decoding(f64):
    path, hf = f64
    with pytest.raises(ValueError, match="async_scheduling.*speculative_config"):
        LLM(path, async_scheduling=True,
            speculative_config={'method': 'ngram', 'num_speculative_tokens': 2})


def test_async_stop_strings_and_stream(qwen3_text, qwen3_text_path):
    "Real tokenizer: stop strings found after a step was launched, and streams, as async off."
    llm = qwen3_text
    on = LLM(qwen3_text_path, block_size=8, kv_cache_memory=64 * 2**20, async_scheduling=True)
    sp = SamplingParams(temperature=0, max_tokens=24)
    text = llm.generate("Hello, world", sp, use_tqdm=False)[0].text
    stops = [text[i:i + 2] for i in range(4, len(text) - 1, 5)
             if text[i:i + 2].strip() == text[i:i + 2]][:3]
    prompts = ["Hello, world"] + ["Once upon a time", "1, 2, 3,"] * 2
    sps = [replace(sp, stop=stops)] + [replace(sp, stop=[s]) for s in ("e", "e", " 4", " 4")]
    want = llm.generate(prompts, sps, use_tqdm=False)
    got = on.generate(prompts, sps, use_tqdm=False)
    for w, g in zip(want, got):
        assert (g.text, g.token_ids, g.finish_reason, g.outputs[0].stop_reason) == \
            (w.text, w.token_ids, w.finish_reason, w.outputs[0].stop_reason)
    assert "".join(on.stream("Hello, world", sp)) == text
    assert on.stats.kv_blocks_used == 0 and not on.engine.has_unfinished_requests()


def test_a_dropped_engine_leaves_no_pool_on_the_model(tmp_path):
    "The model's layers hold no KV pool between steps: dropping an engine frees its pool."
    import gc
    import weakref
    _checkpoint(tmp_path, torch.float32)
    model = load_model(tmp_path)
    engine = LLMEngine(model, kv_cache_memory=1 << 20)
    engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    pool = weakref.ref(engine.runner.kv_caches[0][0])
    del engine
    gc.collect()
    assert pool() is None
    assert all(getattr(m, 'kv_cache', None) is None for m in model.modules())


def test_async_scheduling_default_follows_the_device():
    "None: on for one CUDA rank without speculation, off on a CPU; an explicit value wins."
    config, ngram = EngineConfig(), {'method': 'ngram', 'num_speculative_tokens': 2}
    assert config.overlaps('cuda') and not config.overlaps('cpu')
    assert not config.updated(speculative_config=ngram).overlaps('cuda')
    assert not config.updated(tensor_parallel_size=2).overlaps('cuda')
    assert config.updated(async_scheduling=True).overlaps('cpu')
    assert not config.updated(async_scheduling=False).overlaps('cuda')


def test_the_engine_records_its_overlap(f64):
    "On a CPU the default engine runs serial steps, and its config says so."
    path, _ = f64
    assert LLM(path, kv_cache_memory=1 << 20).engine.config.async_scheduling is False
