"""RoPE scaling (chapter 02, read by chapter 00) against transformers 5.23.0, the oracle.

Random-weight checkpoints with `linear`, `dynamic`, `yarn` and `llama3` scaling and a trained window
(`original_max_position_embeddings`) of 16 or 32 tokens, so that prompts and generations cross it:

- float64 logits within float64 rounding of transformers', for prompts across the window;
- float64 greedy tokens equal to transformers', through the reference path and through the engine
  (torch backend, chunked prefill, and the triton backend in its interpreter on a CPU);
- `dynamic` is compared with transformers fed one token at a time (chapter 02 explains why: a
  token's frequencies depend on its position only, never on the rest of its batch), within what
  float32 tables guarantee (FLOAT32_TABLES below);
- GGUF: a tiny file with llama.cpp's YaRN keys, and one with a `rope_freqs` tensor (Llama 3's
  per-pair divisors), give the model that the equivalent config.json gives;
- an unknown rope_type is refused by name.
No test downloads anything.
"""
import json
import math

import gguf
import numpy as np
import pytest
import torch

from petite_llm import LLM, SamplingParams
from petite_llm.model.config import ModelConfig
from petite_llm.model.qwen3 import Qwen3ForCausalLM
from petite_llm.model.weights import load_model, permute_qk
from test_parity import hf_greedy, hf_logits, make_checkpoint, ours_greedy, ours_logits, prompts

pytestmark = pytest.mark.usefixtures("one_thread")

BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
            tie_word_embeddings=False)
WINDOW = 32                                                   # original_max_position_embeddings
CASES = {
    'qwen3-yarn': ('qwen3', dict(head_dim=32, max_position_embeddings=4 * WINDOW,
                                 rope_parameters=dict(
        rope_type='yarn', factor=4.0, original_max_position_embeddings=WINDOW, rope_theta=1e4))),
    'qwen3-yarn-betas': ('qwen3', dict(head_dim=16, max_position_embeddings=8 * WINDOW,
                                       rope_parameters=dict(
        rope_type='yarn', factor=8.0, original_max_position_embeddings=WINDOW, beta_fast=8.0,
        beta_slow=2.0, truncate=False, attention_factor=1.3, rope_theta=1e6))),
    # head_dim 16, base 1e4: wavelengths 6 to 2e4 tokens, so all three llama3 bands are used
    'llama-llama3': ('llama', dict(max_position_embeddings=8 * WINDOW, rope_parameters=dict(
        rope_type='llama3', factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=WINDOW, rope_theta=1e4))),
    'llama-linear': ('llama', dict(max_position_embeddings=4 * WINDOW, rope_parameters=dict(
        rope_type='linear', factor=2.0, rope_theta=1e4))),
    # dynamic's trained window is max_position_embeddings; we run factor times as many
    'llama-dynamic': ('llama', dict(max_position_embeddings=WINDOW, rope_parameters=dict(
        rope_type='dynamic', factor=2.0, rope_theta=1e4))),
}
LONG = [5, WINDOW - 1, WINDOW + 9, 2 * WINDOW - 8]          # prompts on both sides of the window
# transformers builds RoPE's frequencies, cos and sin in float32 even for a float64 model. Where
# both sides build them with the same ops on the same shapes, they agree to the bit on any CPU.
# Fed one token at a time (dynamic), transformers builds them on other shapes, and a float32 pow
# or cos may round its last bit differently on another path (a vector's tail, AVX2 against
# AVX-512, MKL against Sleef): a float32-sized difference in the logits, bounded here with room
# (seen: 1.4e-7 of the largest logit, on an AVX2 CPU)
FLOAT32_TABLES = 1e-5


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    "Each case's checkpoint folder and transformers' model of it, in float64."
    made = {}
    for name, (model_type, kw) in CASES.items():
        path = tmp_path_factory.mktemp(name)
        made[name] = path, make_checkpoint(path, model_type, seed=2, **BASE, **kw).double()
    return made


def hf_one_at_a_time(hf_model, ids, n=0):
    "transformers fed one token per call (with its cache): every call's logits, n greedy tokens."
    rows, cache, ids = [], None, list(ids)
    with torch.no_grad():
        for i in range(len(ids) + n - 1):
            out = hf_model(torch.tensor([[ids[i]]]), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            rows.append(out.logits[0, -1])
            if i >= len(ids) - 1:
                ids.append(int(rows[-1].argmax()))
    return torch.stack(rows), ids[len(ids) - n:]


def hf_reference(name, hf_model, ids, n):
    "transformers' logits for `ids`, its n greedy tokens, and the logits each token was drawn from."
    if name == 'llama-dynamic':
        rows, tokens = hf_one_at_a_time(hf_model, ids, n)
        return rows[:len(ids)], tokens, rows[len(ids) - 1:]
    tokens = hf_greedy(hf_model, ids, n)
    return hf_logits(hf_model, ids), tokens, hf_logits(hf_model, ids + tokens)[len(ids) - 1:-1]


def tolerance(name):
    "How far our float64 logits may be from transformers', relative to the largest."
    return FLOAT32_TABLES if name == 'llama-dynamic' else 1e-10


def assert_greedy_agrees(ours, theirs, theirs_logits, bound):
    "Greedy tokens equal, up to a step whose top two logits (transformers') are within 2 * bound."
    for step, (mine, token) in enumerate(zip(ours, theirs, strict=True)):
        if mine != token:
            top2 = theirs_logits[step].topk(2).values
            assert top2[0] - top2[1] <= 2 * bound, f"step {step}: {mine} != {token}"
            return                                # a near-tie: the two continuations may part


def test_config_reads_what_transformers_wrote(checkpoints):
    for name, (path, hf_model) in checkpoints.items():
        ours = ModelConfig.from_pretrained(path)
        theirs = hf_model.config.rope_parameters
        assert ours.rope_scaling['rope_type'] == theirs['rope_type'], name
        assert ours.rope_theta == theirs['rope_theta']
        if name == 'llama-dynamic':
            assert ours.max_position_embeddings == 2 * hf_model.config.max_position_embeddings
            assert ours.rope_scaling['original_max_position_embeddings'] == WINDOW


@pytest.mark.parametrize('name', CASES)
def test_logits_and_greedy_float64(checkpoints, name):
    path, hf_model = checkpoints[name]
    ours = load_model(path, dtype=torch.float64)
    generated = []
    for ids in prompts(BASE['vocab_size'], LONG, seed=5):
        theirs, tokens, drawn_from = hf_reference(name, hf_model, ids, 2 * WINDOW - len(ids))
        mine = ours_logits(ours, ids)
        err, scale = (mine - theirs).abs().max().item(), theirs.abs().max().item()
        assert err <= tolerance(name) * scale, f"{name}, {len(ids)} tokens: max|diff| {err:.3g}"
        assert_greedy_agrees(ours_greedy(ours, ids, len(tokens)), tokens, drawn_from,
                             tolerance(name) * scale)
        generated += tokens
    assert len(set(generated)) > 8                     # varied tokens, not one repeated


def test_scaling_changes_the_logits(checkpoints):
    "The check above has teeth: plain RoPE on a YaRN checkpoint differs past the window."
    path, hf_model = checkpoints['qwen3-yarn']
    ours = load_model(path, dtype=torch.float64)
    plain = ModelConfig.from_pretrained(path)
    plain.rope_scaling = None
    unscaled = Qwen3ForCausalLM(plain).double()
    unscaled.load_state_dict(ours.state_dict())
    ids = prompts(BASE['vocab_size'], [WINDOW + 9], seed=5)[0]
    assert not torch.allclose(ours_logits(unscaled, ids), hf_logits(hf_model, ids), atol=1e-3)


def _engine_greedy(path, prompts_, max_tokens, **options):
    "The engine's greedy tokens for `prompts_`, generated together, and the engine's runner."
    llm = LLM(path, dtype=torch.float64, block_size=4, kv_cache_memory=2**22, **options)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(prompts_, params, use_tqdm=False)
    return [out.token_ids for out in outs], llm.engine.runner


@pytest.mark.parametrize('name', ['qwen3-yarn', 'llama-llama3', 'llama-dynamic'])
@pytest.mark.parametrize('options', [dict(), dict(max_num_batched_tokens=8)],
                         ids=['torch', 'torch-chunked'])
def test_engine_greedy_equals_transformers(checkpoints, name, options):
    "Prompts on both sides of the window, batched (and chunked): transformers' tokens for each."
    path, hf_model = checkpoints[name]
    batch = prompts(BASE['vocab_size'], LONG, seed=7)
    # 8 tokens: the longest prompt ends at dynamic's last position (2 * WINDOW)
    ours, _ = _engine_greedy(path, batch, 8, **options)
    for prompt, mine in zip(batch, ours, strict=True):
        _, tokens, drawn_from = hf_reference(name, hf_model, prompt, 8)
        assert_greedy_agrees(mine, tokens, drawn_from, tolerance(name) * drawn_from.abs().max())


@pytest.mark.parametrize('name', ['qwen3-yarn', 'llama-dynamic'])
def test_triton_backend_greedy_equals_transformers(checkpoints, name):
    "The fused path's cos/sin table carries the scaling (Triton's interpreter on a CPU)."
    path, hf_model = checkpoints[name]
    batch = prompts(BASE['vocab_size'], [3, WINDOW + 2], seed=9)
    ours, runner = _engine_greedy(path, batch, 6, attention_backend='triton',
                                  max_num_batched_tokens=16)
    assert len(runner.backend.rope_tables) == 1              # the cos/sin table is in use
    for prompt, mine in zip(batch, ours, strict=True):
        _, tokens, drawn_from = hf_reference(name, hf_model, prompt, 6)
        assert_greedy_agrees(mine, tokens, drawn_from, tolerance(name) * drawn_from.abs().max())


def test_unknown_rope_type_is_refused_by_name(tmp_path):
    config = dict(model_type='qwen3', vocab_size=16, hidden_size=32, intermediate_size=32,
                  num_hidden_layers=1, num_attention_heads=2, head_dim=16)
    for key in ('rope_scaling', 'rope_parameters'):
        scaling = {'rope_type': 'longrope', 'short_factor': [1.0] * 8, 'long_factor': [2.0] * 8}
        (tmp_path/'config.json').write_text(json.dumps(config | {key: scaling}))
        with pytest.raises(ValueError, match=f"{key} with rope_type='longrope'"):
            ModelConfig.from_pretrained(tmp_path)


# --- GGUF ------------------------------------------------------------------------------------

def gguf_writer(path, arch, config, rope_theta):
    "A GGUFWriter of `arch` holding the shape keys every test GGUF has, from config's fields."
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_rope_freq_base(rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    return writer


def write_gguf(path, checkpoint, model, arch, rope_keys=(), rope_freqs=None):
    "A checkpoint's shapes and its transformers model's weights as a float32 GGUF of `arch`."
    config = ModelConfig.from_pretrained(checkpoint)
    writer = gguf_writer(path, arch, config, config.rope_theta)
    writer.add_tokenizer_model('gpt2')
    writer.add_token_list([f't{i}' for i in range(config.vocab_size)])
    for key, value in rope_keys:
        getattr(writer, f'add_rope_scaling_{key}')(value)
    names = {'model.embed_tokens': 'token_embd', 'model.norm': 'output_norm', 'lm_head': 'output'}
    layer = {'self_attn.q_proj': 'attn_q', 'self_attn.k_proj': 'attn_k',
             'self_attn.v_proj': 'attn_v',
             'self_attn.o_proj': 'attn_output', 'self_attn.q_norm': 'attn_q_norm',
             'self_attn.k_norm': 'attn_k_norm', 'mlp.gate_proj': 'ffn_gate',
             'mlp.up_proj': 'ffn_up', 'mlp.down_proj': 'ffn_down',
             'input_layernorm': 'attn_norm', 'post_attention_layernorm': 'ffn_norm'}
    for name, tensor in model.state_dict().items():
        base = name.removesuffix('.weight')
        if base.startswith('model.layers.'):
            index, rest = base.removeprefix('model.layers.').split('.', 1)
            gguf_name = f'blk.{index}.{layer[rest]}'
        else:
            gguf_name = names[base]
        if arch == 'llama' and base.endswith(('q_proj', 'k_proj')):   # llama.cpp's pair order
            heads = config.num_attention_heads if 'q_proj' in base else config.num_key_value_heads
            tensor = permute_qk(tensor, heads)
        writer.add_tensor(f'{gguf_name}.weight', tensor.float().numpy())
    if rope_freqs is not None:
        writer.add_tensor('rope_freqs.weight', np.asarray(rope_freqs, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_yarn_keys_give_the_config_json_model(checkpoints, tmp_path):
    path, hf_model = checkpoints['qwen3-yarn']
    file = write_gguf(tmp_path/'yarn.gguf', path, hf_model, 'qwen3', [
        ('type', gguf.RopeScalingType.YARN), ('factor', 4.0),
        ('orig_ctx_len', WINDOW)])
    config = ModelConfig.from_pretrained(file)
    assert config.rope_scaling['rope_type'] == 'yarn'
    assert config.rope_scaling['original_max_position_embeddings'] == WINDOW
    from_gguf = load_model(file, dtype=torch.float64)
    from_json = load_model(path, dtype=torch.float64)
    ids = prompts(BASE['vocab_size'], [WINDOW + 9], seed=5)[0]
    torch.testing.assert_close(ours_logits(from_gguf, ids), ours_logits(from_json, ids),
                               rtol=0, atol=1e-12)


def test_gguf_rope_freqs_are_llama3_divisors(checkpoints, tmp_path):
    "llama.cpp's rope_freqs tensor (its converter's formula) acts as transformers' llama3 bands."
    path, hf_model = checkpoints['llama-llama3']
    params = hf_model.config.rope_parameters
    head_dim = hf_model.config.head_dim
    inv_freq = 1.0 / (params['rope_theta'] ** (torch.arange(0, head_dim, 2).float() / head_dim))
    low_wavelen = params['original_max_position_embeddings'] / params['low_freq_factor']
    high_wavelen = params['original_max_position_embeddings'] / params['high_freq_factor']
    divisors = []
    for freq in inv_freq.tolist():                  # llama.cpp's convert_hf_to_gguf.py recipe
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            divisors.append(1.0)
        elif wavelen > low_wavelen:
            divisors.append(params['factor'])
        else:
            smooth = ((params['original_max_position_embeddings'] / wavelen
                       - params['low_freq_factor'])
                      / (params['high_freq_factor'] - params['low_freq_factor']))
            divisors.append(1 / ((1 - smooth) / params['factor'] + smooth))
    assert 1.0 in divisors and params['factor'] in divisors and len(set(divisors)) > 2
    file = write_gguf(tmp_path/'llama3.gguf', path, hf_model, 'llama',
                      rope_freqs=divisors)
    config = ModelConfig.from_pretrained(file)
    stored = np.asarray(divisors, dtype=np.float32).tolist()              # as the file holds them
    assert config.rope_scaling == {'rope_type': 'llama3', 'freq_factors': stored}
    from_gguf = load_model(file, dtype=torch.float64)
    ids = prompts(BASE['vocab_size'], [WINDOW + 9], seed=5)[0]
    # divisors in float32 against transformers' blend: equal to float32 rounding of the angles
    theirs = hf_logits(hf_model, ids)
    err = (ours_logits(from_gguf, ids) - theirs).abs().max().item()
    assert err <= 1e-4 * theirs.abs().max().item()
    assert ours_greedy(from_gguf, ids, 16) == hf_greedy(hf_model, ids, 16)
