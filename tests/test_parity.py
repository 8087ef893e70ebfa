"""Parity with Hugging Face transformers (5.23.0, the version settings.ini pins), the oracle.

Random-weight checkpoints are written by transformers' own `save_pretrained` (Qwen3, Qwen2 and
Llama), loaded with `petite_llm.model.weights.load_model`, and compared with transformers on the
same weights:

- float32: max |logit difference| <= 1e-4 * max |logit| for several prompts;
- float64: 32 greedy tokens identical to transformers `generate(do_sample=False)` (in float64
  rounding cannot flip an argmax, so greedy identity is a fair test there and only there).

The configs cover tied/untied embeddings, MHA/GQA/MQA, head_dim != hidden/heads and several
rope_theta; a hypothesis test draws further valid configs; and Qwen3-0.6B's and Qwen3-8B's real
hub-format config.json (tests/fixtures/) are read by both libraries and run shrunk.
No test downloads anything.
"""
import json
import tempfile
from pathlib import Path

import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings, strategies as st

from petite_llm.model.config import ModelConfig
from petite_llm.model.weights import load_model

torch.set_num_threads(1)    # tiny models gain nothing from threads, and CI's 2 cores are shared

FIXTURES = Path(__file__).parent / 'fixtures'
HF = {'qwen3': (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
      'qwen2': (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
      'llama': (transformers.LlamaConfig, transformers.LlamaForCausalLM)}


def randomize_(model, seed):
    """Give every parameter a random value with unit-scale activations: matrices (and each stacked
    expert's) N(0, 1/fan_in), embeddings N(0, 0.2²), norm weights 1 ± 0.3, biases N(0, 0.3²), an
    MoE router's rows N(0, 1) so that routing differs from token to token. transformers' own init
    (std 0.02, norms exactly 1) gives flat distributions and would not notice a missing norm
    weight; large tied embeddings make a random model repeat its input token forever."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g, dtype=torch.float64)
            if name.endswith('norm.weight'):
                v = 1 + 0.3 * r
            elif name.endswith('.bias'):
                v = 0.3 * r
            elif name.endswith('mlp.gate.weight'):                  # an MoE router
                v = r
            elif p.dim() >= 2 and 'embed_tokens' not in name:
                v = r / p.shape[-1] ** 0.5 * (2.0 if 'lm_head' in name else 1.0)
            else:                                                   # embed_tokens
                v = 0.2 * r
            p.copy_(v)


def make_checkpoint(path, model_type, seed=0, **kw):
    """A random-weight checkpoint written by transformers; returns its model (float32, eval)."""
    cfg_cls, model_cls = HF[model_type]
    # sdpa, not eager: eager computes the softmax in float32 even for a float64 model
    hf_cfg = cfg_cls(**kw, attn_implementation='sdpa')
    hf_model = model_cls(hf_cfg).eval()
    randomize_(hf_model, seed)
    hf_model.save_pretrained(path)
    return hf_model


def ours_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids), torch.arange(len(ids)))             # [T, V]

def hf_logits(hf_model, ids):
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0]                       # [T, V]

def ours_greedy(model, ids, n):
    """Greedy at its simplest: the whole sequence through the reference path, last row's argmax."""
    ids = list(ids)
    for _ in range(n):
        ids.append(int(ours_logits(model, ids)[-1].argmax()))
    return ids[-n:]

def hf_greedy(hf_model, ids, n):
    # always n tokens: no early stop on a random "eos"
    hf_model.generation_config.eos_token_id = None
    hf_model.generation_config.pad_token_id = 0
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]),
                                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()

def prompts(vocab, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]

def assert_logits_close(ours, hf_model, ids, rel=1e-4):
    a, b = ours_logits(ours, ids), hf_logits(hf_model, ids)
    assert a.shape == b.shape
    err, scale = (a - b).abs().max().item(), b.abs().max().item()
    assert err <= rel * scale, (f"max|diff| {err:.3g} > {rel} * max|logit| {scale:.3g} "
                                f"for a prompt of {len(ids)} tokens")


BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
            rms_norm_eps=1e-6, max_position_embeddings=4096)

def case(model_type, heads, kv_heads, rope_theta, tied, head_dim=None):
    """(model_type, config) of one case; without head_dim, transformers' default hidden/heads."""
    kw = dict(num_attention_heads=heads, num_key_value_heads=kv_heads, rope_theta=rope_theta,
              tie_word_embeddings=tied)
    return model_type, kw if head_dim is None else kw | dict(head_dim=head_dim)

# heads / kv heads: MHA n_kv == n_heads, GQA 1 < n_kv < n_heads, MQA n_kv == 1
CASES = {  #                         type     heads kv  rope_theta  tied
    'qwen3-gqa-tied-hd32-1e6':   case('qwen3', 4,    2,  1e6,        True,  head_dim=32),
    'qwen3-mqa-untied-hd16-1e4': case('qwen3', 4,    1,  1e4,        False, head_dim=16),
    'qwen3-mha-tied-hd24-5e5':   case('qwen3', 6,    6,  5e5,        True,  head_dim=24),
    'qwen2-gqa-untied-1e6':      case('qwen2', 8,    2,  1e6,        False),
    'qwen2-mqa-tied-1e4':        case('qwen2', 4,    1,  1e4,        True),
    'llama-mha-untied-1e4':      case('llama', 4,    4,  1e4,        False),
    'llama-gqa-tied-hd8-1e5':    case('llama', 8,    2,  1e5,        True,  head_dim=8),
}


@pytest.fixture(scope='module')
def checkpoints(tmp_path_factory):
    """Each case's checkpoint, written once per module: {id: (path, transformers model)}."""
    out = {}
    for i, (name, (mt, kw)) in enumerate(CASES.items()):
        path = tmp_path_factory.mktemp(name)
        out[name] = path, make_checkpoint(path, mt, seed=i, **BASE, **kw)
    return out


@pytest.mark.parametrize('case', CASES)
def test_logits_float32(checkpoints, case):
    path, hf_model = checkpoints[case]
    ours = load_model(path)
    assert ours.lm_head.weight.dtype == torch.float32                  # the checkpoint's dtype
    tied = ours.lm_head.weight is ours.model.embed_tokens.weight
    assert tied == CASES[case][1]['tie_word_embeddings']
    for ids in prompts(BASE['vocab_size'], [1, 9, 40, 100]):
        assert_logits_close(ours, hf_model, ids)


@pytest.mark.parametrize('case', CASES)
def test_greedy_float64(checkpoints, case):
    path, hf_model = checkpoints[case]
    ours, hf64 = load_model(path, dtype=torch.float64), hf_model.to(torch.float64)
    try:
        generated = []
        for ids in prompts(BASE['vocab_size'], [1, 5, 23], seed=1):
            expected = hf_greedy(hf64, ids, 32)
            assert ours_greedy(ours, ids, 32) == expected, f"prompt of {len(ids)} tokens"
            generated += expected
        assert len(set(generated)) > 8              # the test sees varied tokens, not one repeated
    finally:
        hf_model.to(torch.float32)


# ---- Qwen3's real hyperparameters, hub format -----------------------------------------------

REAL = {'qwen3-0.6b': dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                           num_attention_heads=16, num_key_value_heads=8,
                           tie_word_embeddings=True),
        'qwen3-8b':   dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                           num_attention_heads=32, num_key_value_heads=8,
                           tie_word_embeddings=False)}

@pytest.mark.parametrize('name', REAL)
def test_hub_config_read_like_transformers(name):
    ours = ModelConfig.from_pretrained(FIXTURES / name)
    hf = transformers.AutoConfig.from_pretrained(FIXTURES / name)      # a local folder: no download
    for k, v in REAL[name].items():
        assert getattr(ours, k) == v, k
    assert (ours.model_type, ours.head_dim, ours.vocab_size) == ('qwen3', 128, 151936)
    assert (ours.rope_theta, ours.rms_norm_eps, ours.max_position_embeddings) == (1e6, 1e-6, 40960)
    assert (ours.torch_dtype, ours.qk_norm, ours.attention_bias) == (torch.bfloat16, True, False)
    assert (ours.bos_token_id, ours.eos_token_id) == (151643, [151645])
    for k in ('hidden_size', 'num_hidden_layers', 'num_attention_heads', 'num_key_value_heads',
              'head_dim', 'intermediate_size', 'vocab_size', 'rms_norm_eps',
              'max_position_embeddings', 'tie_word_embeddings', 'bos_token_id'):
        assert getattr(ours, k) == getattr(hf, k), k
    assert ours.rope_theta == hf.rope_parameters['rope_theta'] and ours.torch_dtype == hf.dtype


@pytest.mark.parametrize('name', REAL)
def test_hub_config_parity_shrunk(name, tmp_path):
    """The real config.json with 2 layers, hidden 256, intermediate 512 and vocab 1024 (for CI
    speed); head_dim 128, the head counts (so q_size = 16·128 or 32·128 ≠ hidden), rope_theta
    1e6, eps 1e-6, tying and max_position_embeddings are the real ones. The checkpoint keeps the
    hub-format config.json."""
    hub = json.loads((FIXTURES / name / 'config.json').read_text())
    small = hub | dict(num_hidden_layers=2, max_window_layers=2, hidden_size=256,
                       intermediate_size=512, vocab_size=1024)
    (tmp_path / 'config.json').write_text(json.dumps(small))
    hf_cfg = transformers.AutoConfig.from_pretrained(tmp_path, attn_implementation='sdpa')
    hf_model = transformers.Qwen3ForCausalLM(hf_cfg).float().eval()
    randomize_(hf_model, seed=7)
    hf_model.save_pretrained(tmp_path)
    (tmp_path / 'config.json').write_text(json.dumps(small))       # back to the hub spelling
    ours = load_model(tmp_path, dtype=torch.float32)
    for ids in prompts(1024, [3, 50]):
        assert_logits_close(ours, hf_model, ids)
    ours, hf64 = ours.to(torch.float64), hf_model.to(torch.float64)
    for ids in prompts(1024, [4, 17], seed=2):
        assert ours_greedy(ours, ids, 16) == hf_greedy(hf64, ids, 16)


# ---- any valid config -----------------------------------------------------------------------

@st.composite
def configs(draw):
    """A valid small config of any of the three families; head_dim drawn apart from hidden/heads."""
    model_type = draw(st.sampled_from(sorted(HF)))
    n_kv = draw(st.integers(1, 3))
    n_heads = n_kv * draw(st.integers(1, 4))                # MHA, GQA and MQA all reachable
    # transformers' LlamaConfig insists on hidden % heads == 0 (Qwen's do not); head_dim stays free
    if model_type == 'llama':
        hidden = n_heads * draw(st.integers(1, 8))
    else:
        hidden = draw(st.integers(4, 48))
    return model_type, dict(
        vocab_size=draw(st.integers(16, 200)), hidden_size=hidden,
        intermediate_size=draw(st.integers(4, 64)), num_hidden_layers=draw(st.integers(1, 2)),
        num_key_value_heads=n_kv, num_attention_heads=n_heads,
        head_dim=2 * draw(st.integers(1, 12)), rope_theta=draw(st.floats(10.0, 1e7)),
        rms_norm_eps=draw(st.sampled_from([1e-6, 1e-5])), tie_word_embeddings=draw(st.booleans()),
        max_position_embeddings=256)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs(), seed=st.integers(0, 2**16))
def test_any_valid_config(cfg, seed):
    model_type, kw = cfg
    with tempfile.TemporaryDirectory() as d:
        hf_model = make_checkpoint(d, model_type, seed=seed, **kw)
        ours = load_model(d)
    ids = prompts(kw['vocab_size'], [13], seed=seed)[0]
    assert_logits_close(ours, hf_model, ids)
    # in float64: equal to rounding noise
    ours, hf64 = ours.to(torch.float64), hf_model.to(torch.float64)
    assert_logits_close(ours, hf64, ids, rel=1e-10)
