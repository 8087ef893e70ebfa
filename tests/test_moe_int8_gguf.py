"""Mixture-of-experts models quantized and read from GGUF (chapters 06 and 19): int8 experts
against the float ones and through the engine; Qwen3-MoE and Qwen2-MoE GGUFs (F32, F16, Q8_0)
written with the `gguf` package from random transformers checkpoints, whose tensor names come from
gguf's own name map, against transformers on the same (dequantized) weights."""
import logging
import re

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf.quants import dequantize, quantize

import petite_llm.model.quantization as quantization
from petite_llm import LLM, SamplingParams
from petite_llm.model.moe import Experts, SparseMoeBlock
from petite_llm.model.quantization import Int8Experts, Int8Linear, load_q8_0, quantize_model
from petite_llm.model.weights import load_model
from test_parity import hf_greedy, hf_logits, ours_greedy, ours_logits, prompts, randomize_
from test_rope_scaling import gguf_writer

torch.set_num_threads(1)

VOCAB = 128
# hidden and expert sizes are multiples of 32, Q8_0's block
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
            num_experts_per_tok=3, moe_intermediate_size=32, max_position_embeddings=256)
CASES = {'qwen3moe': (transformers.Qwen3MoeConfig, dict(norm_topk_prob=True)),
         'qwen2moe': (transformers.Qwen2MoeConfig, dict(shared_expert_intermediate_size=32))}
Q8_0 = gguf.GGMLQuantizationType.Q8_0


def hf_model(arch, seed=0):
    "A random transformers MoE model of `arch` in float64 (eager experts: float64 works there)."
    cfg_cls, extra = CASES[arch]
    hf = transformers.AutoModelForCausalLM.from_config(
        cfg_cls(**BASE, **extra, attn_implementation='sdpa'), experts_implementation='eager')
    randomize_(hf, seed)
    return hf.double().eval()


@pytest.fixture(scope='module')
def checkpoints(tmp_path_factory):
    "{arch: (folder, transformers model in float64)}, written once by save_pretrained."
    out = {}
    for seed, arch in enumerate(CASES):
        hf = hf_model(arch, seed)
        path = tmp_path_factory.mktemp(arch)
        hf.float().save_pretrained(path)
        out[arch] = path, hf.double()
    return out


# --- int8 experts -----------------------------------------------------------------------------

def dequantized(stack: Int8Experts) -> Experts:
    "Float64 experts holding q * scale."
    out = Experts(stack.num_experts, stack.gate_up_proj.shape[2], stack.intermediate_size)
    with torch.no_grad():
        for name in ('gate_up_proj', 'down_proj'):
            q, scale = getattr(stack, name), getattr(stack, f'{name}_scale')
            getattr(out, name).copy_(q.double() * scale.double()[..., None])
    return out.double()


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
@pytest.mark.parametrize('tokens', [1, 16, 17, 50])
def test_int8_experts_compute_the_dequantized_experts(monkeypatch, dtype, tokens):
    "Both int8 paths, experts with and without tokens: the product of q * scale, to rounding."
    monkeypatch.setattr(quantization, 'INT8_MM_MAX_ROWS', 16)       # both paths, on any CPU
    torch.manual_seed(tokens)
    stack = Experts(8, 64, 32)
    torch.nn.init.normal_(stack.gate_up_proj, std=64 ** -0.5)
    torch.nn.init.normal_(stack.down_proj, std=32 ** -0.5)
    int8 = Int8Experts.from_experts(stack.to(dtype))
    assert int8.gate_up_proj.dtype == torch.int8 and int8.gate_up_proj_scale.shape == (8, 64)
    assert int8.down_proj.shape == (8, 64, 32) and int8.down_proj_scale.dtype == dtype
    x = torch.randn(tokens, 64)
    weights = torch.rand(tokens, 2).softmax(-1)
    ids = torch.rand(tokens, 8).topk(2).indices
    with torch.inference_mode():
        out = int8(x.to(dtype), weights.to(dtype), ids)
        reference = dequantized(int8)(x.double(), weights.to(dtype).double(), ids)
    # float32: rounding; bf16: a few 8-bit roundings of each output (two products, SiLU, the sum)
    tol = 1e-5 if dtype == torch.float32 else 2 ** -5
    assert (out.double() - reference).abs().max() <= tol * reference.abs().max()


def test_int8_experts_weights_are_within_half_a_step():
    "Each expert's rows have their own scale; every weight within half of it."
    stack = Experts(4, 64, 32)
    torch.nn.init.normal_(stack.gate_up_proj)
    torch.nn.init.normal_(stack.down_proj)
    with torch.no_grad():
        stack.gate_up_proj[2] *= 100                    # one expert far larger than the others
    int8 = Int8Experts.from_experts(stack)
    for name in ('gate_up_proj', 'down_proj'):
        q, scale = getattr(int8, name), getattr(int8, f'{name}_scale')
        err = (q.float() * scale[..., None] - getattr(stack, name)).abs()
        assert (err <= scale[..., None] / 2 * (1 + 1e-6)).all()
        assert (q.abs().amax(-1) == 127).all()          # each row's largest on the grid's end


def dense_init_(model):
    """test_quantization's tiny model's init (matrices and each expert N(0, 0.02²)), the routers'
    rows N(0, 1) so that a token's experts are not a near-tie that any rounding flips."""
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim >= 2:
                torch.nn.init.normal_(param, std=0.02)
        for block in model.modules():
            if isinstance(block, SparseMoeBlock):
                torch.nn.init.normal_(block.gate.weight)
    return model


@pytest.mark.parametrize('arch', list(CASES))
def test_quantize_model_keeps_routers_float_and_logits_close(checkpoints, arch):
    "Experts and linears int8, routers float; logits within the dense int8 standard."
    path, _ = checkpoints[arch]
    model = dense_init_(load_model(path, dtype=torch.float64))
    ids = prompts(VOCAB, [40], seed=3)[0]
    before = ours_logits(model, ids)
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    shared = arch == 'qwen2moe'
    # per layer: qkv, o; per block: the experts (and the shared expert's two linears); the head
    expected = 2 * BASE['num_hidden_layers'] + len(blocks) * (3 if shared else 1) + 1
    assert quantize_model(model, 'int8') == expected
    for block in blocks:
        assert isinstance(block.experts, Int8Experts)
        assert type(block.gate) is torch.nn.Linear and block.gate.weight.dtype == torch.float64
        if shared:
            assert type(block.shared_expert_gate) is torch.nn.Linear
            assert isinstance(block.shared_expert.gate_up_proj, Int8Linear)
    after = ours_logits(model, ids)
    rel = ((after - before).abs().max() / before.abs().max()).item()
    assert 0 < rel < 0.02
    assert (after.argmax(-1) == before.argmax(-1)).float().mean() > 0.9


@pytest.mark.parametrize('backend', ['torch', 'triton'])
@pytest.mark.parametrize('arch', list(CASES))
def test_engine_int8_moe_equals_the_int8_reference(checkpoints, arch, backend):
    "LLM(path, quantization='int8'), batched and chunked, either backend: the int8 model's greedy."
    path, _ = checkpoints[arch]
    llm = LLM(path, quantization='int8', dtype=torch.float64, block_size=4,
              kv_cache_memory=2**22, max_num_batched_tokens=8, attention_backend=backend)
    assert all(isinstance(m.experts, Int8Experts) for m in llm.engine.runner.model.modules()
               if isinstance(m, SparseMoeBlock))
    batch = prompts(VOCAB, [3, 11, 6], seed=5)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ours = [out.token_ids for out in llm.generate(batch, params, use_tqdm=False)]
    reference = load_model(path, dtype=torch.float64)
    quantize_model(reference, 'int8')
    assert ours == [ours_greedy(reference, p, 6) for p in batch]


# --- GGUF -------------------------------------------------------------------------------------

def gguf_pieces(name, tensor, cfg):
    "One transformers tensor as (transformers name, array) pieces; stacked experts cut in gate/up."
    if name.endswith('.experts.gate_up_proj'):                           # [E, 2I, H]
        gate, up = tensor.split(cfg.moe_intermediate_size, dim=1)
        prefix = name.removesuffix('gate_up_proj')
        return [(prefix + 'gate_proj', gate), (prefix + 'up_proj', up)]
    if name.endswith('.experts.down_proj'):
        return [(name, tensor)]
    if name.endswith('.shared_expert_gate.weight'):     # llama.cpp's loader wants it as [H]
        return [(name, tensor.flatten())]
    return [(name, tensor)]


def stored(array, kind):
    "An array as written in `kind` (F32, F16 or Q8_0) and the float64 values it stands for."
    if kind == 'F16':
        array = array.astype(np.float16)
        return array, array.astype(np.float64)
    if kind == 'Q8_0' and array.ndim >= 2:
        raw = quantize(array, Q8_0)
        return raw, dequantize(raw, Q8_0).astype(np.float64)
    return array, array.astype(np.float64)


def write_moe_gguf(path, hf, arch, kind):
    """hf's weights as a GGUF of `arch`, matrices in `kind` (norms, biases and routers in F32),
    names from gguf's own map; returns transformers' state dict of the values as stored."""
    cfg = hf.config
    writer = gguf_writer(path, arch, cfg, cfg.rope_parameters['rope_theta'])
    writer.add_expert_count(cfg.num_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    writer.add_expert_weights_norm(cfg.norm_topk_prob)
    if getattr(cfg, 'shared_expert_intermediate_size', 0):
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    writer.add_tokenizer_model('gpt2')
    writer.add_token_list([f't{i}' for i in range(cfg.vocab_size)])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.num_hidden_layers)
    values = {}
    for name, tensor in hf.state_dict().items():
        pieces = []
        for piece_name, piece in gguf_pieces(name, tensor.float(), cfg):
            gguf_name = names.get_name(piece_name, try_suffixes=('.weight', '.bias'))
            assert gguf_name is not None, piece_name
            if not gguf_name.endswith(('.weight', '.bias')):
                gguf_name += '.weight'
            router = gguf_name.split('.')[-2] in ('ffn_gate_inp', 'ffn_gate_inp_shexp')
            array, value = stored(piece.numpy(), 'F32' if router else kind)
            writer.add_tensor(gguf_name, array,
                              raw_dtype=Q8_0 if array.dtype == np.uint8 else None)
            pieces.append(torch.from_numpy(value).reshape(piece.shape))
        values[name] = torch.cat(pieces, dim=1) if len(pieces) > 1 else pieces[0]
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {name: value.reshape(hf.state_dict()[name].shape) for name, value in values.items()}


@pytest.fixture(scope='module')
def ggufs(checkpoints, tmp_path_factory):
    "{(arch, kind): (file, transformers float64 model on the weights as stored)}."
    out = {}
    for arch in CASES:
        for kind in ('F32', 'F16', 'Q8_0'):
            hf = checkpoints[arch][1]
            file = tmp_path_factory.mktemp(f'{arch}-{kind}')/'model.gguf'
            reference = hf_model(arch)
            reference.load_state_dict(write_moe_gguf(file, hf, arch, kind))
            out[arch, kind] = file, reference.double().eval()
    return out


def test_the_gguf_holds_llama_cpp_names_and_layouts(ggufs):
    "3-D experts as [in, out, E] innermost first; the names gguf's tables give the architecture."
    reader = gguf.GGUFReader(ggufs['qwen2moe', 'Q8_0'][0])
    tensors = {t.name: t for t in reader.tensors}
    H, I, E = BASE['hidden_size'], BASE['moe_intermediate_size'], BASE['num_experts']
    assert tensors['blk.0.ffn_gate_exps.weight'].shape.tolist() == [H, I, E]
    assert tensors['blk.1.ffn_down_exps.weight'].shape.tolist() == [I, H, E]
    assert tensors['blk.0.ffn_up_exps.weight'].tensor_type == Q8_0
    assert tensors['blk.0.ffn_gate_inp.weight'].shape.tolist() == [H, E]
    assert tensors['blk.0.ffn_gate_inp_shexp.weight'].shape.tolist() == [H]
    allowed = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH.QWEN2MOE]}
    assert {re.sub(r'^blk\.\d+\.', 'blk.{bid}.', name.rsplit('.', 1)[0])
            for name in tensors} <= allowed


@pytest.mark.parametrize('kind', ['F32', 'F16', 'Q8_0'])
@pytest.mark.parametrize('arch', list(CASES))
def test_gguf_moe_matches_transformers(ggufs, arch, kind):
    "load_model(gguf) in float64: transformers' greedy tokens and logits on the stored weights."
    file, reference = ggufs[arch, kind]
    model = load_model(file, dtype=torch.float64)
    for ids in prompts(VOCAB, [5, 17], seed=11):
        ours, theirs = ours_logits(model, ids), hf_logits(reference, ids)
        assert (ours - theirs).abs().max() <= 1e-9 * theirs.abs().max()
        assert ours_greedy(model, ids, 6) == hf_greedy(reference, ids, 6)


@pytest.mark.parametrize('arch', list(CASES))
def test_q8_0_experts_go_straight_to_int8(ggufs, arch):
    "load_q8_0 fills every expert's rows from its blocks: within half a row step of the values."
    # (the int8 model's logits are test_quantize_model_keeps_routers_float_and_logits_close's:
    # these unit-scale random weights would magnify any error past the dense model's bound)
    file, reference = ggufs[arch, 'Q8_0']
    model = load_model(file, dtype=torch.float64)
    quantize_model(model, 'int8')
    with torch.no_grad():                                # forget what quantize_model wrote
        for m in model.modules():
            if isinstance(m, Int8Experts):
                m.gate_up_proj.zero_()
                m.down_proj.zero_()
    loaded = load_q8_0(model, file)
    E, L = BASE['num_experts'], BASE['num_hidden_layers']
    shared = 3 if arch == 'qwen2moe' else 0             # its gate, up and down
    assert loaded == L * (3 * E + shared + 4) + 1        # experts, q k v o, the head
    values = reference.state_dict()
    for i, layer in enumerate(model.model.layers):
        stack = layer.mlp.experts
        for name in ('gate_up_proj', 'down_proj'):
            exact = values[f'model.layers.{i}.mlp.experts.{name}']              # [E, rows, cols]
            q, scale = getattr(stack, name), getattr(stack, f'{name}_scale')
            assert ((q.double() * scale[..., None] - exact).abs()
                    <= scale[..., None] / 2 * (1 + 1e-9)).all()


def test_engine_loads_a_q8_0_moe_gguf_as_int8(ggufs):
    "LLM(gguf, quantization='int8') reads the Q8_0 experts; greedy equals its reference path."
    file, _ = ggufs['qwen3moe', 'Q8_0']
    llm = LLM(file, quantization='int8', dtype=torch.float64, block_size=4,
              kv_cache_memory=2**22)
    batch = prompts(VOCAB, [4, 9], seed=8)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    ours = [out.token_ids for out in llm.generate(batch, params, use_tqdm=False)]
    reference = load_model(file, dtype=torch.float64)
    quantize_model(reference, 'int8')
    load_q8_0(reference, file)
    assert ours == [ours_greedy(reference, p, 5) for p in batch]


def test_a_q8_0_moe_gguf_over_two_ranks(ggufs, record_logits, caplog):
    "2 gloo ranks, each reading its slice of every Q8_0 expert: the first logits of one rank."
    file, _ = ggufs['qwen2moe', 'Q8_0']
    batch = prompts(VOCAB, [4, 9], seed=8)
    first = SamplingParams(temperature=0, max_tokens=1)
    logits = {}
    for size in (1, 2):
        with caplog.at_level(logging.INFO, logger='petite_llm'):
            llm = LLM(file, tensor_parallel_size=size, quantization='int8', dtype=torch.float64,
                      device='cpu', block_size=4, kv_cache_memory=2**22)
        try:
            rows = record_logits(llm)
            llm.generate(batch, first, use_tqdm=False)
            logits[size] = torch.stack([rows[tuple(p)][0] for p in batch])
        finally:
            llm.shutdown()
    E, L = BASE['num_experts'], BASE['num_hidden_layers']
    # every expert's three matrices, the shared expert's three, q k v o, then the head
    assert f"rank 0: {L * (3 * E + 3 + 4) + 1} matrices read from Q8_0 blocks" in caplog.text
    # a rank's rows and columns are slices of one rank's int8 matrices, scales and all: only the
    # all-reduce's order of sums differs
    assert (logits[2] - logits[1]).abs().max() <= 1e-9 * logits[1].abs().max()
