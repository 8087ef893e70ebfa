"""Mixture-of-experts models in the engine modes that tests/test_moe.py does not run: tensor
parallelism on 2 gloo ranks (chapter 20: experts split along their intermediate size, one
all-reduce per sparse block), speculation with a dense draft model (chapter 16) and async
scheduling (chapter 14). Qwen3-MoE and Qwen2-MoE (shared expert) checkpoints written by
transformers (test_moe's fixture, one tensor per expert as the hub stores them), run in float64:
greedy tokens must equal transformers'. Also the slices themselves, without processes: each rank's
experts from per-expert and from already-stacked tensors, and the ranks' partial sums adding up to
the whole block's output; and which MLP widths must split (test_moe.py: a width that does not).
"""
import pytest
import torch
from safetensors.torch import save_file

from petite_llm import LLM, SamplingParams
from petite_llm.engine.paging import kv_bytes_per_block
from petite_llm.model.config import ModelConfig
from petite_llm.model.moe import SparseMoeBlock
from petite_llm.model.weights import load_model
from petite_llm.parallel.tensor_parallel import (all_reduce, check_tensor_parallel,
                                                 shard_checkpoint, shard_config)
from test_moe import VOCAB, checkpoints  # noqa: F401  (checkpoints: the module's fixture)
from test_parity import hf_greedy, make_checkpoint, prompts

pytestmark = pytest.mark.usefixtures("one_thread")

CASES = ['qwen3-mlp-only', 'qwen2-shared']      # dense and sparse layers; a shared expert
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _tokens(llm, batch):
    return [out.token_ids for out in llm.generate(batch, GREEDY, use_tqdm=False)]


def _want(hf, batch):
    return [hf_greedy(hf, p, 8) for p in batch]


def _blocks(configs, num_blocks):
    "kv_cache_memory for num_blocks float64 blocks of 4 tokens of every model in configs."
    return num_blocks * kv_bytes_per_block(configs, 4, torch.float64)


def _shared_prefix_batch(seed):
    "Three prompts sharing a 12-token prefix (three blocks of 4), and one of its own."
    prefix = prompts(VOCAB, [12], seed=seed)[0]
    tails = prompts(VOCAB, [9, 3, 6, 11], seed=seed + 1)
    return [tails[0]] + [prefix + tail for tail in tails[1:]]


# --- tensor parallelism: the slices, in one process -------------------------------------------

def _rank_models(path, size=2):
    "Each rank's model, loaded through the shard hook and not parallelized (no process group)."
    return [load_model(path, dtype=torch.float64, progress=False,
                       shard=lambda config, tensors, rank=rank: shard_checkpoint(
                           config, tensors, rank, size))
            for rank in range(size)]


@pytest.fixture(scope='module', params=CASES)
def whole_and_ranks(request, checkpoints):
    "A case's whole model and its two ranks' shards (float64), loaded once for the tests below."
    path, _ = checkpoints[request.param]
    return load_model(path, dtype=torch.float64, progress=False), _rank_models(path)


def test_each_rank_holds_its_slice_of_every_expert(whole_and_ranks):
    "gate and up rows, down columns of the same slice of I; the router and shared gate whole."
    whole, ranks = whole_and_ranks
    sparse = [i for i, layer in enumerate(whole.model.layers)
              if isinstance(layer.mlp, SparseMoeBlock)]
    assert sparse
    for i in sparse:
        block, parts = whole.model.layers[i].mlp, [r.model.layers[i].mlp for r in ranks]
        gate, up = block.experts.gate_up_proj.chunk(2, dim=1)             # [E, I, H] each
        halves = [p.experts.gate_up_proj.chunk(2, dim=1) for p in parts]  # [E, I / 2, H] each
        assert torch.equal(torch.cat([g for g, _ in halves], dim=1), gate)
        assert torch.equal(torch.cat([u for _, u in halves], dim=1), up)
        assert torch.equal(torch.cat([p.experts.down_proj for p in parts], dim=2),
                           block.experts.down_proj)
        assert all(torch.equal(p.gate.weight, block.gate.weight) for p in parts)
        if block.shared_expert is not None:
            assert all(torch.equal(p.shared_expert_gate.weight, block.shared_expert_gate.weight)
                       for p in parts)
            assert torch.equal(torch.cat([p.shared_expert.down_proj.weight for p in parts], dim=1),
                               block.shared_expert.down_proj.weight)


def test_the_ranks_partial_sums_add_up_to_the_block(whole_and_ranks):
    "Every rank routes alike (same router, same x); the sum of their outputs is the whole block's."
    whole, ranks = whole_and_ranks
    x = torch.randn(13, whole.config.hidden_size, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(0))
    for i, layer in enumerate(whole.model.layers):
        if isinstance(layer.mlp, SparseMoeBlock):
            with torch.no_grad():
                total = sum(r.model.layers[i].mlp(x) for r in ranks)   # what the all-reduce adds
                want = layer.mlp(x)
            assert (total - want).abs().max().item() <= 1e-12 * want.abs().max().item()


def test_an_already_stacked_checkpoint_gives_the_same_slices(checkpoints, tmp_path):
    "transformers' in-memory names ([E, 2I, H] and [E, H, I] tensors) slice to the same shards."
    path, hf = checkpoints['qwen2-shared']
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith('mlp.experts.gate_up_proj') for k in state)
    save_file(state, str(tmp_path/'model.safetensors'))
    (tmp_path/'config.json').write_text((path/'config.json').read_text())
    for per_expert, stacked in zip(_rank_models(path), _rank_models(tmp_path)):
        ours, theirs = dict(per_expert.named_parameters()), dict(stacked.named_parameters())
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[name], theirs[name]) for name in ours)


def test_the_dense_width_counts_only_where_a_layer_is_dense():
    "intermediate_size=50 does not split in 4; it is refused only when a layer uses it."
    kw = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16)
    sparse = ModelConfig('qwen3_moe', VOCAB, 32, 50, 2, 4, 4, 8, **kw)
    check_tensor_parallel(sparse, 4)
    mixed = ModelConfig('qwen3_moe', VOCAB, 32, 50, 2, 4, 4, 8, mlp_only_layers=[0], **kw)
    with pytest.raises(ValueError, match=r"intermediate_size=50 is not a multiple of 4"):
        check_tensor_parallel(mixed, 4)


# --- tensor parallelism: two processes ---------------------------------------------------------

@pytest.mark.parametrize('case', CASES)
def test_tensor_parallel_two_ranks(checkpoints, case):
    "2 gloo ranks, chunked prefill, prefix hits: transformers' greedy tokens."
    path, hf = checkpoints[case]
    local = shard_config(ModelConfig.from_pretrained(path), 2)         # kv_cache_memory: per rank
    llm = LLM(path, tensor_parallel_size=2, dtype='float64', device='cpu', block_size=4,
              max_num_batched_tokens=8, kv_cache_memory=_blocks(local, 128))
    try:
        block = next(layer.mlp for layer in llm.engine.model.model.layers
                     if isinstance(layer.mlp, SparseMoeBlock))
        assert block.reduce is all_reduce
        assert block.experts.gate_up_proj.shape[1] == local.moe_intermediate_size * 2
        batch = _shared_prefix_batch(seed=11)
        assert _tokens(llm, batch) == _want(hf, batch)
        again = _tokens(llm, batch[1:])                        # the shared prefix is cached now
        assert llm.engine.block_manager.num_hit_tokens >= 12
        assert again == _want(hf, batch[1:])
    finally:
        llm.shutdown()


# --- speculation with a dense draft model ------------------------------------------------------

@pytest.fixture(scope='module')
def dense_draft(tmp_path_factory):
    "A random one-layer dense Qwen3 with the MoE models' vocabulary: the draft."
    path = tmp_path_factory.mktemp('dense_draft')
    make_checkpoint(path, 'qwen3', seed=5, vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                    num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                    max_position_embeddings=1024)
    return path


@pytest.mark.parametrize('case', CASES)
def test_dense_draft_speculation(checkpoints, dense_draft, case):
    "A dense draft proposes, the MoE target verifies: chunked prefill and preemption, exact tokens."
    path, hf = checkpoints[case]
    configs = [ModelConfig.from_pretrained(p) for p in (path, dense_draft)]
    spec = {'method': 'draft_model', 'model': str(dense_draft), 'num_speculative_tokens': 3}
    llm = LLM(path, dtype=torch.float64, block_size=4, max_num_batched_tokens=16,
              kv_cache_memory=_blocks(configs, 12), speculative_config=spec)
    batch = prompts(VOCAB, [10, 14, 7, 12], seed=12)
    assert _tokens(llm, batch) == _want(hf, batch)
    assert llm.stats.num_draft_tokens > 0 and llm.stats.num_preemptions > 0


# --- async scheduling ---------------------------------------------------------------------------

@pytest.mark.parametrize('case', CASES)
def test_async_scheduling(checkpoints, case):
    "Step n+1 launched before step n's tokens are read: chunks, preemption, prefix hits, exact."
    path, hf = checkpoints[case]
    config = ModelConfig.from_pretrained(path)
    small = LLM(path, dtype=torch.float64, block_size=4, max_num_batched_tokens=8,
                kv_cache_memory=_blocks(config, 14), async_scheduling=True)
    order, runner = [], small.engine.runner
    launch, resolve = runner.launch, runner.resolve
    runner.launch = lambda *args: order.append('launch') or launch(*args)
    runner.resolve = lambda step: order.append('resolve') or resolve(step)
    batch = prompts(VOCAB, [10, 14, 7, 12], seed=13)
    assert _tokens(small, batch) == _want(hf, batch)
    assert order[:3] == ['launch', 'launch', 'resolve']          # step 2 launched before 1 read
    assert small.stats.num_preemptions > 0
    roomy = LLM(path, dtype=torch.float64, block_size=4, max_num_batched_tokens=8,
                kv_cache_memory=_blocks(config, 128), async_scheduling=True)
    batch = _shared_prefix_batch(seed=14)
    assert _tokens(roomy, batch) == _want(hf, batch)
    assert _tokens(roomy, batch[1:]) == _want(hf, batch[1:])
    assert roomy.engine.block_manager.num_hit_tokens >= 12
