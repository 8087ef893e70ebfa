"""Mixture-of-experts parity with transformers 5.23.0 (chapter 23): Qwen3-MoE with and without
`norm_topk_prob`, with `decoder_sparse_step=2` and with `mlp_only_layers`, and Qwen2-MoE with its
shared expert. transformers writes each random checkpoint (`save_pretrained`, one tensor per
expert); our loader stacks the experts. Compared in float64: logits to float64 rounding and greedy
tokens equal, by the reference path and through the engine (chunked prefill, prefix caching,
preemption, n-gram speculation; the Triton backend, whose MoE block runs the fused kernel, in
tests/test_fused_moe.py; tensor parallelism, a dense draft model and async scheduling in
tests/test_moe_modes.py). On a CPU whose oneDNN packs a dtype, `PackedExperts` (each expert's
matrices packed once) gives the reference's sum, and a bfloat16 engine runs it. No test downloads
anything.
"""
import json

import pytest
import torch
import transformers
from safetensors.torch import save_file

from petite_llm import LLM, SamplingParams
from petite_llm.engine.paging import kv_bytes_per_block
from petite_llm.model.config import ModelConfig
from petite_llm.model.layers.linear import packed_linear_available
from petite_llm.model.moe import Experts, PackedExperts, SparseMoeBlock, route
from petite_llm.model.weights import load_model
from petite_llm.parallel.tensor_parallel import check_tensor_parallel, tensor_parallel_sizes
from test_parity import hf_greedy, hf_logits, ours_greedy, ours_logits, prompts, randomize_

torch.set_num_threads(1)

VOCAB = 128
BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8,
            num_experts_per_tok=3, moe_intermediate_size=16, max_position_embeddings=1024)
CASES = {
    'qwen3-norm': (transformers.Qwen3MoeConfig, dict(norm_topk_prob=True)),
    'qwen3-raw-step2': (transformers.Qwen3MoeConfig, dict(norm_topk_prob=False,
                                                          decoder_sparse_step=2)),
    'qwen3-mlp-only': (transformers.Qwen3MoeConfig, dict(norm_topk_prob=True,
                                                         mlp_only_layers=[0, 2])),
    'qwen2-shared': (transformers.Qwen2MoeConfig, dict(shared_expert_intermediate_size=24)),
}


@pytest.fixture(scope='module')
def checkpoints(tmp_path_factory):
    "{case: (folder, transformers model in float64)}, each written once by save_pretrained."
    out = {}
    for seed, (name, (cfg_cls, extra)) in enumerate(CASES.items()):
        # sdpa: eager attention's softmax is float32 even in float64; eager experts: the loop
        # (the default grouped product refuses float64)
        hf_cfg = cfg_cls(**BASE, **extra, attn_implementation='sdpa')
        hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, experts_implementation='eager')
        randomize_(hf, seed)
        path = tmp_path_factory.mktemp(name)
        hf.save_pretrained(path)
        out[name] = path, hf.double().eval()
    return out


def sparse_layers(model):
    "Which decoder layers of our model have experts."
    return [i for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, SparseMoeBlock)]


def hf_sparse_layers(hf):
    "Which decoder layers of a transformers model have experts."
    return [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, 'experts')]


@pytest.mark.parametrize('case', CASES)
def test_logits_float64(checkpoints, case):
    path, hf = checkpoints[case]
    ours = load_model(path, dtype=torch.float64, progress=False)
    assert sparse_layers(ours) == hf_sparse_layers(hf) != []
    for ids in prompts(VOCAB, [1, 7, 33], seed=1):
        a, b = ours_logits(ours, ids), hf_logits(hf, ids)
        assert (a - b).abs().max().item() <= 1e-10 * b.abs().max().item()


def test_the_cases_cover_what_they_claim(checkpoints):
    "step 2 makes layers 1 and 3 sparse, mlp_only_layers keeps 0 and 2 dense; Qwen2 has a shared one."
    assert hf_sparse_layers(checkpoints['qwen3-raw-step2'][1]) == [1, 3]
    assert hf_sparse_layers(checkpoints['qwen3-mlp-only'][1]) == [1, 3]
    assert hf_sparse_layers(checkpoints['qwen3-norm'][1]) == [0, 1, 2, 3]
    ours = load_model(checkpoints['qwen2-shared'][0], dtype=torch.float64, progress=False)
    assert all(ours.model.layers[i].mlp.shared_expert is not None for i in sparse_layers(ours))


@pytest.mark.parametrize('case', CASES)
def test_greedy_float64(checkpoints, case):
    path, hf = checkpoints[case]
    ours = load_model(path, dtype=torch.float64, progress=False)
    for ids in prompts(VOCAB, [5, 12], seed=2):
        assert ours_greedy(ours, ids, 12) == hf_greedy(hf, ids, 12)


def test_norm_topk_prob_changes_the_output(checkpoints, tmp_path):
    "Flipping norm_topk_prob in config.json alone changes the logits: the flag is read and used."
    path, hf = checkpoints['qwen3-norm']
    flipped = tmp_path/'flipped'
    flipped.mkdir()
    config = json.loads((path/'config.json').read_text()) | {'norm_topk_prob': False}
    (flipped/'config.json').write_text(json.dumps(config))
    (flipped/'model.safetensors').symlink_to(path/'model.safetensors')
    ids = prompts(VOCAB, [9], seed=3)[0]
    a = ours_logits(load_model(flipped, dtype=torch.float64, progress=False), ids)
    assert (a - hf_logits(hf, ids)).abs().max().item() > 1e-3


def test_stacked_checkpoint_loads(checkpoints, tmp_path):
    "A checkpoint with transformers' in-memory names (experts already stacked) loads as well."
    path, hf = checkpoints['qwen2-shared']
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith('mlp.experts.gate_up_proj') for k in state)
    save_file(state, str(tmp_path/'model.safetensors'))
    (tmp_path/'config.json').write_text((path/'config.json').read_text())
    ours = load_model(tmp_path, dtype=torch.float64, progress=False)
    ids = prompts(VOCAB, [10], seed=4)[0]
    a, b = ours_logits(ours, ids), hf_logits(hf, ids)
    assert (a - b).abs().max().item() <= 1e-10 * b.abs().max().item()


def test_a_missing_expert_is_named(checkpoints, tmp_path):
    path, hf = checkpoints['qwen3-norm']
    from safetensors.torch import load_file
    state = load_file(str(path/'model.safetensors'))
    del state['model.layers.2.mlp.experts.5.up_proj.weight']
    save_file(state, str(tmp_path/'model.safetensors'))
    (tmp_path/'config.json').write_text((path/'config.json').read_text())
    with pytest.raises(ValueError, match=r'missing \(1\): model\.layers\.2\.mlp\.experts\.5\.up_proj'):
        load_model(tmp_path, progress=False)


def test_a_width_that_does_not_split_is_refused():
    "An expert width not a multiple of the ranks: refused by name, with the sizes that work."
    config = ModelConfig('qwen2_moe', VOCAB, 32, 48, 2, 4, 2, 8, num_experts=8,
                         num_experts_per_tok=2, moe_intermediate_size=18,
                         shared_expert_intermediate_size=20)
    assert tensor_parallel_sizes(config) == [1, 2]
    with pytest.raises(ValueError, match=r"moe_intermediate_size=18 is not a multiple of 4.*"
                                         r"The sizes that split it: 1, 2"):
        check_tensor_parallel(config, 4)
    shared = ModelConfig('qwen2_moe', VOCAB, 32, 48, 2, 4, 2, 8, num_experts=8,
                         num_experts_per_tok=2, moe_intermediate_size=16,
                         shared_expert_intermediate_size=20)
    with pytest.raises(ValueError,
                       match=r"shared_expert_intermediate_size=20 is not a multiple of 8"):
        check_tensor_parallel(shared, 8)


# --- the engine ------------------------------------------------------------------------------

def _pool(path, num_blocks, block_size=4) -> int:
    "kv_cache_memory bytes for exactly num_blocks float64 blocks."
    return num_blocks * kv_bytes_per_block(ModelConfig.from_pretrained(path), block_size,
                                           torch.float64)


def _engine_tokens(llm, batch, max_tokens):
    "Greedy tokens for the whole batch in one generate call."
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [out.token_ids for out in llm.generate(batch, params, use_tqdm=False)]


def _shared_prefix_batch(seed):
    "Four prompts, the last three sharing a 16-token prefix (four blocks of 4)."
    prefix = prompts(VOCAB, [16], seed=seed)[0]
    tails = prompts(VOCAB, [9, 3, 6, 11], seed=seed + 1)
    return [tails[0]] + [prefix + tail for tail in tails[1:]]


@pytest.mark.parametrize('case', ['qwen3-norm', 'qwen2-shared'])
def test_engine_chunked_prefill_and_prefix_cache(checkpoints, case):
    path, hf = checkpoints[case]
    batch = _shared_prefix_batch(seed=5)
    llm = LLM(path, dtype=torch.float64, block_size=4, max_num_batched_tokens=8,
              kv_cache_memory=_pool(path, 256))
    assert _engine_tokens(llm, batch, 8) == [hf_greedy(hf, p, 8) for p in batch]
    again = _engine_tokens(llm, batch[1:], 8)                      # the prefixes are cached now
    assert llm.engine.block_manager.num_hit_tokens >= 16
    assert again == [hf_greedy(hf, p, 8) for p in batch[1:]]


@pytest.mark.parametrize('case', ['qwen3-raw-step2', 'qwen2-shared'])
def test_engine_preemption(checkpoints, case):
    "A pool of 14 blocks cannot hold the batch: requests are preempted and recomputed."
    path, hf = checkpoints[case]
    batch = prompts(VOCAB, [10, 14, 7, 12], seed=6)
    llm = LLM(path, dtype=torch.float64, block_size=4, max_num_batched_tokens=32,
              kv_cache_memory=_pool(path, 14))
    assert _engine_tokens(llm, batch, 12) == [hf_greedy(hf, p, 12) for p in batch]
    assert llm.stats.num_preemptions > 0


@pytest.mark.parametrize('case', ['qwen3-mlp-only', 'qwen2-shared'])
def test_engine_ngram_speculation(checkpoints, case):
    path, hf = checkpoints[case]
    # repetitive prompts, so that the n-gram proposer has something to propose
    batch = [p * 3 for p in prompts(VOCAB, [4, 5], seed=7)]
    spec = {'method': 'ngram', 'num_speculative_tokens': 3, 'prompt_lookup_min': 1,
            'prompt_lookup_max': 3}
    llm = LLM(path, dtype=torch.float64, block_size=4, kv_cache_memory=_pool(path, 128),
              speculative_config=spec)
    assert _engine_tokens(llm, batch, 10) == [hf_greedy(hf, p, 10) for p in batch]


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_packed_experts_give_the_reference_sum(dtype):
    "1, 5 and 40 tokens over 16 experts (some without a token): Experts' sum to rounding."
    if not packed_linear_available(dtype):
        pytest.skip(f"this CPU's oneDNN has no packed {dtype} product")
    torch.manual_seed(0)
    stack = Experts(num_experts=16, hidden_size=64, intermediate_size=32)
    torch.nn.init.normal_(stack.gate_up_proj, std=64**-.5)
    torch.nn.init.normal_(stack.down_proj, std=32**-.5)
    stack = stack.to(dtype)
    packed = stack.prepacked()
    assert isinstance(packed, PackedExperts) and len(packed.gate_up_proj) == 16
    # float32: oneDNN may add in another order; bfloat16: a few units of its last place
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    for tokens in (1, 5, 40):
        x = torch.randn(tokens, 64).to(dtype)                           # [T, H]
        weights, ids = route(torch.randn(tokens, 16).to(dtype), 4, norm_topk_prob=True)
        want, got = stack(x, weights, ids).float(), packed(x, weights, ids).float()
        assert (got - want).abs().max() <= tol * want.abs().max()


@pytest.mark.skipif(not packed_linear_available(torch.bfloat16),
                    reason="this CPU's oneDNN has no packed bfloat16 product")
def test_a_bfloat16_cpu_engine_packs_its_experts(checkpoints):
    "Loaded by the engine in bf16 on a CPU: every stack packed; the logits, the plain model's."
    path = checkpoints['qwen2-shared'][0]
    llm = LLM(path, dtype=torch.bfloat16, device='cpu', kv_cache_memory=_pool(path, 256))
    packed = llm.engine.model
    assert all(isinstance(packed.model.layers[i].mlp.experts, PackedExperts)
               for i in sparse_layers(packed))
    plain = load_model(path, dtype=torch.bfloat16, progress=False)
    assert isinstance(plain.model.layers[0].mlp.experts, Experts)
    for ids in prompts(VOCAB, [1, 9], seed=9):
        want, got = ours_logits(plain, ids).float(), ours_logits(packed, ids).float()
        assert (got - want).abs().max() <= 2e-2 * want.abs().max()       # bf16 rounding
