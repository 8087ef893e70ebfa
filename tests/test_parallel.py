"""Tensor parallelism (chapter 20) on a CPU: gloo process groups of 2 and 3 ranks.

Random-weight checkpoints (Qwen3 with GQA, untied; Qwen2 with MQA and q/k/v biases, tied; Llama
with GQA, tied) written by transformers and run in float64, transformers' `generate` the oracle:
greedy tokens must equal it, and equal the same engine at tensor_parallel_size=1, through chunked
prefill, prefix hits and preemption; seeded sampling must equal tensor_parallel_size=1. Each
engine starts its worker processes once per module (a start costs seconds) and runs every
scenario of its model. Also: the refusals (before any process starts), a killed worker (between
steps and during one), a killed rank 0, a dropped engine, int8 and packed linears per shard (the
Q8_0 slices of a GGUF too), n-gram speculation, the command line on SmolLM2, and torchrun.
"""
import json
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import transformers

from petite_llm.model.config import ModelConfig
from petite_llm.engine.llm_engine import LLM
from petite_llm.model.layers.linear import packed_linear_available
from petite_llm.engine.paging import kv_bytes_per_block
from petite_llm.parallel.tensor_parallel import (RowParallelLinear, TensorParallelError,
                                                 check_tensor_parallel, shard_config,
                                                 tensor_parallel_sizes)
from petite_llm.model.sampling_params import SamplingParams

from test_parity import hf_greedy, make_checkpoint, prompts
from tp_ranks import lm_head_on_rank

VOCAB = 301          # not a multiple of 2 or 3: the last rank's vocabulary rows are padding
BASE = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, max_position_embeddings=512,
            rms_norm_eps=1e-6)
MODELS = {  # name: (model_type, ranks, config)
    'qwen3-gqa-untied': ('qwen3', 2, dict(num_attention_heads=4, num_key_value_heads=2,
                                          head_dim=16, intermediate_size=128,
                                          tie_word_embeddings=False)),
    'qwen2-mqa-tied':   ('qwen2', 3, dict(num_attention_heads=6, num_key_value_heads=1,
                                          intermediate_size=96, tie_word_embeddings=True)),
    'llama-gqa-tied':   ('llama', 2, dict(num_attention_heads=4, num_key_value_heads=2,
                                          intermediate_size=128, tie_word_embeddings=True)),
}
BLOCK = 4
LENGTHS = [1, 3, 9, 17, 30, 44]
SHARED = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]        # three blocks of a common prefix


def _checkpoint(tmp_path_factory, name):
    model_type, _, kw = MODELS[name]
    path = tmp_path_factory.mktemp(name)
    hf = make_checkpoint(path, model_type, seed=len(name), **BASE, **kw).double()
    # transformers saved float32 weights: the engine loads them as float64, as hf now runs
    return path, hf


def _engine(path, size, num_blocks):
    "An engine with small prefill chunks and num_blocks blocks (preemption when few) at any size."
    local = shard_config(ModelConfig.from_pretrained(path), size)    # kv_cache_memory: per rank
    pool = num_blocks * kv_bytes_per_block(local, BLOCK, torch.float64)
    return LLM(path, tensor_parallel_size=size, dtype='float64', device='cpu', block_size=BLOCK,
               max_num_batched_tokens=16, kv_cache_memory=pool)


def _greedy(llm, prompt_list, max_tokens=8):
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompt_list, sp, use_tqdm=False)]


def _seeded(llm, prompt_list):
    sps = [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, seed=i, ignore_eos=True)
           for i in range(len(prompt_list))]
    return [o.token_ids for o in llm.generate(prompt_list, sps, use_tqdm=False)]


def _prompt_set():
    "Prompts of mixed lengths, and three that share a prefix (prefix hits on their second run)."
    return prompts(VOCAB, LENGTHS) + [SHARED + p for p in prompts(VOCAB, [2, 5, 8], seed=1)]


@pytest.fixture(scope='module', params=list(MODELS))
def runs(request, tmp_path_factory):
    """One model's answers: transformers' greedy tokens, and the engine's greedy and seeded tokens
    at tensor_parallel_size=1 and at the model's ranks, on a pool small enough to preempt."""
    name = request.param
    path, hf = _checkpoint(tmp_path_factory, name)
    ranks, batch = MODELS[name][1], _prompt_set()
    answers = {'hf': [hf_greedy(hf, p, 8) for p in batch]}
    for size in (1, ranks):
        llm = _engine(path, size, num_blocks=24)          # 96 tokens: not every prompt at once
        try:
            answers[size] = dict(greedy=_greedy(llm, batch), seeded=_seeded(llm, batch),
                                 stats=llm.stats)
        finally:
            llm.shutdown()
    return name, ranks, answers


def test_greedy_matches_transformers_and_one_rank(runs):
    name, ranks, answers = runs
    for i, want in enumerate(answers['hf']):
        assert answers[ranks]['greedy'][i] == want, f"{name} prompt {i}: {ranks} ranks"
        assert answers[1]['greedy'][i] == want, f"{name} prompt {i}: 1 rank"


def test_chunks_prefix_hits_and_preemption_happened(runs):
    name, ranks, answers = runs
    stats = answers[ranks]['stats']
    assert stats.prefix_cache_hit_rate > 0 and stats.num_preemptions > 0
    assert stats.num_steps > sum(LENGTHS) // 16          # prompts went in chunks of 16 tokens


def test_seeded_sampling_equals_one_rank(runs):
    name, ranks, answers = runs
    assert answers[ranks]['seeded'] == answers[1]['seeded']
    assert answers[ranks]['seeded'] != answers[ranks]['greedy']     # it really sampled


def test_no_worker_outlives_shutdown(runs):
    assert multiprocessing.active_children() == []


def test_shard_configs_split_heads_and_replicate_kv_heads():
    config = ModelConfig(model_type='qwen3', vocab_size=VOCAB, hidden_size=64,
                         intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
                         num_key_value_heads=2, head_dim=16)
    local = shard_config(config, 3)
    assert (local.num_attention_heads, local.num_key_value_heads) == (2, 1)
    assert local.intermediate_size == 32 and local.vocab_size == VOCAB
    assert tensor_parallel_sizes(config) == [1, 2, 6]     # 3: 2 KV heads over 3 ranks
    with pytest.raises(ValueError, match=r"num_key_value_heads=2 .*sizes that split it: 1, 2, 6"):
        check_tensor_parallel(config, 3)


REFUSALS = [   # options, what the error must say
    (dict(tensor_parallel_size=3), r"num_attention_heads=4 is not a multiple of 3"),
    (dict(tensor_parallel_size=0), r"positive int"),
    (dict(tensor_parallel_size=2, async_scheduling=True), r"async_scheduling"),
    (dict(tensor_parallel_size=2, enable_torch_compile=True), r"enable_torch_compile"),
    (dict(tensor_parallel_size=2, speculative_config={'model': 'a-draft',
                                                      'num_speculative_tokens': 2}),
     r"a draft model: turn that off \(speculative method 'ngram' does run\)"),
]


@pytest.fixture(scope='module')
def small(tmp_path_factory):
    return _checkpoint(tmp_path_factory, 'qwen3-gqa-untied')[0]


@pytest.mark.parametrize('options,message', REFUSALS)
def test_refusals_come_before_any_process(small, options, message):
    with pytest.raises(ValueError, match=message):
        LLM(small, device='cpu', **options)
    assert multiprocessing.active_children() == []


def test_intermediate_size_must_divide(tmp_path):
    make_checkpoint(tmp_path, 'qwen3', **BASE, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16, intermediate_size=100)
    with pytest.raises(ValueError, match=r"intermediate_size=100 is not a multiple of 8"):
        LLM(tmp_path, tensor_parallel_size=8, device='cpu')   # heads 4 fail too; listed together


def test_more_ranks_than_gpus_or_no_backend(small, monkeypatch):
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: 1)
    monkeypatch.setattr(dist, 'is_nccl_available', lambda: True)
    # the validator reads the GPU's size for its batch defaults
    one_gpu = type('Props', (), {'total_memory': 80 * 2**30, 'name': 'a GPU'})
    monkeypatch.setattr(torch.cuda, 'get_device_properties', lambda device: one_gpu)
    with pytest.raises(ValueError, match=r"needs 2 GPUs, and torch sees 1"):
        LLM(small, tensor_parallel_size=2, device='cuda')
    monkeypatch.setattr(dist, 'is_gloo_available', lambda: False)
    with pytest.raises(ValueError, match=r"needs torch.distributed with gloo"):
        LLM(small, tensor_parallel_size=2, device='cpu')
    assert multiprocessing.active_children() == []


def test_one_process_group_per_process(small):
    dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match=r"already belongs to a process group"):
            LLM(small, tensor_parallel_size=2, device='cpu')
    finally:
        dist.destroy_process_group()


def test_a_built_model_is_refused(small):
    from petite_llm.model.weights import load_model
    with pytest.raises(ValueError, match=r"pass the model's path"):
        LLM(load_model(small), tensor_parallel_size=2)


def _within(seconds, fn, *args):
    "fn(*args) in a thread, waited for at most `seconds`: a hang fails instead of blocking CI."
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(fn, *args).result(timeout=seconds)


def test_a_killed_worker_is_a_clear_error(small):
    llm = _engine(small, 2, num_blocks=64)
    try:
        assert _greedy(llm, [[5, 6, 7]]) == _greedy(llm, [[5, 6, 7]])
        worker = multiprocessing.active_children()[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        with pytest.raises(TensorParallelError, match=r"rank 1 \(pid \d+\) exited with code -9"):
            _within(30, _greedy, llm, [[5, 6, 7]])
    finally:
        _within(30, llm.shutdown)
    assert multiprocessing.active_children() == []


def test_a_worker_killed_during_a_step_is_a_clear_error(small):
    "Killed while rank 0 waits in an all-reduce: gloo reports the closed connection at once."
    llm = _engine(small, 2, num_blocks=256)
    try:
        worker = multiprocessing.active_children()[0]
        long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(llm.generate, prompts(VOCAB, [30] * 8), long, use_tqdm=False)
            time.sleep(1.0)                   # steps are under way
            os.kill(worker.pid, signal.SIGKILL)
            with pytest.raises(TensorParallelError, match=r"another rank died|exited with code"):
                running.result(timeout=30)
    finally:
        _within(30, llm.shutdown)
    assert multiprocessing.active_children() == []


RANK0_DIES = """
import os, sys
from petite_llm.engine.llm_engine import LLM
if __name__ == '__main__':      # the workers are spawned: they import this file, not run it
    llm = LLM(sys.argv[1], tensor_parallel_size=2, device='cpu', kv_cache_memory=2**20)
    print(os.getpid(), *[p.pid for p in llm.engine.runner.workers.processes], flush=True)
    os._exit(1)          # no shutdown, no atexit: the worker must notice on its own
"""


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by init) counts as gone
    return Path(f'/proc/{pid}/stat').read_text().split()[2] != 'Z'


def test_workers_exit_when_rank_0_dies(small, tmp_path):
    script = tmp_path/'rank0.py'
    script.write_text(RANK0_DIES)
    out = subprocess.run([sys.executable, str(script), str(small)], capture_output=True,
                         text=True, timeout=120)
    worker = int(out.stdout.split()[1])
    deadline = time.monotonic() + 30
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(worker), f"worker {worker} outlived rank 0"


TORCHRUN = """
import json, sys
from petite_llm.engine.llm_engine import LLM
from petite_llm.model.sampling_params import SamplingParams
# every rank runs this script; on ranks other than 0, LLM() serves rank 0 and then exits
llm = LLM(sys.argv[1], tensor_parallel_size=2, device='cpu', dtype='float64',
          kv_cache_memory=2**20)
sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
outputs = llm.generate(json.loads(sys.argv[2]), sp, use_tqdm=False)
json.dump([o.token_ids for o in outputs], open(sys.argv[3], 'w'))
llm.shutdown()
"""


def test_torchrun_runs_the_same_code(tmp_path, tmp_path_factory):
    "Two processes started by torchrun (env rendezvous, as across machines) answer as transformers."
    path, hf = _checkpoint(tmp_path_factory, 'llama-gqa-tied')
    batch = prompts(VOCAB, [4, 11])
    script, result = tmp_path/'tp.py', tmp_path/'out.json'
    script.write_text(TORCHRUN)
    subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--nproc-per-node', '2',
                    '--standalone', str(script), str(path), json.dumps(batch), str(result)],
                   check=True, timeout=180, capture_output=True)
    assert json.loads(result.read_text()) == [hf_greedy(hf, p, 6) for p in batch]


@pytest.mark.parametrize('quantization,dtype,linear', [
    ('int8', 'float32', 'Int8Linear'),
    pytest.param(None, 'bfloat16', 'PackedLinear', marks=pytest.mark.skipif(
        not packed_linear_available(torch.bfloat16), reason="no oneDNN bfloat16 on this CPU")),
])
def test_int8_and_packed_linears_per_shard(small, record_logits, quantization, dtype, linear):
    "int8 and oneDNN-packed bf16 linears are built on each rank's slices; logits stay close."
    batch = prompts(VOCAB, [5, 12, 20], seed=2)
    first = SamplingParams(temperature=0, max_tokens=1)
    logits = {}
    for size, options in ((1, dict(dtype='float32')), (2, dict(dtype=dtype,
                                                                quantization=quantization))):
        llm = LLM(small, tensor_parallel_size=size, device='cpu', kv_cache_memory=2**22, **options)
        rows = record_logits(llm)
        llm.generate(batch, first, use_tqdm=False)
        logits[size] = torch.stack([rows[tuple(p)][0].float() for p in batch])    # [3, V]
        if size == 2:
            o_proj = llm.engine.model.model.layers[0].self_attn.o_proj
            assert isinstance(o_proj, RowParallelLinear)
            assert type(o_proj.linear).__name__ == linear
        llm.shutdown()
    error = (logits[2] - logits[1]).abs().max() / logits[1].abs().max()
    assert error < 0.05, f"{linear} on 2 ranks is {error:.3f} of max|logit| from float32 on 1"


def test_cli_names_the_sizes_that_split_smollm2():
    "The default model (9 heads, 3 KV heads) does not split in 2: the error says which sizes do."
    from test_cli import run
    code, out, err = run(['generate', '--tensor-parallel-size', '2', '--max-tokens', '4', 'Hi'])
    assert code == 1 and out == ''
    assert "num_attention_heads=9 is not a multiple of 2" in err
    assert "The sizes that split it: 1, 3" in err
    assert multiprocessing.active_children() == []


@pytest.mark.slow
def test_cli_answers_on_three_ranks():
    "petite-llm generate on SmolLM2 over 3 CPU processes: the same greedy text as one process."
    argv = ['generate', '--chat', '--temperature', '0', '--max-tokens', '16',
            'What is the capital of France?']
    script = 'import sys; from petite_llm.cli.main import main; sys.exit(main())'
    texts = [subprocess.run([sys.executable, '-c', script, *argv, *extra],
                            capture_output=True, text=True, timeout=600, check=True).stdout
             for extra in ([], ['--tensor-parallel-size', '3'])]
    assert 'Paris' in texts[1] and texts[1] == texts[0]


def test_ngram_speculation_verifies_across_ranks(small):
    "Drafts from the prompt's own n-grams, verified by two ranks: transformers' greedy tokens."
    hf = transformers.Qwen3ForCausalLM.from_pretrained(small).double().eval()
    batch = [p * 3 for p in prompts(VOCAB, [4, 6, 9], seed=3)]      # repeats: n-grams to draft
    llm = LLM(small, tensor_parallel_size=2, dtype='float64', device='cpu', kv_cache_memory=2**22,
              speculative_config={'method': 'ngram', 'num_speculative_tokens': 3,
                                  'prompt_lookup_max': 3})
    try:
        assert _greedy(llm, batch, max_tokens=10) == [hf_greedy(hf, p, 10) for p in batch]
        assert llm.engine.spec_stats.num_draft_tokens > 0
    finally:
        llm.shutdown()


def test_a_dropped_engine_takes_its_workers(small, caplog):
    import gc
    # no no-tokenizer warning: a captured record's exception would hold the loading frames alive
    with caplog.at_level(logging.ERROR, logger='petite_llm.engine'):
        llm = _engine(small, 2, num_blocks=16)
    workers = multiprocessing.active_children()
    assert len(workers) == 1
    del llm
    gc.collect()
    assert multiprocessing.active_children() == [] and not workers[0].is_alive()


def test_int8_slices_keep_their_scales():
    "A row-parallel slice keeps every row's scale; a column-parallel or vocabulary one its rows'."
    from petite_llm.parallel.tensor_parallel import shard_int8
    config = ModelConfig(model_type='llama', vocab_size=5, hidden_size=8, intermediate_size=8,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=4)
    q = torch.arange(8 * 8, dtype=torch.int8).view(8, 8)
    scale = torch.arange(8.0)
    down, down_scale = shard_int8('model.layers.0.mlp.down_proj.weight', q, scale, config, 1, 2)
    assert torch.equal(down, q[:, 4:]) and torch.equal(down_scale, scale)
    up, up_scale = shard_int8('model.layers.0.mlp.up_proj.weight', q, scale, config, 1, 2)
    assert torch.equal(up, q[4:]) and torch.equal(up_scale, scale[4:])
    head, head_scale = shard_int8('lm_head.weight', q[:5], scale[:5], config, 1, 2)
    assert torch.equal(head[:2], q[3:5]) and head[2:].abs().sum() == 0     # padding rows
    assert torch.equal(head_scale, torch.tensor([3.0, 4.0, 0.0]))


@pytest.mark.slow
def test_smollm2_int8_over_three_ranks_reads_q8_0_slices(caplog, record_logits):
    "SmolLM2's Q8_0 head, sliced by vocabulary over 3 ranks: the first step's logits match 1 rank."
    from petite_llm.model.weights import smollm2_gguf_path
    batch = [[1, 504, 3458, 28, 1064], [9, 2135]]
    first = SamplingParams(temperature=0, max_tokens=1)
    logits = {}
    for size in (1, 3):
        with caplog.at_level(logging.INFO, logger='petite_llm.engine'):
            llm = LLM(smollm2_gguf_path(), tensor_parallel_size=size, quantization='int8',
                      dtype='float32', device='cpu', kv_cache_memory=2**24)
        rows = record_logits(llm)
        llm.generate(batch, first, use_tqdm=False)
        logits[size] = torch.stack([rows[tuple(p)][0] for p in batch])
        llm.shutdown()
    assert "rank 0: 1 matrices read from Q8_0 blocks" in caplog.text
    error = (logits[3] - logits[1]).abs().max() / logits[1].abs().max()
    assert error < 0.05, f"int8 on 3 ranks is {error:.3f} of max|logit| from int8 on 1"


def test_an_engine_of_a_built_model_refuses_ranks(small):
    from petite_llm.engine.llm_engine import LLMEngine
    from petite_llm.model.weights import load_model
    with pytest.raises(ValueError, match=r"tensor_parallel_size apply when the engine loads"):
        LLMEngine(load_model(small), tensor_parallel_size=2)


def test_a_worker_runs_rank_0s_step_method(small, monkeypatch):
    "Rank 0 and a worker build their runners with one factory and run each step by one method."
    from petite_llm.engine.runner import ModelRunner
    from petite_llm.parallel import worker

    class Workers:
        "Rank 0's view of the workers: it keeps each step it would broadcast."
        sent = []

        def broadcast_step(self, step):
            self.sent.append(step)
    calls, execute = [], ModelRunner.execute

    def spy(runner, step, *args):
        logits = execute(runner, step, *args)
        calls.append((runner, step, logits))
        return logits
    monkeypatch.setattr(ModelRunner, 'execute', spy)
    llm = LLM(small, kv_cache_memory=1 << 20, max_num_batched_tokens=8)
    rank0 = llm.engine.runner
    rank0.workers = Workers()
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([[5, 6, 7, 8, 9, 10, 11], [12, 13]], params, use_tqdm=False)
    # a worker on the same weights and config, built by rank_runner, fed rank 0's steps, stopped
    runner = worker.rank_runner(llm.engine.model, llm.engine.config)
    steps = iter(Workers.sent + [None])
    monkeypatch.setattr(worker, 'receive_step', lambda control: next(steps))
    assert worker.serve_steps(runner, None, rank=1) == len(Workers.sent) > 2
    ours = [(step, logits) for r, step, logits in calls if r is rank0]
    theirs = [(step, logits) for r, step, logits in calls if r is runner]
    assert [s for s, _ in ours] == [s for s, _ in theirs] == Workers.sent
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(ours, theirs))


def test_only_rank_0_receives_the_logits(tmp_path):
    "The head's slices are gathered on rank 0, which alone samples: a worker gets no logits."
    torch.multiprocessing.spawn(lm_head_on_rank, args=(3, str(tmp_path / 'init'), str(tmp_path)),
                                nprocs=3, join=True)
    results = [torch.load(tmp_path / f'{rank}.pt') for rank in range(3)]
    assert results[1]['got'] is None and results[2]['got'] is None
    torch.testing.assert_close(results[0]['got'], results[0]['want'])      # [3, 10]
