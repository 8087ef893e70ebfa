"""Shared pytest setup: the `slow`, `gpu` and `cpu_paths` markers, Triton's interpreter on a
CPU, the longest files first, and the one-thread fixture for modules of tiny models."""
import contextlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels have no CPU compiler: run them in the interpreter (set before they are defined)
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long tests, run by `make test-slow`")
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; skipped without one")
    config.addinivalue_line("markers", "cpu_paths: takes a CPU-specific path; make test also "
                                       "runs it on an emulated AVX2 CPU (tools/avx2_stage.py)")


# The files that take longest on two CPU cores (pytest --durations=0), longest first: `make test`
# hands whole files to its two workers in collection order (`--dist loadfile
# --no-loadscope-reorder`), and a long file started last would leave one worker running it alone.
LONGEST_FIRST = ['test_kernels.py', 'test_parallel.py', 'test_fused_moe.py',
                 'test_server_structured.py', 'test_engine.py', 'test_gguf.py',
                 'test_speculative.py', 'test_cli.py', 'test_cuda_graphs.py',
                 'test_server_limits.py', 'test_server_invariance.py', 'test_structured.py',
                 'test_bench.py', 'test_batch_invariant_smollm2.py', 'test_bench_serve.py',
                 'test_bench_host.py', 'test_server_soak.py']


def pytest_collection_modifyitems(config, items):
    "The longest files first; skip the gpu-marked tests where there is no CUDA GPU, saying so."
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))     # stable: files stay whole
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@contextlib.contextmanager
def torch_threads(n: int):
    "torch on n threads inside, on as many as before after."
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def one_thread():
    "Tiny models: one thread beats two, by far on a busy machine (no OpenMP barriers)."
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def two_threads():
    "Two threads, whatever an earlier module chose (the acceptance setting of batch invariance)."
    with torch_threads(2):
        yield


@pytest.fixture
def record_logits():
    "record(llm) makes llm keep each sampled row's logits: {prompt token ids: [row per step]}."
    def record(llm):
        rows, resolve = {}, llm.engine.runner.resolve

        def recording_resolve(step):         # every step, serial or async, is resolved once
            out = resolve(step)
            for seq, row in zip(out.seqs, out.logits):
                rows.setdefault(tuple(seq.prompt_token_ids), []).append(row.clone())
            return out
        llm.engine.runner.resolve = recording_resolve
        return rows
    return record
