"""Int8 weight-only quantization (chapter 19): the int8 matmul against the dequantized product,
a quantized model against its float original, Q8_0 blocks against gguf's own dequantization, and
the perplexity of the shipped text (slow)."""
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf.quants import GGMLQuantizationType, dequantize, quantize
from torch import nn

from petite_llm.model.config import ModelConfig, _open_gguf
from petite_llm.engine.llm_engine import LLM
from petite_llm.model.layers.linear import packed_linear_available, prepack_linears
from petite_llm.model.qwen3 import Qwen3ForCausalLM
import petite_llm.model.quantization as quantization
from petite_llm.model.quantization import (Int8Linear, load_q8_0, perplexity,
                                     q8_0_to_int8, quantize_int8, quantize_model)
from petite_llm.model.sampling_params import SamplingParams
from petite_llm.model.tokenizer import Tokenizer
from petite_llm.model.weights import load_model, smollm2_gguf_path

TEXT = Path(__file__).resolve().parent.parent/'data'/'alice_ch1-2.txt'
CONFIG = ModelConfig('qwen3', vocab_size=512, hidden_size=128, intermediate_size=384,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=32, qk_norm=True, tie_word_embeddings=True, eos_token_id=[1])


def tiny_model(seed=0, config=CONFIG):
    "A tiny random Qwen3 in float32, initialised like transformers (normal, std 0.02)."
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).eval().requires_grad_(False)
    for param in model.parameters():
        if param.ndim == 2:
            nn.init.normal_(param, std=0.02)
    return model


def dequantized(layer):
    "The float32 weight an Int8Linear stands for: q * scale, row by row."
    return layer.weight.float() * layer.weight_scale.float()[:, None]


def test_quantize_int8_rounds_each_weight_within_half_a_step():
    w = torch.randn(8, 300) * torch.logspace(-3, 1, 8)[:, None]   # rows of very different sizes
    w[3] = 0
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and q.shape == w.shape and scale.shape == (8,)
    assert ((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-12).all()
    assert (q[3] == 0).all() and torch.isfinite(scale).all()
    assert q.abs().amax(1)[[0, 1, 2, 4, 5, 6, 7]].eq(127).all()


@pytest.mark.cpu_paths
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
@pytest.mark.parametrize('rows', [1, 16, 17, 64])
def test_int8_linear_matches_dequantized_reference(one_thread, monkeypatch, dtype, rows):
    "Both paths (the int8 kernel for few rows, convert-then-matmul for more) compute q * scale."
    monkeypatch.setattr(quantization, 'INT8_MM_MAX_ROWS', 16)      # both paths, on any CPU
    torch.manual_seed(rows)
    linear = nn.Linear(256, 96, bias=True).to(dtype)
    layer = Int8Linear.from_linear(linear)
    assert layer.weight.dtype == torch.int8 and layer.weight_scale.dtype == dtype
    x = torch.randn(rows, 256, dtype=dtype)
    with torch.inference_mode():
        out = layer(x)
    reference = F.linear(x.float(), dequantized(layer), linear.bias.float())
    assert out.dtype == dtype and out.shape == (rows, 96)
    # float32: rounding only; bf16: the output's own 8-bit rounding
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7
    assert (out.float() - reference).abs().max() <= tol * reference.abs().max()


@pytest.mark.parametrize('native,rows,width,dtype,kernel', [
    (True, 16, 32, torch.bfloat16, True), (True, 17, 32, torch.bfloat16, False),
    (False, 4096, 48, torch.bfloat16, True), (True, 1, 32, torch.float32, False),
    (False, 1, 32, torch.float16, False), (True, 1, 24, torch.bfloat16, False)])
def test_the_int8_kernel_takes_what_it_wins(monkeypatch, native, rows, width, dtype, kernel):
    "bf16 rows of a width in 16s: up to 16 rows with native bf16, all where it is emulated."
    monkeypatch.setattr(quantization, 'INT8_MM_MAX_ROWS', 16 if native else math.inf)
    assert quantization.int8_kernel_takes(torch.empty(rows, width, dtype=dtype)) == kernel


@pytest.mark.cpu_paths
@pytest.mark.parametrize('width', [8, 24, 40, 56])
def test_int8_linear_of_a_width_the_kernel_cannot_read(width):
    "A bf16 row of a width not in 16s (the kernel would read past it): the dequantized product."
    torch.manual_seed(width)
    layer = Int8Linear.from_linear(nn.Linear(width, 64, bias=False).to(torch.bfloat16))
    x = torch.randn(3, width, dtype=torch.bfloat16)
    with torch.inference_mode():
        out = layer(x).float()
    reference = F.linear(x.float(), dequantized(layer))
    assert (out - reference).abs().max() <= 2 ** -7 * reference.abs().max()


def test_int8_linear_is_close_to_the_float_weights(one_thread):
    torch.manual_seed(0)
    linear = nn.Linear(512, 128, bias=False)
    x = torch.randn(4, 512)
    with torch.inference_mode():
        err = (Int8Linear.from_linear(linear)(x) - linear(x)).abs().max()
        assert 0 < err < 0.01 * linear(x).abs().max()


def test_quantize_model_keeps_logits_close(one_thread):
    model = tiny_model()
    ids = torch.randint(0, CONFIG.vocab_size, (40,))
    with torch.inference_mode():
        before = model(ids, torch.arange(40))
        assert quantize_model(model, 'int8') == 4 * CONFIG.num_hidden_layers + 1
        after = model(ids, torch.arange(40))
    assert isinstance(model.lm_head, Int8Linear)
    assert model.model.embed_tokens.weight.dtype == torch.float32      # the table stays float
    assert model.model.layers[0].self_attn.qkv_proj.out_sizes == [128, 64, 64]
    rel = ((after - before).abs().max() / before.abs().max()).item()
    assert 0 < rel < 0.02
    assert (after.argmax(-1) == before.argmax(-1)).float().mean() > 0.9
    # already quantized: nothing left to swap
    assert quantize_model(model, 'int8') == 0


def test_quantize_model_can_keep_the_head_float():
    model = tiny_model()
    assert quantize_model(model, lm_head=False) == 4 * CONFIG.num_hidden_layers
    assert type(model.lm_head) is nn.Linear


@pytest.mark.cpu_paths
def test_quantize_model_refuses_bad_method_and_packed_models():
    with pytest.raises(ValueError, match="'int8'"):
        quantize_model(tiny_model(), 'int4')
    if not packed_linear_available(torch.bfloat16):
        pytest.skip("no oneDNN bf16 here: prepack_linears packs nothing")
    model = tiny_model().to(torch.bfloat16)
    assert prepack_linears(model)
    with pytest.raises(ValueError, match='quantize_model first'):
        quantize_model(model)


@pytest.mark.cpu_paths
def test_engine_generates_with_an_int8_model(one_thread):
    model = tiny_model()
    quantize_model(model)
    llm = LLM(model, kv_cache_memory=1 << 20)
    outs = llm.generate([[5, 6, 7, 8], [9, 10]],
                        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                        use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6]


def test_perplexity_is_exp_mean_nll(one_thread):
    model = tiny_model()
    ids = torch.randint(0, CONFIG.vocab_size, (30,))
    with torch.inference_mode():
        logits = model(ids, torch.arange(30))
    expected = F.cross_entropy(logits[:-1], ids[1:]).item()
    assert math.log(perplexity(model, ids, window=30, stride=30)) == pytest.approx(expected,
                                                                                  rel=1e-5)
    # sliding windows: every token after the first is scored once, with less context
    windowed = perplexity(model, ids, window=12, stride=5)
    assert math.isfinite(windowed) and windowed != pytest.approx(math.exp(expected), rel=1e-6)
    with pytest.raises(ValueError, match='stride <= window'):
        perplexity(model, ids, window=4, stride=8)


def test_q8_0_row_with_one_block_scale_keeps_its_bytes():
    "When every block of a row has the same scale, requantizing to one row scale changes nothing."
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 128)).astype(np.float32)
    w[1, ::32] = 4.0                      # the same largest value in each block of row 1
    raw = quantize(w, GGMLQuantizationType.Q8_0)                        # [3, 4 * 34] bytes
    block_q = raw.reshape(3, 4, 34)[..., 2:].view(np.int8).reshape(3, 128)
    q, scale = q8_0_to_int8(raw, torch.float32)
    assert (q[1].numpy() == block_q[1]).all()
    exact = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q8_0))
    assert ((q.float() * scale[:, None] - exact).abs() <= scale[:, None] / 2 + 1e-7).all()


def test_smollm2_q8_0_head_against_gguf_dequantization():
    "SmolLM2's one Q8_0 matrix (token_embd) feeds its tied int8 head; gguf's reading is the oracle."
    path = smollm2_gguf_path()
    model = load_model(path, dtype=torch.bfloat16, progress=False)
    with pytest.raises(ValueError, match='quantize_model'):
        load_q8_0(model, path)
    quantize_model(model)
    assert load_q8_0(model, path) == 1
    embd = next(t for t in _open_gguf(path).tensors if t.name == 'token_embd.weight')
    exact = torch.from_numpy(dequantize(embd.data, embd.tensor_type))     # [49152, 576]
    q, scale = model.lm_head.weight, model.lm_head.weight_scale.float()[:, None]
    assert q.dtype == torch.int8 and q.shape == exact.shape
    # within half a row step of the Q8_0 values: the one rounding onto the row's grid
    assert ((q.float() * scale - exact).abs() <= scale / 2 * 1.0001).all()
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16      # the table stays float


@pytest.mark.slow
def test_smollm2_int8_perplexity_within_one_percent_of_bf16():
    path = smollm2_gguf_path()
    ids = Tokenizer.from_pretrained(path).encode(TEXT.read_text())
    assert len(ids) > 4000
    model = load_model(path, dtype=torch.bfloat16, progress=False)
    bf16 = perplexity(model, ids)
    quantize_model(model)
    load_q8_0(model, path)
    int8 = perplexity(model, ids)
    assert math.isfinite(bf16) and int8 / bf16 < 1.01
