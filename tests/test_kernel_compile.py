"""Every Triton kernel compiles for the GPUs readers have, on a CPU: chapter 13's recorder takes
every launch of short engine runs (without running them), and `compile_for_gpus` compiles each
distinct variant ahead of time, every one for sm_80 and sm_90 and each kernel's representatives for
sm_75, sm_86, sm_89, sm_120, gfx90a, gfx942 and gfx1100. The checker itself fails on a compile
error that the interpreter accepts, and on a kernel that needs more shared memory than a block of
one GPU may use."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")        # before the kernels are defined

import pytest
import triton
import triton.language as tl

from petite_llm.model.config import ModelConfig
from petite_llm.engine.llm_engine import LLMEngine
from petite_llm.kernels.gpu_compile import (EVERY_VARIANT, GPU_TARGETS, compile_for_gpus,
                                              compile_report, record_launches)
from petite_llm.kernels.quant import quant_matmul
from petite_llm.model.qwen3 import Qwen3ForCausalLM
from petite_llm.bench.lora import random_peft_adapter
from petite_llm.engine.lora import LoRARequest
from petite_llm.engine.paging import kv_bytes_per_block
from petite_llm.model.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

# (query heads, KV heads, head_dim, QK-norm, hidden size, intermediate size): the layouts the
# tests use, then one layer of Qwen3-0.6B and of Qwen3-8B (their norms and MLP at full width)
LAYOUTS = [(2, 1, 64, True, 64, 128), (4, 2, 64, False, 64, 128), (6, 3, 128, True, 64, 128),
           (8, 8, 128, False, 64, 128), (16, 8, 128, True, 1024, 3072),
           (32, 8, 128, True, 4096, 12288)]
BLOCK_SIZE = 16
# a sparse layer: 8 experts, 2 per token, so decode steps (6 rows) take the fused-MoE kernel's
# 16-row tiles and 32-token prefill steps (64 rows) its 64-row tiles
MOE = dict(model_type='qwen3_moe', num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)


def layout_config(layout, moe=None):
    "One decoder layer of this layout (sparse with the moe fields) and a small vocabulary."
    num_heads, num_kv_heads, head_dim, qk_norm, hidden, intermediate = layout
    fields = dict(model_type='qwen3' if qk_norm else 'qwen2', vocab_size=256,
                  hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=1,
                  num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                  head_dim=head_dim, qk_norm=qk_norm, max_position_embeddings=8192,
                  tie_word_embeddings=True, eos_token_id=[1])
    return ModelConfig(**{**fields, **(moe or {})})


def random_model(layout, dtype, moe=None):
    "A model of one layer of this layout with random weights, built in dtype."
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return Qwen3ForCausalLM(layout_config(layout, moe)).eval()
    finally:
        torch.set_default_dtype(default)


def block_bytes(layout, dtype):
    "Bytes of one KV block of every layer: 300 of them hold the longest context below."
    return kv_bytes_per_block(layout_config(layout), BLOCK_SIZE, dtype)


def generate(engine, prompts, max_tokens=3):
    "Greedy tokens for the prompts, run together: prefill, mixed and decode-only steps."
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params)
    while engine.has_unfinished_requests():
        engine.step()


def split_kv_decodes(engine, contexts):
    "A decode after each context on a backend that believes it has an H100's 132 SMs: split-KV."
    runner = engine.runner
    runner.backend.num_sms = 132
    for context in contexts:
        table = list(range(context // BLOCK_SIZE + 1))
        md = runner.backend.build_metadata([table], [context], [1], BLOCK_SIZE, 'cpu')
        runner.forward(torch.tensor([7]), md.positions, md)


def engine_run(layout, dtype, split_contexts=(), moe=None, **options):
    "Prompts of 3 to 40 tokens in 32-token steps (prefill, mixed, decode), then split-KV decodes."
    engine = LLMEngine(random_model(layout, dtype, moe), attention_backend='triton',
                       block_size=BLOCK_SIZE, max_num_batched_tokens=32, max_model_len=4200,
                       kv_cache_memory=300 * block_bytes(layout, dtype), **options)
    generate(engine, [[5, 9, 200, 17, 3], list(range(2, 42)), [11, 12, 13]])
    split_kv_decodes(engine, split_contexts)


@torch.inference_mode()
def record_engine_launches():
    "Every kernel variant the engine launches: each layout in bf16 and fp16, every mode."
    # greedy requests that ignore EOS take the same steps whatever the kernels compute
    with record_launches(execute=False) as variants:
        for layout in LAYOUTS:
            real = layout in LAYOUTS[-2:]
            # contexts that split into 2, 4, 8 and 16 segments (the real models in bf16)
            engine_run(layout, torch.bfloat16, (512, 1024, 2048, 4096) if real else (1024,))
            engine_run(layout, torch.float16, (1024,))
            engine_run(layout, torch.bfloat16, batch_invariant=True)
        for dtype in (torch.bfloat16, torch.float16):          # the fused-MoE kernel's variants
            engine_run(LAYOUTS[0], dtype, moe=MOE)
        # speculation's verify step: k + 1 query tokens of a sequence after its prefill
        engine = LLMEngine(random_model(LAYOUTS[1], torch.bfloat16), attention_backend='triton',
                           block_size=BLOCK_SIZE, kv_cache_memory=2**20, max_model_len=256,
                           speculative_config={'method': 'ngram', 'num_speculative_tokens': 3})
        generate(engine, [[3, 4, 5, 6] * 4], max_tokens=6)
        for layout in (LAYOUTS[1], LAYOUTS[4]):                # chapter 24's LoRA kernels
            for dtype in (torch.bfloat16, torch.float16):
                lora_run(layout, dtype)
        record_quant_launches()
    return variants


def lora_run(layout, dtype, rank=16):
    "Two adapters and the base model in prefill, mixed and decode steps (chapter 24)."
    import tempfile
    engine = LLMEngine(random_model(layout, dtype), attention_backend='triton',
                       block_size=BLOCK_SIZE, max_num_batched_tokens=32, max_model_len=256,
                       kv_cache_memory=64 * block_bytes(layout, dtype), enable_lora=True,
                       max_loras=2, max_lora_rank=rank)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        for i, prompt in enumerate([[5, 9, 200, 17, 3], list(range(2, 42)), [11, 12, 13]]):
            path = random_peft_adapter(f'{tmp}/a{i}', layout_config(layout), rank, seed=i)
            request = LoRARequest(f'a{i}', i, str(path)) if i else None
            engine.add_request(prompt, params, lora_request=request)
        while engine.has_unfinished_requests():
            engine.step()


def record_quant_launches(out_features=128, in_features=512):
    "Chapter 19's matmuls on GGUF codes: each layout, the GEMV and both GEMM tiles, bf16, fp16."
    # (bits, group, offset, min): Q4_0; Q4_1 and Q4_K; Q5_0 and Q8_0; Q5_1 and Q5_K; Q6_K;
    # a stack of Q4_K and Q6_K parts
    layouts = [(4, 32, 8, False), (4, 32, 0, True), (8, 32, 0, False), (8, 32, 0, True),
               (8, 16, 0, False), (8, 16, 0, True)]
    for bits, group, offset, has_min in layouts:
        codes = torch.zeros(out_features, in_features * bits // 8,
                            dtype=torch.uint8 if bits == 4 else torch.int8)
        scales = torch.ones(out_features, in_features // group)
        mins = torch.zeros_like(scales) if has_min else None
        for dtype, rows in [(torch.bfloat16, 1), (torch.bfloat16, 64), (torch.float16, 8)]:
            quant_matmul(torch.ones(rows, in_features, dtype=dtype), codes, scales, mins, None,
                         bits, group, offset)
    bias = torch.zeros(out_features, dtype=torch.bfloat16)        # Qwen2's q/k/v have biases
    quant_matmul(torch.ones(1, in_features, dtype=torch.bfloat16), codes, scales, mins, bias,
                 bits, group, offset)


ENGINE_KERNELS = {'_qk_norm_rope_store_kernel', '_unified_attention_kernel', '_silu_and_mul_kernel',
                  '_split_kv_attention_kernel', '_merge_segments_kernel',
                  '_fused_add_rms_norm_kernel', '_fused_moe_kernel', '_topk_sum_kernel',
                  '_lora_shrink_kernel', '_lora_expand_kernel',
                  '_quant_gemv_kernel', '_quant_gemm_kernel'}


def test_every_kernel_the_engine_launches_compiles_for_every_target():
    variants = record_engine_launches()
    rows = compile_for_gpus(variants.values())
    print(f"\n{len(variants)} kernel variants recorded; every one compiled for "
          f"{', '.join(EVERY_VARIANT)}, each kernel's representatives for the others:")
    print(compile_report(rows))
    for arch in GPU_TARGETS:
        mine = [row for row in rows if row['arch'] == arch]
        assert {row['variant'].split('(')[0] for row in mine} >= ENGINE_KERNELS, arch
        if arch in EVERY_VARIANT:
            assert len(mine) == len(variants), arch
    problems = [row for row in rows if row['problem']]
    assert not problems, compile_report(problems)


# --- the checker fails where it must -----------------------------------------------------------

@triton.jit
def _redefined_in_if_kernel(out_ptr, flag, N: tl.constexpr):
    "The interpreter runs this; the compiler refuses it: offs changes shape inside the if."
    offs = tl.arange(0, N)
    if flag > 0:
        offs = tl.arange(0, 2 * N)
    tl.store(out_ptr + offs, offs.to(tl.float32))


@triton.jit
def _big_tile_kernel(a_ptr, b_ptr, out_ptr, BLOCK: tl.constexpr):
    "One BLOCK x BLOCK matrix product: its operands are staged in shared memory."
    offs = tl.arange(0, BLOCK)
    tile = offs[:, None] * BLOCK + offs[None, :]
    tl.store(out_ptr + tile, tl.dot(tl.load(a_ptr + tile), tl.load(b_ptr + tile)))


def test_a_compile_error_the_interpreter_accepts_is_reported():
    "flag=2 reaches the compiler as an i32 and fails; flag=1 as the constant 1 the JIT makes it."
    out = torch.zeros(16)
    with record_launches() as variants:
        for flag in (2, 1):
            _redefined_in_if_kernel[(1,)](out, flag, N=8)
    assert out.tolist() == list(range(16))                   # the interpreter ran it
    failed, constant = compile_for_gpus(variants.values(), {'sm_90': GPU_TARGETS['sm_90']},
                                        every=('sm_90',))
    assert failed['variant'].startswith('_redefined_in_if_kernel(*fp32; N=8;')
    assert 'CompilationError' in failed['problem'] and 'redefines' in failed['problem']
    assert failed['problem'] in compile_report([failed])
    assert constant['variant'].startswith('_redefined_in_if_kernel(*fp32; flag=1, N=8;')
    assert constant['problem'] is None              # the if was decided before it was compiled


def test_shared_memory_beyond_one_gpus_limit_is_reported_for_that_gpu():
    "Two 128 x 128 float32 tiles, 128 KiB: an H100's block may use 227 KiB, an RTX 4090's 99."
    a = torch.ones(128, 128)
    with record_launches(execute=False) as variants:
        _big_tile_kernel[(1,)](a, a, torch.empty(128, 128), BLOCK=128)
    targets = {arch: GPU_TARGETS[arch] for arch in ('sm_89', 'sm_90')}
    on_sm89, on_sm90 = compile_for_gpus(variants.values(), targets, every=tuple(targets))
    assert GPU_TARGETS['sm_89'].shared < on_sm89['shared'] < GPU_TARGETS['sm_90'].shared
    assert 'shared memory' in on_sm89['problem'] and 'sm_89' in on_sm89['problem']
    assert on_sm90['problem'] is None and on_sm90['shared'] == on_sm89['shared']


def test_the_other_targets_compile_the_variant_using_most_shared_memory():
    "Of a kernel's variants, sm_75 compiles the one that used the most shared memory on sm_90."
    with record_launches(execute=False) as variants:
        for block in (32, 16):
            a = torch.ones(block, block, dtype=torch.float16)
            _big_tile_kernel[(1,)](a, a, torch.empty(block, block), BLOCK=block)
    targets = {arch: GPU_TARGETS[arch] for arch in ('sm_90', 'sm_75')}
    rows = compile_for_gpus(variants.values(), targets, every=('sm_90',))
    on_sm90 = {row['variant']: row['shared'] for row in rows if row['arch'] == 'sm_90'}
    [on_sm75] = [row for row in rows if row['arch'] == 'sm_75']
    assert len(on_sm90) == 2 and on_sm75['variant'] == max(on_sm90, key=on_sm90.get)
    assert 'BLOCK=32' in on_sm75['variant'] and on_sm75['problem'] is None
