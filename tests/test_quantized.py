"""A GGUF's quantized matrices kept packed (chapter 19): the repack of every format against gguf's
own dequantization, bit for bit in float32; the linears that read them; and the engine on packed
weights against the same GGUF dequantized, greedy token for token in float32, in its modes."""
import logging

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from petite_llm import LLM, SamplingParams
from petite_llm.model.config import ModelConfig
from petite_llm.model.quantized import (GGUF_BLOCKS, Int4Linear, QuantizedMatrix, QuantLinear,
                                        int4_kernel_available, repack)
from petite_llm.model.weights import smollm2_gguf_path
from test_parity import make_checkpoint, prompts
from test_rope_scaling import gguf_writer

RNG = np.random.default_rng(0)


def gguf_blocks(kind, rows, cols, rng=RNG):
    """A [rows, cols] matrix in format `kind`: gguf's quantizer, or random K-quant blocks (gguf-py
    has no K-quant quantizer) whose fp16 scales are finite: any such block is a valid one."""
    size, per_block = GGUF_BLOCKS[kind]
    if not kind.endswith('_K'):
        weights = rng.standard_normal((rows, cols)).astype(np.float32) * 0.1
        return quantize(weights, GGMLQuantizationType[kind])
    raw = rng.integers(0, 256, (rows, cols // per_block, size), dtype=np.uint8)
    scales = rng.uniform(1e-4, 2e-3, (rows, cols // per_block, 2)).astype(np.float16)
    fields = [slice(size - 2, size)] if kind == 'Q6_K' else [slice(0, 2), slice(2, 4)]
    for i, field in enumerate(fields):               # Q6_K: d last; Q4_K, Q5_K: d, dmin first
        raw[..., field] = scales[..., i:i + 1].view(np.uint8)
    return raw.reshape(rows, -1)


# rows of Qwen3 (odd numbers of rows, 1024 wide), Qwen2 (896 = 28 legacy blocks, no K-quant
# fits) and Llama/Qwen2 MLPs (4864 = 19 super-blocks); K-quants only where 256 divides the row
SHAPES = [(5, 1024), (3, 896), (3, 4864)]


@pytest.mark.parametrize('kind', list(GGUF_BLOCKS))
def test_repack_is_gguf_dequantize_bit_for_bit(kind):
    for rows, cols in SHAPES:
        if cols % GGUF_BLOCKS[kind][1]:
            continue
        raw = gguf_blocks(kind, rows, cols)
        exact = dequantize(raw, GGMLQuantizationType[kind])
        ours = repack(raw, kind).dequantize().numpy()
        assert ours.shape == exact.shape == (rows, cols)
        assert np.array_equal(ours.view(np.uint32), exact.view(np.uint32)), (kind, rows, cols)


def test_repack_refuses_an_unknown_format():
    with pytest.raises(ValueError, match='no repacking for IQ2_XS'):
        repack(np.zeros((1, 66), np.uint8), 'IQ2_XS')


def test_stacked_layouts_widen_without_changing_a_value():
    "q (Q4_0), k (Q4_1) and v (Q6_K) stacked: 8-bit codes, groups of 16, zero mins for the rest."
    parts = [('Q4_0', 4), ('Q4_1', 2), ('Q6_K', 2)]
    raws = [(kind, gguf_blocks(kind, rows, 256)) for kind, rows in parts]
    stacked = QuantizedMatrix.cat([repack(raw, kind) for kind, raw in raws])
    assert (stacked.bits, stacked.group_size, stacked.mins is not None) == (8, 16, True)
    exact = np.concatenate([dequantize(raw, GGMLQuantizationType[kind]) for kind, raw in raws])
    assert torch.equal(stacked.dequantize(), torch.from_numpy(exact))


def test_quant_linear_in_float32_is_the_dequantized_linear():
    raw = gguf_blocks('Q5_K', 48, 512)
    bias = torch.randn(48)
    layer = QuantLinear(repack(raw, 'Q5_K'), bias)
    x = torch.randn(5, 512)
    weight = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q5_K))
    assert torch.equal(layer(x), F.linear(x, weight, bias))
    assert layer.prepacked() is layer                      # 8-bit codes: no CPU kernel


@pytest.mark.cpu_paths
@pytest.mark.parametrize('kind', ['Q4_0', 'Q4_1', 'Q4_K'])
def test_int4_kernel_agrees_to_bf16_rounding(kind):
    if not int4_kernel_available(torch.bfloat16):
        pytest.skip("PyTorch's int4 kernel is not vectorized on this CPU: the torch path runs")
    raw = gguf_blocks(kind, 64, 512)
    layer = QuantLinear(repack(raw, kind)).prepacked()
    assert isinstance(layer, Int4Linear)
    x = torch.randn(3, 512)
    exact = F.linear(x, torch.from_numpy(dequantize(raw, GGMLQuantizationType[kind])))
    err = (layer(x.bfloat16()).float() - exact).abs().max()
    assert err <= 0.02 * exact.abs().max(), (err, exact.abs().max())


# --- a random Qwen3 written as a GGUF in each format ------------------------------------------

CONFIG = ModelConfig('qwen3', vocab_size=256, hidden_size=256, intermediate_size=512,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=64, max_position_embeddings=512, rope_theta=10000.0,
                     rms_norm_eps=1e-6, tie_word_embeddings=True)


def write_qwen3_gguf(path, kind, tied=True, v_kind=None):
    "A random Qwen3 of CONFIG's shape as a GGUF: matrices in `kind` (v in v_kind), norms in F32."
    rng = np.random.default_rng(1)
    c = CONFIG
    writer = gguf_writer(path, 'qwen3', c, c.rope_theta)
    writer.add_tokenizer_model('gpt2')
    writer.add_token_list([f't{i}' for i in range(c.vocab_size)])
    H, I, q, kv = c.hidden_size, c.intermediate_size, c.q_size, c.kv_size
    matrices = {'token_embd.weight': (c.vocab_size, H)}
    if not tied:
        matrices['output.weight'] = (c.vocab_size, H)
    for layer in range(c.num_hidden_layers):
        shapes = {'attn_q': (q, H), 'attn_k': (kv, H), 'attn_v': (kv, H), 'attn_output': (H, q),
                  'ffn_gate': (I, H), 'ffn_up': (I, H), 'ffn_down': (H, I)}
        matrices.update({f'blk.{layer}.{name}.weight': shape for name, shape in shapes.items()})
        for norm, size in [('attn_norm', H), ('ffn_norm', H), ('attn_q_norm', c.head_dim),
                           ('attn_k_norm', c.head_dim)]:
            weight = 1 + 0.1 * rng.standard_normal(size).astype(np.float32)
            writer.add_tensor(f'blk.{layer}.{norm}.weight', weight)
    writer.add_tensor('output_norm.weight', np.ones(H, np.float32))
    for name, (rows, cols) in matrices.items():
        this = v_kind if v_kind and '.attn_v.' in name else kind
        writer.add_tensor(name, gguf_blocks(this, rows, cols, rng),
                          raw_dtype=GGMLQuantizationType[this])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope='module')
def ggufs(tmp_path_factory):
    "{case: path}: a random Qwen3 in each packed format (Q4_0 untied, Q4_K with Q6_K v rows)."
    folder = tmp_path_factory.mktemp('quantized')
    cases = {kind: dict(kind=kind) for kind in GGUF_BLOCKS}
    cases['Q4_0'] = dict(kind='Q4_0', tied=False)
    cases['Q4_K+Q6_K'] = dict(kind='Q4_K', v_kind='Q6_K')
    return {case: write_qwen3_gguf(folder/f'{case}.gguf', **kw) for case, kw in cases.items()}


BATCH = prompts(CONFIG.vocab_size, [3, 11, 6, 1], seed=5)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def greedy(path, **options):
    "Greedy tokens for BATCH from LLM(path) in float32, its blocks small and its steps chunked."
    llm = LLM(path, dtype=torch.float32, block_size=4, kv_cache_memory=1 << 20,
              max_num_batched_tokens=8, **options)
    return llm, [out.token_ids for out in llm.generate(BATCH, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize('case', list(GGUF_BLOCKS) + ['Q4_K+Q6_K'])
def test_engine_on_packed_blocks_is_the_dequantized_engine(ggufs, case):
    packed, tokens = greedy(ggufs[case], quantization='gguf')
    layers = [m for m in packed.engine.model.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 4 * CONFIG.num_hidden_layers + 1             # and the head
    assert not any(type(m) is torch.nn.Linear for m in packed.engine.model.modules())
    assert tokens == greedy(ggufs[case], quantization='none')[1]


@pytest.mark.parametrize('options', [dict(batch_invariant=True),
                                     dict(speculative_config={'method': 'ngram',
                                                              'num_speculative_tokens': 3})],
                         ids=['batch_invariant', 'ngram'])
def test_engine_modes_on_packed_blocks(ggufs, options):
    tokens = greedy(ggufs['Q4_1'], quantization='gguf', **options)[1]
    assert tokens == greedy(ggufs['Q4_1'], quantization='none')[1]


def test_default_packs_what_a_kernel_reads(ggufs, caplog):
    "The default keeps packed what a kernel reads here: in float32 on a CPU, nothing."
    with caplog.at_level(logging.INFO, logger='petite_llm.model.quantized'):
        llm, _ = greedy(ggufs['Q4_1'])
    assert not any(isinstance(m, QuantLinear) for m in llm.engine.model.modules())
    assert "kept packed: none; dequantized: {'Q4_1': 15}" in caplog.text


def test_gguf_quantization_needs_a_gguf(tmp_path):
    make_checkpoint(tmp_path, 'qwen3', vocab_size=64, hidden_size=32, intermediate_size=64,
                    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                    head_dim=16)
    with pytest.raises(ValueError, match="not a .gguf file"):
        LLM(tmp_path, quantization='gguf', kv_cache_memory=1 << 20)


def test_smollm2_runs_packed_by_default_where_a_kernel_reads_it():
    "The default model, as the CLI loads it: its Q4_1 projections in the int4 kernel where it runs."
    llm = LLM(smollm2_gguf_path(), kv_cache_memory=1 << 22, max_model_len=64)
    model = llm.engine.model
    packed = any(isinstance(m, (QuantLinear, Int4Linear)) for m in model.modules())
    assert packed == int4_kernel_available(next(model.parameters()).dtype)
    assert packed == any(isinstance(m, Int4Linear) for m in model.modules())
    assert not any(isinstance(m, QuantLinear) for m in model.modules())     # all prepacked
    out = llm.generate(['The capital of France is'], SamplingParams(temperature=0, max_tokens=4),
                       use_tqdm=False)[0]
    assert 'Paris' in out.text


# --- Triton's kernels, under the interpreter on a CPU -----------------------------------------

@pytest.mark.parametrize('kind', ['Q4_0', 'Q4_K', 'Q6_K', 'Q5_1'])
def test_triton_kernels_equal_the_torch_path(kind):
    "GEMV (1, 3 rows) and GEMM (20 rows) against the dequantized product: 70 outputs, a bias."
    from petite_llm.kernels.quant import quant_matmul
    matrix = repack(gguf_blocks(kind, 70, 256), kind)
    bias = torch.randn(70)
    for rows, dtype in [(1, torch.float32), (3, torch.float16), (20, torch.float32),
                        (20, torch.float16)]:
        x = torch.randn(rows, 256).to(dtype)
        ours = quant_matmul(x, matrix.codes, matrix.scales, matrix.mins, bias.to(dtype),
                            matrix.bits, matrix.group_size, matrix.offset)
        reference = F.linear(x.float(), matrix.dequantize(), bias)
        tol = 1e-5 if dtype == torch.float32 else 2e-3
        assert (ours.float() - reference).abs().max() <= tol * reference.abs().max(), (rows, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize('options', [dict(enforce_eager=True, async_scheduling=False),
                                     dict(async_scheduling=False), dict()],
                         ids=['eager', 'graphs', 'graphs_async'])
def test_engine_on_packed_blocks_on_a_gpu(ggufs, options):
    "Triton's kernels in the engine, CUDA graphs and async scheduling: the dequantized tokens."
    for case in ['Q4_1', 'Q4_K+Q6_K', 'Q8_0']:
        llm, tokens = greedy(ggufs[case], quantization='gguf', device='cuda', **options)
        assert any(isinstance(m, QuantLinear) for m in llm.engine.model.modules())
        assert tokens == greedy(ggufs[case], quantization='none', device='cuda', **options)[1]


# --- petite-llm bench quant --------------------------------------------------------------------

def test_bench_quant_quick_reports_bytes_and_speed():
    "The quick run on SmolLM2: decode figures; packed projections within 1.25x their file bytes."
    from petite_llm.bench.quant import run_quant_benchmark
    res = run_quant_benchmark(engines=('packed', 'llama.cpp'), quick=True, decode_tokens=3,
                              batch_sizes=(1,))
    packed = res['engines']['packed']
    assert packed['batch_1_tok_s'] > 0
    if int4_kernel_available(torch.bfloat16):
        assert packed['packed_linear_bytes'] <= 1.25 * packed['their_file_bytes']
    llama = res['engines']['llama.cpp']
    assert 'batch_1_tok_s' in llama or 'pip install llama-cpp-python' in llama['skipped']
