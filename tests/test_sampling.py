"""Sampling: each logits processor against transformers', seeded determinism, greedy, distribution,
validation."""
import math
from dataclasses import replace

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper,
    TopPLogitsWarper)

from petite_llm.model.sampling import (Sampler, apply_min_p, apply_penalties,
                                       apply_repetition_penalty, apply_temperature, apply_top_k,
                                       apply_top_p, seed_for, token_counts)
from petite_llm.model.sampling_params import SamplingParams
from host_reads import HostReads


def _logits(R=6, V=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(R, V, generator=g) * 3
    x[0, 10] = x[0, 11] = x[0].max() - 0.5   # a tie near the top
    return x


def test_top_k_is_read_on_the_host_not_the_device():
    "Qwen3's own sampling (temperature 0.6, top_k 20, top_p 0.95): probs reads no tensor back."
    x = _logits()
    qwen3 = SamplingParams(temperature=0.6, top_k=20, top_p=0.95)
    params = [qwen3, replace(qwen3, top_k=7), SamplingParams(temperature=0)] + [qwen3] * 3
    sampler = Sampler()
    with HostReads() as mode:
        probs = sampler.probs(x, params, [[1]] * 6, [[]] * 6)
    assert mode.found == []
    assert (probs[0] > 0).sum() <= 20 and (probs[1] > 0).sum() <= 7
    with HostReads() as mode:                          # the standalone call, k_max not given
        apply_top_k(x, torch.full((6,), 20))
    assert mode.found == ['aten._local_scalar_dense']


def test_logprobs_are_found_without_a_read_back():
    "logprob_tensors reads nothing back; logprob_dicts, on its copies, gives what logprobs gives."
    x, sampler = _logits(), Sampler()
    params = [SamplingParams(logprobs=3), SamplingParams(), SamplingParams(logprobs=0)] * 2
    tokens = torch.tensor([5, 9, 17, 250, 0, 3])                       # [R], as launch has them
    with HostReads() as mode:
        found = sampler.logprob_tensors(x, params, tokens)
    assert mode.found == [] and found[0] == [0, 2, 3, 5]
    dicts = Sampler.logprob_dicts(found, params, tokens.tolist())
    assert dicts == sampler.logprobs(x, params, tokens.tolist())
    assert [d is None for d in dicts] == [False, True, False] * 2
    assert all(len(dicts[r]) in (3, 4) and tokens[r].item() in dicts[r] for r in (0, 3))
    assert all(list(dicts[r]) == [tokens[r].item()] for r in (2, 5))       # logprobs=0


@pytest.mark.parametrize("k", [1, 2, 3, 17, 299, 300, 1000])
def test_top_k_matches_transformers(k):
    x = _logits()
    ours = apply_top_k(x, torch.full((x.shape[0],), k))
    assert torch.equal(ours, TopKLogitsWarper(k)(None, x.clone()))


@pytest.mark.parametrize("p", [1e-3, 0.1, 0.5, 0.9, 0.95, 0.999])
def test_top_p_matches_transformers(p):
    x = _logits()
    ours = apply_top_p(x, torch.full((x.shape[0],), p))
    assert torch.equal(ours, TopPLogitsWarper(p)(None, x.clone()))


@pytest.mark.parametrize("seed", range(6))
def test_top_p_after_top_k_sorts_k_and_keeps_what_transformers_keeps(seed):
    "bfloat16 logits (ties common), some rows tied past the k-th: the k_max path = the full sort."
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(8, 3000, generator=g) * 3).to(torch.bfloat16).float()
    ks = torch.randint(1, 40, (8,), generator=g)
    ps = torch.rand(8, generator=g).clamp(0.05, 0.999)
    order = x.argsort(-1, descending=True)
    for r in range(0, 8, 2):                           # ties past the cut in every other row
        k = int(ks[r])
        x[r, order[r, k:k + 1 + r]] = x[r, order[r, k - 1]].item()
    cut = apply_top_k(x, ks)
    fast, full = apply_top_p(cut, ps, k_max=int(ks.max())), apply_top_p(cut, ps)
    kept = (fast > -math.inf).sum(-1)
    assert torch.equal(kept, (full > -math.inf).sum(-1))
    # the same kept values (which of two equal logits goes first is the sort's choice)
    assert torch.equal(fast.sort(-1).values, full.sort(-1).values)
    assert not (fast > -math.inf)[cut == -math.inf].any()            # nothing top-k removed
    for r in range(8):                                 # transformers keeps as many (ties: any)
        hf = TopPLogitsWarper(float(ps[r]))(None, TopKLogitsWarper(int(ks[r]))(None, x[r:r + 1]))
        assert int(kept[r]) == int((hf > -math.inf).sum())


def test_sampler_sorts_no_vocabulary_for_top_k_and_top_p():
    "Qwen3's defaults (top_k 20, top_p 0.95): no full sort; a row without top_k sorts it all."
    logits = _logits(V=3000)
    sorts = []
    original = torch.Tensor.sort

    def counted(self, *args, **kwargs):
        sorts.append(self.shape[-1])
        return original(self, *args, **kwargs)
    qwen3 = SamplingParams(temperature=0.6, top_k=20, top_p=0.95, seed=1)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(torch.Tensor, 'sort', counted)
        Sampler()(logits, [qwen3] * 6, [[1]] * 6, [[]] * 6)
        assert sorts == []
        Sampler()(logits, [qwen3] * 5 + [replace(qwen3, top_k=0)], [[1]] * 6, [[]] * 6)
        assert sorts == [3000]


@pytest.mark.parametrize("m", [0.0, 0.01, 0.1, 0.5, 1.0])
def test_min_p_matches_transformers(m):
    x = _logits()
    ours = apply_min_p(x, torch.full((x.shape[0],), m))
    assert torch.equal(ours, MinPLogitsWarper(m)(None, x.clone()))


@pytest.mark.parametrize("penalty", [0.5, 1.1, 2.0])
def test_repetition_penalty_matches_transformers(penalty):
    x = _logits()
    g = torch.Generator().manual_seed(1)
    prev = torch.randint(0, x.shape[1], (x.shape[0], 30), generator=g)
    seen = token_counts(prev.tolist(), x.shape[1]) > 0
    ours = apply_repetition_penalty(x, seen, torch.full((x.shape[0],), penalty))
    assert torch.equal(ours, RepetitionPenaltyLogitsProcessor(penalty)(prev, x.clone()))


def test_per_row_params_match_row_by_row():
    x = _logits()
    ks = [1, 5, 50, 0, 3, 300]
    ps = [0.3, 0.9, 1.0, 0.6, 0.99, 0.5]
    ms = [0.0, 0.2, 0.05, 0.0, 0.5, 0.1]
    ts = [0.5, 1, 2, 0.7, 1.3, 1]
    both = apply_top_k(apply_temperature(x, torch.tensor(ts)), torch.tensor(ks))
    both = apply_min_p(apply_top_p(both, torch.tensor(ps)), torch.tensor(ms))
    for r in range(x.shape[0]):
        row = TemperatureLogitsWarper(float(ts[r]))(None, x[r:r + 1].clone())
        if ks[r] > 0: row = TopKLogitsWarper(ks[r])(None, row)
        if ps[r] < 1: row = TopPLogitsWarper(ps[r])(None, row)
        row = MinPLogitsWarper(ms[r])(None, row)
        assert torch.equal(both[r], row[0]), r


def test_sampler_probs_match_transformers_chain():
    x = _logits(R=1)
    prompt, out = [3, 4, 5, 3], [10, 7]
    p = SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, repetition_penalty=1.2)
    ours = Sampler().probs(x, [p], [prompt], [out])
    hf = x.clone()
    ids = torch.tensor([prompt + out])
    for proc in [RepetitionPenaltyLogitsProcessor(1.2), TemperatureLogitsWarper(0.7),
                 TopKLogitsWarper(40), TopPLogitsWarper(0.9), MinPLogitsWarper(0.05)]:
        hf = proc(ids, hf)
    assert torch.equal(ours, hf.softmax(-1))


def test_presence_frequency_penalties():
    counts = token_counts([[1, 1, 1, 2]], 4)
    out = apply_penalties(torch.ones(1, 4), counts, torch.tensor([0.5]), torch.tensor([0.1]))
    assert torch.allclose(out, torch.tensor([[1.0, 1 - 0.5 - 0.3, 1 - 0.5 - 0.1, 1.0]]))
    # the Sampler counts output tokens only, never the prompt
    x = torch.zeros(1, 4); x[0, 0] = 0.1
    p = SamplingParams(temperature=0, presence_penalty=1.0)
    assert Sampler()(x, [p], [[0, 0, 0]], [[]]).token_ids == [0]
    assert Sampler()(x, [p], [[]], [[0]]).token_ids != [0]


def test_greedy_is_argmax_and_does_not_touch_logits():
    x = _logits()
    before = x.clone()
    R = x.shape[0]
    out = Sampler()(x, [SamplingParams(temperature=0)] * R, [[]] * R, [[]] * R)
    assert out.token_ids == x.argmax(-1).tolist()
    assert torch.equal(x, before)
    # bf16 logits work too
    out = Sampler()(x.bfloat16(), [SamplingParams(temperature=0)] * R, [[]] * R, [[]] * R)
    assert out.token_ids == x.bfloat16().float().argmax(-1).tolist()


def test_greedy_rows_ignore_warpers():
    x = _logits(R=1)
    p = SamplingParams(temperature=0, top_k=1, top_p=0.01, min_p=1.0)
    probs = Sampler().probs(x, [p], [[]], [[]])
    assert probs[0, x[0].argmax()] == 1 and probs.sum() == 1


STRANGERS = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_k=5),
             SamplingParams(seed=7), SamplingParams(temperature=1.5, min_p=0.1),
             SamplingParams(top_p=0.5), SamplingParams(repetition_penalty=1.3, seed=3),
             SamplingParams(presence_penalty=1.0, frequency_penalty=0.5)]


@pytest.mark.parametrize("where", [0, 3, 7])
def test_seeded_tokens_do_not_depend_on_the_batch(where):
    V = 500
    seeded = SamplingParams(temperature=1.0, top_p=0.98, seed=2024, repetition_penalty=1.1)
    g = torch.Generator().manual_seed(5)
    alone_tokens, batch_tokens = [], []
    # one sampler across steps: the shared generator advances, the seeded row must not care
    shared = Sampler()
    for pos in range(30):
        row = torch.randn(1, V, generator=g)
        others = torch.randn(7, V, generator=g)
        prompt, out = [1, 2, 3], list(range(pos))
        alone_tokens.append(Sampler()(row, [seeded], [prompt], [out]).token_ids[0])
        batch = torch.cat([others[:where], row, others[where:]])
        params = STRANGERS[:where] + [seeded] + STRANGERS[where:]
        res = shared(batch, params, [prompt] * 8, [out] * 8, [{0}] * 8)
        batch_tokens.append(res.token_ids[where])
    assert alone_tokens == batch_tokens
    assert len(set(alone_tokens)) > 10    # and it really is sampling


def test_seed_position_keying():
    V = 1000
    x = torch.zeros(1, V)   # uniform: the token is pure noise

    def tok(seed, pos):
        return Sampler()(x, [SamplingParams(seed=seed)], [[]], [[0] * pos]).token_ids[0]

    assert tok(1, 5) == tok(1, 5)
    assert len({tok(1, p) for p in range(20)}) > 15      # positions differ
    assert len({tok(s, 0) for s in range(20)}) > 15      # seeds differ
    assert seed_for(1, 0) != seed_for(0, 1)


def test_for_sample_gives_distinct_seeds():
    p = SamplingParams(n=4, seed=11)
    kids = [p.for_sample(i) for i in range(4)]
    assert all(k.n == 1 for k in kids) and len({k.seed for k in kids}) == 4
    assert SamplingParams(n=2).for_sample(1).seed is None


def _chi2(obs, probs):
    exp = probs * obs.sum()
    keep = exp > 0
    assert obs[~keep].sum() == 0, "a filtered token was drawn"
    return (((obs[keep] - exp[keep]) ** 2) / exp[keep]).sum().item(), int(keep.sum()) - 1


# chi-square critical values at p = 0.001 for 1..7 degrees of freedom
CHI2_001 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.6),
                                    dict(temperature=1.7, top_k=5), dict(top_p=0.8),
                                    dict(min_p=0.15)])
def test_distribution_unseeded(params):
    toy = torch.tensor([[2.0, 1.6, 1.2, 0.8, 0.4, 0.0, -0.4, -0.8]])
    p = SamplingParams(**params)
    N = 20000
    sampler = Sampler(torch.Generator().manual_seed(123))
    expected = sampler.probs(toy, [p], [[]], [[]])[0]
    toks = sampler(toy.expand(N, 8), [p] * N, [[]] * N, [[]] * N).token_ids
    chi2, df = _chi2(torch.bincount(torch.tensor(toks), minlength=8).float(), expected)
    assert chi2 < CHI2_001[df], (chi2, df)


def test_distribution_seeded():
    toy = torch.tensor([[1.0, 0.5, 0.0, -0.5, -3.0]])
    N = 6000
    ps = [SamplingParams(temperature=1.0, seed=s) for s in range(N)]
    toks = Sampler()(toy.expand(N, 5), ps, [[]] * N, [[]] * N).token_ids
    chi2, df = _chi2(torch.bincount(torch.tensor(toks), minlength=5).float(), toy.softmax(-1)[0])
    assert chi2 < CHI2_001[df], chi2


def test_min_tokens_masks_stop_ids():
    x = torch.zeros(1, 5); x[0, 4] = 100.0   # token 4 is the eos and overwhelmingly likely
    p = SamplingParams(temperature=1.0, min_tokens=3, seed=0)
    for n_out in range(3):
        assert Sampler()(x, [p], [[]], [[1] * n_out], [{4}]).token_ids != [4]
    assert Sampler()(x, [p], [[]], [[1] * 3], [{4}]).token_ids == [4]
    # without stop_ids the params' own stop_token_ids are masked
    q = SamplingParams(temperature=0, min_tokens=1, stop_token_ids=[4])
    assert Sampler()(x, [q], [[]], [[]]).token_ids != [4]


def test_logprobs_are_raw_topk_plus_sampled():
    x = _logits(R=2)
    p = SamplingParams(temperature=2.0, top_k=3, logprobs=5, seed=0)
    out = Sampler()(x, [p, SamplingParams(temperature=0)], [[]] * 2, [[]] * 2)
    assert out.logprobs[1] is None
    lp = out.logprobs[0]
    raw = x[0].log_softmax(-1)
    top = raw.topk(5)
    assert set(top.indices.tolist()) <= set(lp) and len(lp) in (5, 6)
    for t, v in lp.items():
        assert math.isclose(v, raw[t].item(), rel_tol=1e-5, abs_tol=1e-6)
    assert out.token_ids[0] in lp
    assert list(lp.values()) == sorted(lp.values(), reverse=True)
    # logprobs=0: only the sampled token
    out = Sampler()(x[:1], [SamplingParams(temperature=0, logprobs=0)], [[]], [[]])
    assert list(out.logprobs[0]) == out.token_ids


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("temperature", float("inf")), ("temperature", "hot"),
    ("top_p", 0.0), ("top_p", 1.01), ("top_k", -2), ("top_k", 2.5), ("min_p", -0.1), ("min_p", 1.5),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("presence_penalty", 2.5),
    ("frequency_penalty", -3.0), ("n", 0), ("max_tokens", 0), ("logprobs", -1), ("seed", "abc"),
    ("seed", 1.0), ("stop_token_ids", [-1]), ("stop", [""]), ("n", True)])
def test_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=10, max_tokens=5)


def test_valid_edges_accepted():
    SamplingParams(temperature=0, top_p=1.0, top_k=-1, min_p=1.0, presence_penalty=-2,
                   frequency_penalty=2, min_tokens=5, max_tokens=5, logprobs=0, seed=-5)


def test_from_generation_config():
    gc = {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.0,
          "repetition_penalty": 1.05, "eos_token_id": [1, 2]}
    p = SamplingParams.from_generation_config(gc)
    assert (p.temperature, p.top_k, p.top_p, p.repetition_penalty) == (0.6, 20, 0.95, 1.05)
    p = SamplingParams.from_generation_config(gc, temperature=0.0, max_tokens=5, seed=None)
    assert p.greedy and p.max_tokens == 5 and p.top_k == 20
    assert SamplingParams.from_generation_config({"do_sample": False, "temperature": 0.9}).greedy
    assert SamplingParams.from_generation_config({}).temperature == 1.0
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams.from_generation_config({"top_p": 0})
