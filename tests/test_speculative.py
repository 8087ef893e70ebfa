"""Speculative decoding: the config, prompt lookup, greedy verification and the statistical test
that rejection sampling emits the target's distribution (and that two wrong rules fail it)."""
import copy
import math
import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

from petite_llm.model.sampling import Sampler, draw
from petite_llm.model.sampling_params import SamplingParams
from petite_llm.engine.speculative import (SpeculativeConfig, emitted_tokens, ngram_propose,
                                           verify_drafts)
from speculation_stats import pair_chi_square, speculate_pairs, wrong_acceptance, wrong_residual


# --- the config ---------------------------------------------------------------------------------

def test_config_defaults_as_vllm():
    def bounds(**kw):
        cfg = SpeculativeConfig.from_dict({'method': 'ngram', 'num_speculative_tokens': 3, **kw})
        return cfg.prompt_lookup_min, cfg.prompt_lookup_max
    assert bounds() == (5, 5)
    assert bounds(prompt_lookup_max=3) == (3, 3)
    assert bounds(prompt_lookup_min=2) == (2, 2)
    assert bounds(prompt_lookup_min=1, prompt_lookup_max=4) == (1, 4)
    cfg = SpeculativeConfig.from_dict({'model': '/some/draft', 'num_speculative_tokens': 2})
    assert cfg.method == 'draft_model'
    assert SpeculativeConfig.from_dict(cfg) is cfg


@pytest.mark.parametrize("config,words", [
    ({'method': 'ngram', 'num_speculative_tokens': 0}, "num_speculative_tokens must be"),
    ({'method': 'ngram', 'num_speculative_tokens': True}, "num_speculative_tokens must be"),
    ({'method': 'ngram'}, "give num_speculative_tokens"),
    ({'method': 'eagle', 'num_speculative_tokens': 2}, "method must be one of"),
    ({'num_speculative_tokens': 2}, "method must be one of"),
    ({'method': 'draft_model', 'num_speculative_tokens': 2}, "needs 'model'"),
    ({'method': 'ngram', 'num_speculative_tokens': 2, 'model': 'x'}, "takes no 'model'"),
    ({'method': 'draft_model', 'model': 'x', 'num_speculative_tokens': 2,
      'prompt_lookup_max': 3}, "belong to method 'ngram'"),
    ({'method': 'ngram', 'num_speculative_tokens': 2, 'prompt_lookup_min': 0},
     "prompt_lookup_min must be"),
    ({'method': 'ngram', 'num_speculative_tokens': 2, 'prompt_lookup_min': 3,
      'prompt_lookup_max': 2}, "larger than prompt_lookup_max"),
    ({'method': 'ngram', 'num_speculative_tokens': 2, 'k': 2}, "unknown key(s) 'k'"),
    ("ngram", "expected a dict"),
])
def test_config_errors_name_the_problem(config, words):
    with pytest.raises(ValueError, match="speculative_config") as e:
        SpeculativeConfig.from_dict(config)
    assert words in str(e.value)


# --- prompt lookup ------------------------------------------------------------------------------

def lookup_by_hand(tokens, k, lo, hi):
    "The rule in plain loops: the longest suffix in [lo, hi] seen before; its earliest occurrence."
    n = len(tokens)
    for size in range(hi, lo - 1, -1):
        suffix = tokens[n - size:] if size <= n else None
        for start in range(0, n - size):          # the occurrence must end before the last token
            if suffix is not None and tokens[start:start + size] == suffix:
                return tokens[start + size:start + size + k]
    return []


def test_ngram_examples():
    assert ngram_propose([1, 2, 3, 4, 2, 3], 4, 2, 3) == [4, 2, 3]     # vLLM's docstring example
    assert ngram_propose([7, 8, 9, 7, 8, 5, 7, 8], 2, 2, 2) == [9, 7]  # the earliest match
    assert ngram_propose([1, 2, 9, 1, 2, 3, 4, 1, 2, 3], 3, 1, 3) == [4, 1, 2]  # the longest
    assert ngram_propose([3, 3, 3, 3], 4, 1, 2) == [3, 3]              # overlapping the suffix
    assert ngram_propose([1, 2, 3], 4, 1, 3) == []
    assert ngram_propose([4], 4, 1, 1) == []
    assert ngram_propose([4, 4], 4, 2, 2) == []                        # too short for a 2-gram


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=40), k=st.integers(1, 6),
       lo=st.integers(1, 4), extra=st.integers(0, 3))
def test_ngram_matches_the_rule_by_hand(tokens, k, lo, extra):
    assert ngram_propose(tokens, k, lo, lo + extra) == lookup_by_hand(tokens, k, lo, lo + extra)


# --- verification -------------------------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(data=st.data(), num_drafts=st.lists(st.integers(0, 5), min_size=1, max_size=6),
       sampled_q=st.booleans())
def test_greedy_verification_keeps_the_agreeing_prefix(data, num_drafts, sampled_q):
    "One-hot p (greedy): drafts are accepted while they equal the argmax, which then follows."
    V = 7
    rows, ids, want = [], [], []
    for d in num_drafts:
        argmax = data.draw(st.lists(st.integers(0, V - 1), min_size=d + 1, max_size=d + 1))
        # drafts right with probability about 2/3 each, so that long accepted runs occur
        drafts = [a if data.draw(st.integers(0, 2)) else data.draw(st.integers(0, V - 1))
                  for a in argmax[:d]]
        rows += argmax
        ids += drafts + [-1]
        agree = next((j for j in range(d) if drafts[j] != argmax[j]), d)
        want.append(drafts[:agree] + [argmax[agree]])
    p = torch.nn.functional.one_hot(torch.tensor(rows), V).float()
    ids = torch.tensor(ids)
    # a greedy draft model's q is one-hot at its draft too; zero where there is no draft
    q = torch.nn.functional.one_hot(ids.clamp(min=0), V).float() * (ids >= 0).unsqueeze(-1)
    accepted, recovered = verify_drafts(p, ids, q if sampled_q else None, torch.ones(len(rows), V))
    assert emitted_tokens(accepted, recovered, ids, [d + 1 for d in num_drafts]) == want


def test_one_hot_drafts_emit_the_plain_draw():
    "With one-hot q, the emitted tokens are the draws from p that the same noise gives anyway."
    g = torch.Generator().manual_seed(0)
    p = torch.randn(12, 9, generator=g).softmax(-1)
    noise = torch.empty(12, 9).exponential_(generator=g)
    plain = draw(p, noise).tolist()
    # drafts equal to the plain draw except at row 2, one sequence of 4 rows, one of 8
    ids = torch.tensor(plain[:2] + [(plain[2] + 1) % 9, -1] + plain[4:11] + [-1])
    tokens = emitted_tokens(*verify_drafts(p, ids, None, noise), ids, [4, 8])
    assert tokens == [plain[:3], plain[4:12]]


# --- exactness: the statistical test -----------------------------------------------------------

V, TRIALS, FIRST = 8, 30_000, 0
FILTERS = {'temperature': SamplingParams(temperature=0.7), 'top_k': SamplingParams(top_k=4),
           'top_p': SamplingParams(top_p=0.8), 'min_p': SamplingParams(min_p=0.1),
           'all': SamplingParams(temperature=1.3, top_k=6, top_p=0.95, min_p=0.02)}


def _tables(params):
    "Toy target and draft (the draft a noisy copy), processed by the sampler: [V, V] each."
    g = torch.Generator().manual_seed(0)
    target = torch.randn(V, V, generator=g) * 1.5
    draft = target + torch.randn(V, V, generator=g)
    def processed(logits):
        return Sampler().probs(logits, [params] * V, [[]] * V, [[]] * V)
    return processed(target), processed(draft)


def _chi_square_passes(verify, params, one_hot=False, seed=1):
    target, draft = _tables(params)
    pairs = speculate_pairs(target, draft, FIRST, 3, TRIALS, torch.Generator().manual_seed(seed),
                            verify, one_hot)
    stat, df, forbidden = pair_chi_square(pairs, target, FIRST)
    return stat < df + 6 * math.sqrt(2 * df) and forbidden == 0


@pytest.mark.parametrize("name", FILTERS)
@pytest.mark.parametrize("one_hot", [False, True], ids=["sampled_q", "one_hot_q"])
def test_rejection_sampling_emits_the_target_distribution(name, one_hot):
    assert _chi_square_passes(verify_drafts, FILTERS[name], one_hot)


@pytest.mark.parametrize("name", ['temperature', 'top_p'])
@pytest.mark.parametrize("wrong", [wrong_acceptance, wrong_residual])
def test_the_statistical_test_catches_wrong_rules(name, wrong):
    assert not _chi_square_passes(wrong, FILTERS[name])


# --- in the engine ------------------------------------------------------------------------------
# The helpers and fixtures of tests/test_engine.py: random-weight Qwen3 checkpoints (no tokenizer,
# prompts are token ids), transformers' greedy continuation of each prompt alone as the oracle.

from dataclasses import replace  # noqa: E402

import transformers  # noqa: E402

from petite_llm.model.config import ModelConfig  # noqa: E402
from petite_llm.engine.llm_engine import LLM  # noqa: E402
from petite_llm.engine.paging import kv_bytes_per_block  # noqa: E402
from test_engine import (EOS, VOCAB, _check_greedy, _checkpoint, _max_tokens,  # noqa: E402
                         _prompts, f64, hf_greedy, qwen3_text_path)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def draft_path(tmp_path_factory):
    "A draft for f64's target: another random Qwen3 with the same vocabulary, one layer."
    path = tmp_path_factory.mktemp("draft_f64")
    _checkpoint(path, torch.float64, seed=7, num_hidden_layers=1)
    return path


@pytest.fixture(scope="module")
def near_draft_path(f64, tmp_path_factory):
    "A draft close to f64's target: its weights, the lm_head nudged (accepts about 60% sampled)."
    path, hf = f64
    near = copy.deepcopy(hf)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        weight = near.lm_head.weight
        weight.add_(torch.randn(weight.shape, generator=g, dtype=weight.dtype) * 0.05)
    draft = tmp_path_factory.mktemp("near_draft_f64")
    near.save_pretrained(draft)
    return draft


def _spec(method, draft=None, k=3):
    if method == 'ngram':
        return {'method': 'ngram', 'num_speculative_tokens': k, 'prompt_lookup_min': 1,
                'prompt_lookup_max': 3}
    return {'method': 'draft_model', 'model': str(draft), 'num_speculative_tokens': k}


def _pool(target, draft, num_blocks, block_size, dtype=torch.float64) -> int:
    "kv_cache_memory for exactly num_blocks blocks of the target's and the draft's K/V."
    configs = [ModelConfig.from_pretrained(p) for p in (target, draft) if p is not None]
    return num_blocks * kv_bytes_per_block(configs, block_size, dtype)


def _llm(path, method, draft, block_size=4, num_blocks=512, k=3, **kw):
    "An engine on `path` that speculates with `method` (draft: the draft model's folder)."
    return LLM(path, block_size=block_size, speculative_config=_spec(method, draft, k),
               kv_cache_memory=_pool(path, draft if method == 'draft_model' else None,
                                     num_blocks, block_size), **kw)


# drafts right for a while: prompts that repeat themselves give prompt lookup matches
def _repetitive_prompts(seed=0):
    rng = random.Random(seed)
    prompts = []
    for n in LENGTHS_REPEAT:
        motif = [rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 6))]
        prompts.append((motif * 20)[:n] + [rng.randrange(3, VOCAB) for _ in range(2)])
    return prompts

LENGTHS_REPEAT = [1, 3, 7, 8, 9, 15, 16, 17, 24, 31, 32, 33, 40, 48, 60, 64]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("block_size,budget,num_blocks", [(16, 2048, 256), (1, 2048, 4096),
                                                          (4, 8, 1024), (4, 64, 24)])
def test_greedy_identity_with_speculation_f64(f64, draft_path, method, block_size, budget,
                                              num_blocks):
    "16 prompts together, speculating: transformers' greedy tokens for each alone, exactly."
    path, hf = f64
    llm = _llm(path, method, draft_path, block_size, num_blocks, max_num_batched_tokens=budget,
               max_model_len=128)
    prompts = _prompts(0)[:8] + _repetitive_prompts(0)[8:]
    _check_greedy(llm, hf, prompts, [12] * 16, priority=[i % 3 for i in range(16)])
    s = llm.stats
    assert s.kv_blocks_used == 0 and s.num_running == s.num_waiting == 0
    assert s.num_draft_tokens > 0 and s.num_accepted_tokens > 0
    if num_blocks == 24:
        assert s.num_preemptions > 0
    if budget == 8:
        assert s.num_steps > sum(len(p) for p in prompts) // 8      # prompts were chunked


def test_adaptive_drafts_back_off_where_they_fail_and_change_no_token_f64(f64, draft_path):
    "A random one-layer draft is rarely right: each sequence proposes far fewer drafts than k."
    path, hf = f64
    prompts, mt = _prompts(3), [24] * 16
    stats = {}
    for adaptive in (False, True):
        llm = LLM(path, block_size=4, kv_cache_memory=_pool(path, draft_path, 512, 4),
                  speculative_config={**_spec('draft_model', draft_path, 4),
                                      'adaptive': adaptive})
        _check_greedy(llm, hf, prompts, mt)           # transformers' tokens either way
        stats[adaptive] = llm.stats
    assert stats[False].acceptance_rate < 0.5         # the draft is mostly wrong
    assert stats[True].num_draft_tokens < stats[False].num_draft_tokens / 2, stats


def test_prefix_hits_with_speculation_f64(f64, draft_path):
    "A shared 40-token prefix hits the prefix cache; the draft recomputes it; tokens unchanged."
    path, hf = f64
    llm = _llm(path, 'draft_model', draft_path, block_size=4, max_num_batched_tokens=48)
    prompts, mt = _prompts(1, shared=40), _max_tokens(1)
    _check_greedy(llm, hf, prompts, mt)
    hits = llm.engine.block_manager.num_hit_tokens
    _check_greedy(llm, hf, prompts, mt)                  # every full block cached now
    assert llm.engine.block_manager.num_hit_tokens - hits == sum((len(p) - 1) // 4 * 4
                                                                for p in prompts)


def test_draft_equal_to_target_accepts_every_greedy_draft(f64):
    path, hf = f64
    llm = _llm(path, 'draft_model', path, k=4)
    outs = _check_greedy(llm, hf, _prompts(2), [16] * 16)
    s = llm.stats
    assert s.acceptance_rate == 1.0 and s.num_draft_tokens > 100
    for o in outs:                                       # per request, in its metrics
        m = o.metrics
        assert m.acceptance_rate == 1.0 and m.num_accepted_tokens == m.num_draft_tokens
        assert m.num_drafts >= 1 and m.mean_accepted_tokens <= 4
    # fewer steps than tokens: up to 5 per step
    assert s.num_steps < max(len(o.token_ids) for o in outs)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_logprobs_are_those_without_speculation(f64, method):
    "The raw top-k logprobs of every token, speculating or not (float64, within 1e-9)."
    path, hf = f64
    sp = SamplingParams(temperature=0, max_tokens=12, logprobs=3)
    prompts = _repetitive_prompts(3)[::3]
    plain = LLM(path, block_size=4).generate(prompts, sp, use_tqdm=False)
    spec = _llm(path, method, path, k=4)
    outs = spec.generate(prompts, sp, use_tqdm=False)
    assert spec.stats.num_accepted_tokens > 0
    for a, b in zip(plain, outs):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert list(la) == list(lb) and max(abs(la[t] - lb[t]) for t in la) < 1e-9


def _sampled(i, temperature):
    "Seeded sampling params with every processor at work, one per prompt."
    return SamplingParams(temperature=temperature, top_k=[0, 50, 8][i % 3],
                          top_p=[1.0, 0.95][i % 2], min_p=[0.0, 0.02][i % 2],
                          repetition_penalty=[1.0, 1.2][i % 2],
                          presence_penalty=[0.0, 0.5][i % 3 == 1], seed=100 + i, max_tokens=10,
                          min_tokens=2)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_seeded_requests_are_batch_and_preemption_invariant(f64, near_draft_path, method):
    "A seeded request draws the same tokens alone, in any batch order and after preemption."
    path, hf = f64
    prompts = _repetitive_prompts(4)
    # prompt lookup guesses right on a random model only when it samples near-greedily
    sps = [_sampled(i, 0.3 if method == 'ngram' else 1.3) for i in range(16)]
    draft_path = near_draft_path
    llm = _llm(path, method, draft_path)
    alone = {i: llm.generate([prompts[i]], sps[i], use_tqdm=False)[0].token_ids for i in (0, 5, 11)}
    batch = [o.token_ids for o in llm.generate(prompts, sps, use_tqdm=False)]
    assert all(batch[i] == alone[i] for i in alone)
    reverse = [o.token_ids for o in llm.generate(prompts[::-1], sps[::-1], use_tqdm=False)][::-1]
    assert reverse == batch
    assert llm.stats.num_accepted_tokens > 0 and llm.stats.acceptance_rate < 1
    tiny = _llm(path, method, draft_path, num_blocks=24, max_num_batched_tokens=128,
                max_model_len=128)
    squeezed = tiny.generate(prompts, sps, priority=[i % 2 for i in range(16)], use_tqdm=False)
    assert tiny.stats.num_preemptions > 0
    assert [o.token_ids for o in squeezed] == batch
    if method == 'ngram':
        # one-hot drafts: one draw from p compared with the draft, so the very tokens as without
        plain = LLM(path, block_size=4).generate(prompts, sps, use_tqdm=False)
        assert [o.token_ids for o in plain] == batch


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_stops_apply_to_each_accepted_token(f64, method):
    "eos, stop ids, min_tokens and max_tokens end a run of accepted drafts where they would."
    path, hf = f64
    prompts = _repetitive_prompts(5)
    plain_llm = LLM(path, block_size=4)
    spec_llm = _llm(path, method, path, k=4)                 # draft == target: long accepted runs
    free = plain_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=14,
                                                      ignore_eos=True), use_tqdm=False)
    params = []
    for i, o in enumerate(free):
        stop_at = o.token_ids[3 + i % 5]                     # a token the run really reaches
        params.append(SamplingParams(temperature=0, max_tokens=4 + i % 9, min_tokens=i % 4,
                                     stop_token_ids=[stop_at] if i % 2 else [],
                                     ignore_eos=i % 3 == 0))
    want = plain_llm.generate(prompts, params, use_tqdm=False)
    got = spec_llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(want, got):
        assert (b.token_ids, b.finish_reason, b.outputs[0].stop_reason) == \
            (a.token_ids, a.finish_reason, a.outputs[0].stop_reason)
    assert spec_llm.stats.num_accepted_tokens > 0 and spec_llm.stats.kv_blocks_used == 0


def test_n_samples_priorities_and_abort_with_speculation(f64, draft_path):
    path, hf = f64
    llm = _llm(path, 'draft_model', draft_path)
    p = _repetitive_prompts(6)[10]
    out = llm.generate([p], SamplingParams(n=3, temperature=0, max_tokens=9), use_tqdm=False)[0]
    assert all(c.token_ids == hf_greedy(hf, p, 9) for c in out.outputs)
    eng = llm.engine
    keep = eng.add_request(p, SamplingParams(temperature=0, max_tokens=9), priority=1)
    drop = eng.add_request(p[:20], SamplingParams(temperature=0, max_tokens=30))
    outs = [o for _ in range(3) for o in eng.step()]
    assert eng.abort(drop)
    while eng.has_unfinished_requests():
        outs += eng.step()
    final = {o.request_id: o for o in outs if o.finished}
    deltas = sum((o.outputs[0].delta_token_ids for o in outs if o.request_id == keep), [])
    assert final[drop].finish_reason == 'abort' and deltas == hf_greedy(hf, p, 9)
    assert eng.stats.kv_blocks_used == 0 and not eng.speculator.draft_probs


def test_stop_strings_and_streams_with_speculation(qwen3_text_path):
    "Real Qwen3 tokenizer: stop strings end a run of drafts; streamed deltas add up to the text."
    plain = LLM(qwen3_text_path, block_size=8, kv_cache_memory=64 * 2**20)
    spec = LLM(qwen3_text_path, block_size=8, kv_cache_memory=128 * 2**20,
               speculative_config={'model': str(qwen3_text_path), 'num_speculative_tokens': 4})
    sp = SamplingParams(temperature=0, max_tokens=24)
    text = plain.generate("Hello, world", sp, use_tqdm=False)[0].text
    assert spec.generate("Hello, world", sp, use_tqdm=False)[0].text == text
    stop = next(text[i:i + 2] for i in range(len(text) // 2, len(text) - 1)
                if text[i:i + 2].strip() == text[i:i + 2])
    want = plain.generate("Hello, world", replace(sp, stop=[stop]), use_tqdm=False)[0]
    got = spec.generate("Hello, world", replace(sp, stop=[stop]), use_tqdm=False)[0]
    assert (got.text, got.token_ids, got.finish_reason, got.outputs[0].stop_reason) == \
        (want.text, want.token_ids, 'stop', stop)
    assert "".join(spec.stream("The sea is", sp)) == plain.generate("The sea is", sp,
                                                                   use_tqdm=False)[0].text
    assert spec.stats.mean_accepted_tokens > 1 and spec.stats.kv_blocks_used == 0


def test_bad_speculative_configs_are_clear_errors(f64, tmp_path):
    path, hf = f64
    other = tmp_path / "other_vocab"
    _checkpoint(other, torch.float64, vocab_size=VOCAB + 8, num_hidden_layers=1)
    short = tmp_path / "short_context"
    _checkpoint(short, torch.float64, num_hidden_layers=1, max_position_embeddings=64)
    cases = [({'model': str(other), 'num_speculative_tokens': 2}, "vocabulary has 308 tokens"),
             ({'model': str(short), 'num_speculative_tokens': 2}, "max_model_len=256"),
             ({'method': 'ngram', 'num_speculative_tokens': 0}, "num_speculative_tokens"),
             ({'method': 'lookahead', 'num_speculative_tokens': 2}, "method must be one of")]
    for config, words in cases:
        with pytest.raises(ValueError, match="speculative_config") as e:
            LLM(path, block_size=4, kv_cache_memory=2**20, speculative_config=config)
        assert words in str(e.value)


def test_verify_steps_run_eagerly_beside_cuda_graphs():
    "Stand-in graphs (triton, interpreted): decode-only steps replay, steps with drafts do not."
    from test_cuda_graphs import _greedy_tokens, _tiny, replay_eagerly
    from petite_llm.engine.llm_engine import LLMEngine
    model = _tiny()
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [7, 8, 9], [5, 6, 5, 6, 5, 6]]
    kw = dict(attention_backend='triton', block_size=4, kv_cache_memory=2**21, max_num_seqs=3,
              max_num_batched_tokens=16, enforce_eager=True)
    eager = LLMEngine(model, **kw)
    # the model as its own draft: every draft accepted, so a step has drafts or nothing to do
    graphed = LLMEngine(model, speculative_config={'model': model, 'num_speculative_tokens': 2},
                        **kw)
    graphed.runner.capture_cuda_graphs(3, graphed.max_model_len, capture=replay_eagerly)
    steps, launch = [], graphed.runner.launch

    def recording_launch(scheduled, prev=None):
        steps.append([any(scheduled.spec_token_ids), 0])
        return launch(scheduled, prev)
    graphed.runner.launch = recording_launch
    graphed.runner.cuda_graphs.graphs = {
        size: ((lambda r=replay: (steps[-1].__setitem__(1, steps[-1][1] + 1), r())), out)
        for size, (replay, out) in graphed.runner.cuda_graphs.graphs.items()}
    assert _greedy_tokens(graphed, prompts, [10, 6, 8]) == _greedy_tokens(eager, prompts,
                                                                          [10, 6, 8])
    assert any(drafts for drafts, _ in steps) and any(replays for _, replays in steps)
    assert all(replays == 0 for drafts, replays in steps if drafts)


def test_smollm2_as_its_own_draft_accepts_greedy_drafts():
    "The real SmolLM2 drafting for itself (float32): at least 98% of greedy drafts accepted."
    from petite_llm.model.weights import load_model, smollm2_gguf_path
    # in bfloat16 the draft's one-token passes and the verify's five-token pass round
    # differently, and near-ties flip a few percent of argmaxes
    model = load_model(smollm2_gguf_path(), dtype=torch.float32, progress=False)
    llm = LLM(model, kv_cache_memory=64 * 2**20,
              speculative_config={'model': model, 'num_speculative_tokens': 4})
    prompts = [[1, 504, 2365, 282, 260, 7084, 11028], [1, 378, 1033, 282, 3539, 314],
               [1, 20128, 3543, 30, 418, 2077], [1, 1662, 253, 2734, 1386, 30]]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
                        use_tqdm=False)
    assert all(len(o.token_ids) == 48 for o in outs)
    assert llm.stats.num_draft_tokens >= 100 and llm.stats.acceptance_rate >= 0.98
