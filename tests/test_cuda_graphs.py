"""CUDA graphs (chapter 14): buckets, static buffers, padding, stale columns — and the same tokens,
for dense models and for mixture-of-experts ones (chapter 23's fused path reads nothing back to the
host, so the triton backend's MoE decode step is captured too; int8 experts read back, so their
steps run eagerly).

On a CPU the recording is replaced by a stand-in that re-runs the recorded function into the same
output tensor, so everything around the graph (what is copied where, which bucket, which rows are
padding) is tested here with the triton backend in Triton's interpreter. The `gpu` tests record
real graphs and compare with eager steps and with transformers.
"""
import logging
from types import SimpleNamespace

import pytest
import torch
import transformers

from petite_llm.engine.backends import AttentionMetadata
from petite_llm.model.config import ModelConfig
from petite_llm.model.moe import Experts
from petite_llm.engine.config import EngineConfig
from petite_llm.engine.llm_engine import LLM, LLMEngine, log_engine_start
from petite_llm.engine.loading import get_attention_backend
from petite_llm.engine.runner import CUDAGraphs, cuda_graph_batch_sizes, graphs_apply
from petite_llm.model.quantization import quantize_model
from petite_llm.model.qwen3 import Qwen3ForCausalLM
from petite_llm.model.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def replay_eagerly(fn, pool=None):
    "Stand-in for capture_cuda_graph: replay re-runs fn into the output tensor it first returned."
    output = fn()
    return (lambda: output.copy_(fn())), output, object() if pool is None else pool


def test_batch_sizes():
    assert cuda_graph_batch_sizes(1) == [1]
    assert cuda_graph_batch_sizes(8) == [1, 2, 4, 8]
    assert cuda_graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert cuda_graph_batch_sizes(70) == [1, 2, 4, 8, 16, 32, 48, 64, 70]
    sizes = cuda_graph_batch_sizes(256)          # padding of at most 15 rows above 8
    assert sizes[:5] == [1, 2, 4, 8, 16] and all(b - a == 16 for a, b in zip(sizes[4:], sizes[5:]))


def _md(tables, context_lens, backend):
    "Decode-only metadata for sequences with these tables and contexts (last token new)."
    return backend.build_metadata(tables, [n - 1 for n in context_lens], [1] * len(tables), 4,
                                  'cpu')


class _Recorder:
    "A backend stand-in that records the metadata each replay attends with."
    name, supports_cuda_graphs = 'recorder', True

    def __init__(self):
        self.seen = []

    def build_metadata(self, *args):
        return AttentionMetadata.build(*args, backend=self)


def test_every_bucket_is_recorded_in_the_first_graphs_pool():
    "The largest bucket first, in a new pool; every later capture is handed that same pool."
    graphs = CUDAGraphs(_Recorder(), max_num_seqs=8, max_blocks=2, block_size=4, device='cpu')
    first_pool, captured = object(), []

    def capture(fn, pool=None):
        captured.append((len(fn.args[0]), pool))
        return (lambda: None), fn(), first_pool if pool is None else object()

    graphs.capture(lambda input_ids, positions, md: input_ids[:, None].float(), capture)
    assert captured == [(8, None), (4, first_pool), (2, first_pool), (1, first_pool)]
    assert sorted(graphs.graphs) == [1, 2, 4, 8]


def test_replay_pads_and_clears_stale_columns():
    "A narrower table after a wider one leaves no stale block ids; padding rows store/read nothing."
    backend = _Recorder()
    graphs = CUDAGraphs(backend, max_num_seqs=4, max_blocks=6, block_size=4, device='cpu')

    def forward(input_ids, positions, md):
        # what a kernel would read, copied at replay time
        backend.seen.append((md.slot_mapping.clone(), md.context_lens.clone(),
                             md.block_tables.clone(), positions.clone()))
        return input_ids[:, None].float()                           # [B, 1] "hidden"

    graphs.capture(forward, replay_eagerly)
    assert sorted(graphs.graphs) == [1, 2, 4]
    wide = _md([[5, 1, 2, 3, 4], [6, 7, 8]], [18, 10], backend)      # 2 sequences, 5 columns
    assert graphs.can_replay(wide)
    hidden = graphs.replay(torch.tensor([11, 12]), wide)
    assert hidden[:, 0].tolist() == [11, 12]
    slots, lens, tables, positions = backend.seen[-1]
    assert tables.shape == (2, 6) and tables[0, :5].tolist() == [5, 1, 2, 3, 4]
    assert positions.tolist() == [17, 9]
    narrow = _md([[9], [3, 2], [1]], [2, 5, 1], backend)             # 3 sequences: bucket 4
    hidden = graphs.replay(torch.tensor([21, 22, 23]), narrow)
    assert hidden.shape == (3, 1) and hidden[:, 0].tolist() == [21, 22, 23]
    slots, lens, tables, positions = backend.seen[-1]
    assert tables.shape == (4, 6)
    assert tables[:3].tolist() == [[9, 0, 0, 0, 0, 0], [3, 2, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0]]
    assert slots[3].item() == -1 and lens[3].item() == 0             # the padding row
    assert lens[:3].tolist() == [2, 5, 1]
    assert slots[:3].tolist() == [9 * 4 + 1, 2 * 4 + 0, 1 * 4 + 0]


def test_what_cannot_replay():
    backend = _Recorder()
    graphs = CUDAGraphs(backend, max_num_seqs=2, max_blocks=2, block_size=4, device='cpu')
    assert graphs.can_replay(_md([[0], [1]], [3, 4], backend))
    assert not graphs.can_replay(_md([[0], [1], [2]], [3, 4, 1], backend))   # more than captured
    assert not graphs.can_replay(_md([[0, 1, 2]], [9], backend))             # wider table
    prefill = backend.build_metadata([[0], [1]], [3, 0], [1, 4], 4, 'cpu')
    assert not graphs.can_replay(prefill)                                    # a prefill chunk


# a sparse layer in every layer: 8 experts, 2 per token
MOE = dict(model_type='qwen3_moe', num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16)


def _tiny(dtype=torch.float32, **overrides):
    torch.manual_seed(0)
    kw = dict(model_type='qwen3', vocab_size=64, hidden_size=32, intermediate_size=64,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              qk_norm=True, max_position_embeddings=256)
    kw.update(overrides)
    model = Qwen3ForCausalLM(ModelConfig(**kw))
    for stack in [m for m in model.modules() if isinstance(m, Experts)]:
        torch.nn.init.normal_(stack.gate_up_proj, std=32 ** -0.5)     # made with torch.empty
        torch.nn.init.normal_(stack.down_proj, std=16 ** -0.5)
    return model.to(dtype).eval()


def _greedy_tokens(engine, prompts, max_tokens):
    "Each prompt's greedy tokens, all generated together (sequences finish at different steps)."
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
           for p, n in zip(prompts, max_tokens)]
    done = {}
    while engine.has_unfinished_requests():
        done.update({out.request_id: out for out in engine.step() if out.finished})
    return [done[i].outputs[0].token_ids for i in ids]


@pytest.mark.parametrize("block_size, moe", [(1, {}), (4, {}), (4, MOE)],
                         ids=['1', '4', '4-moe'])
def test_graphed_engine_gives_the_eager_tokens(block_size, moe):
    "Triton backend (interpreted on a CPU), stand-in graphs: the eager tokens, decodes replayed."
    model = _tiny(**moe).to(DEVICE)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [11, 12, 13, 14, 15, 16, 17], [3] * 9, [5, 6]]
    max_tokens = [12, 3, 5, 6, 4]                 # the batch shrinks: 5 → 4 → … → 1, new buckets
    kw = dict(attention_backend='triton', block_size=block_size, kv_cache_memory=2**20,
              max_num_seqs=5, max_num_batched_tokens=16)
    eager = LLMEngine(model, enforce_eager=True, **kw)
    graphed = LLMEngine(model, enforce_eager=True, **kw)
    graphed.runner.capture_cuda_graphs(5, graphed.max_model_len, capture=replay_eagerly)
    replays = []
    graphed.runner.cuda_graphs.graphs = {
        size: ((lambda r=replay, s=size: (replays.append(s), r())), out)
        for size, (replay, out) in graphed.runner.cuda_graphs.graphs.items()}
    assert _greedy_tokens(graphed, prompts, max_tokens) == _greedy_tokens(eager, prompts,
                                                                          max_tokens)
    assert {1, 2, 4, 5} <= set(replays) <= {1, 2, 4, 5}


def test_enforce_eager_and_cpu_record_nothing():
    engine = LLMEngine(_tiny(), kv_cache_memory=2**20)
    assert engine.runner.cuda_graphs is None


def test_the_start_up_log_counts_the_buckets_and_times_their_recording(caplog):
    engine = LLMEngine(_tiny(), attention_backend='triton', enforce_eager=True,
                       kv_cache_memory=2**20, max_num_seqs=20)
    engine.runner.capture_cuda_graphs(20, engine.max_model_len, capture=replay_eagerly)
    sizes = SimpleNamespace(num_blocks=8, kv_cache_memory=2**20, source='given', max_model_len=64,
                            max_num_batched_tokens=64, max_num_seqs=20)
    with caplog.at_level(logging.INFO, logger='petite_llm.engine'):
        log_engine_start(EngineConfig(), sizes, engine.runner)
    assert "replay CUDA graphs for 6 batch sizes, 1 to 20 (recorded in " in caplog.text
    assert engine.runner.cuda_graphs.capture_seconds > 0


def test_int8_experts_keep_the_step_eager():
    "Float experts run fused and fit a graph; int8 ones read their counts on the host: no graph."
    backend = get_attention_backend('triton', 'cpu')
    dense, moe = _tiny(), _tiny(**MOE)
    assert graphs_apply(dense, backend) and graphs_apply(moe, backend)
    assert not graphs_apply(moe, get_attention_backend('torch', 'cpu'))
    quantize_model(dense, 'int8')
    quantize_model(moe, 'int8')
    assert graphs_apply(dense, backend) and not graphs_apply(moe, backend)


# --- on a GPU: real graphs -------------------------------------------------------------------

def _hf_checkpoint(path, dtype):
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                                   initializer_range=0.2, eos_token_id=2)
    transformers.Qwen3ForCausalLM(cfg).to(dtype).save_pretrained(path)
    return transformers.Qwen3ForCausalLM.from_pretrained(path, dtype=dtype).cuda().eval()


PROMPTS = [[5, 6, 7], [9] * 20, list(range(10, 50)), [3, 4], [8] * 3]


def _graphs_match_eager_and_hf(eager, graphed, hf, prompts, record_logits):
    "Greedy tokens of the graphed engine equal the eager one's; its logits within 1e-4 of hf's."
    rows = record_logits(graphed)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
              for n in (12, 3, 9, 6, 1)]
    want = eager.generate(prompts, params, use_tqdm=False)
    got = graphed.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for prompt, out in zip(prompts, got):
        tokens = out.outputs[0].token_ids
        with torch.inference_mode():
            ref = hf(torch.tensor([prompt + tokens], device='cuda')).logits[0]    # [L, V]
        ref = ref[len(prompt) - 1:len(prompt) - 1 + len(tokens)]
        ours = torch.stack(rows[tuple(prompt)])
        assert (ours - ref).abs().max() <= 1e-4 * ref.abs().max()


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [1, 16])
def test_cuda_graphs_match_eager_and_transformers(tmp_path, block_size, record_logits):
    "fp32 on CUDA, triton backend: graph and eager tokens identical; logits within 1e-4 of HF's."
    hf = _hf_checkpoint(tmp_path, torch.float32)
    kw = dict(dtype='float32', device='cuda', attention_backend='triton', max_num_seqs=8,
              block_size=block_size, kv_cache_memory=2**26)
    eager, graphed = LLM(tmp_path, enforce_eager=True, **kw), LLM(tmp_path, **kw)
    assert graphed.engine.runner.cuda_graphs is not None
    assert eager.engine.runner.cuda_graphs is None
    _graphs_match_eager_and_hf(eager, graphed, hf, PROMPTS, record_logits)


def _hf_moe_checkpoint(path, dtype, shared):
    "A random Qwen3-MoE (Qwen2-MoE with its shared expert if shared) saved to path, on CUDA."
    torch.manual_seed(0)
    kw = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              initializer_range=0.2, eos_token_id=2, num_experts=8, num_experts_per_tok=2,
              moe_intermediate_size=32)
    cfg = (transformers.Qwen2MoeConfig(**kw, shared_expert_intermediate_size=48) if shared else
           transformers.Qwen3MoeConfig(**kw, head_dim=16, norm_topk_prob=True))
    hf = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation='eager')
    hf.to(dtype).save_pretrained(path)
    return hf.cuda().eval()


@pytest.mark.gpu
@pytest.mark.parametrize("shared", [False, True], ids=['qwen3-moe', 'qwen2-moe'])
def test_moe_cuda_graphs_match_eager_and_transformers(tmp_path, shared, record_logits):
    "fp32, triton backend: MoE decode steps captured; graph and eager tokens identical; HF logits."
    hf = _hf_moe_checkpoint(tmp_path, torch.float32, shared)
    kw = dict(dtype='float32', device='cuda', attention_backend='triton', max_num_seqs=8,
              block_size=16, kv_cache_memory=2**26)
    eager, graphed = LLM(tmp_path, enforce_eager=True, **kw), LLM(tmp_path, **kw)
    assert graphed.engine.runner.cuda_graphs is not None
    replays = []
    graphs = graphed.engine.runner.cuda_graphs.graphs
    for size, (replay, out) in list(graphs.items()):
        graphs[size] = (lambda r=replay, s=size: (replays.append(s), r())), out
    _graphs_match_eager_and_hf(eager, graphed, hf, PROMPTS, record_logits)
    assert replays                                       # the decode steps were replayed


@pytest.mark.gpu
def test_int8_moe_runs_eagerly_on_the_gpu():
    "int8 experts on the triton backend: no graph is recorded, and the tokens are the eager ones."
    model = _tiny(**MOE).cuda()
    quantize_model(model, 'int8')
    kw = dict(attention_backend='triton', kv_cache_memory=2**20, max_num_seqs=5)
    default, eager = LLMEngine(model, **kw), LLMEngine(model, enforce_eager=True, **kw)
    assert default.runner.cuda_graphs is None
    prompts, max_tokens = [[1, 2, 3, 4, 5], [7, 8, 9], [3] * 9], [8, 3, 5]
    assert _greedy_tokens(default, prompts, max_tokens) == _greedy_tokens(eager, prompts,
                                                                          max_tokens)
