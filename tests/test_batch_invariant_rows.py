"""Batch invariance row by row (chapter 21), on any machine: each component of the mode's path
computes a row alone (R = 1) to the same bits as the same row among R = 2, 3, 7 and 32 others,
for several head layouts and on one and two threads; and every matrix product and reduction in
the mode is handed tensors of the same layout (contiguity, order of strides) at R = 1 as at R > 1,
which is what decides the kernel a library picks, whatever the CPU or GPU.
"""
import random

import pytest
import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import torch_threads

from petite_llm.engine.backends import AttentionMetadata
from petite_llm.engine.batch_invariant import BatchInvariantAttention, BatchInvariantLinear
from petite_llm.engine.llm_engine import LLM
from petite_llm.model.layers.linear import PackedLinear, packed_linear_available
from petite_llm.model.layers.norm import RMSNorm
from petite_llm.model.layers.rope import RotaryEmbedding
from petite_llm.model.quantization import Int8Linear
from petite_llm.model.sampling import Sampler
from petite_llm.model.sampling_params import SamplingParams

BATCHES = [2, 3, 7, 32]
# (query heads, KV heads, head_dim): MQA, GQA of 2, 3 and 8 KV heads; head_dim 32, 64, 128
LAYOUTS = [(4, 1, 32), (8, 2, 64), (6, 3, 64), (16, 8, 128), (9, 3, 128)]
# the ops whose kernel can follow the layout or the size of a call: products and reductions
WATCHED = {'mm', 'bmm', 'addmm', 'baddbmm', 'addmv', 'mv', 'dot', 'matmul', 'linear', 'sum',
           'mean', 'amax', 'amin', 'max', 'min', 'softmax', '_softmax', '_log_softmax', 'cumsum',
           'logsumexp', 'var', 'norm', 'linalg_vector_norm', 'prod', '_weight_int8pack_mm',
           '_linear_pointwise', 'mkldnn_linear', 'argmax', 'sort', 'topk'}


@pytest.fixture(params=[1, 2], ids=lambda n: f"{n}thread")
def threads(request):
    "Run the test on one and on two torch threads."
    with torch_threads(request.param):
        yield request.param


def _layout(t: torch.Tensor) -> tuple:
    "What a kernel sees of a tensor beyond its sizes: dtype, rank, contiguity, its unit-stride dim."
    unit = [d for d in range(t.dim()) if t.stride(d) == 1 and t.shape[d] > 1]
    return t.dtype, t.dim(), t.is_contiguous(), tuple(unit)


class LayoutLog(TorchDispatchMode):
    "Records each watched op's name and the layout of every tensor handed to it."
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split('.')[0]
        if name in WATCHED:
            tensors = [a for a in torch.utils._pytree.tree_leaves((args, kwargs or {}))
                       if isinstance(a, torch.Tensor)]
            self.calls.append((name, *map(_layout, tensors)))
        return func(*args, **(kwargs or {}))


def _layouts(fn, *args) -> set:
    "The watched calls of fn(*args), with their tensors' layouts (a tiled call counts once)."
    with LayoutLog() as log:
        fn(*args)
    return set(log.calls)


def _rows_equal(fn, inputs: torch.Tensor, batches=BATCHES):
    "fn on row 0 alone and among each batch size: the same bits, and the same layouts."
    alone = fn(inputs[:1])
    seen = _layouts(fn, inputs[:1])
    for r in batches:
        assert torch.equal(fn(inputs[:r])[:1], alone), f"row 0 differs among {r} rows"
        assert _layouts(fn, inputs[:r]) == seen, f"layouts at R = {r} differ from R = 1"


def _block_tables(context_lens: list[int], block_size: int, seed: int) -> list[list[int]]:
    "Each sequence's blocks, drawn from one shuffled pool."
    ids = list(range(sum(-(-n // block_size) for n in context_lens)))
    random.Random(seed).shuffle(ids)
    tables = []
    for n in context_lens:
        tables.append(ids[:-(-n // block_size)])
        ids = ids[len(tables[-1]):]
    return tables


@pytest.mark.parametrize("nh,nkv,hd", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attention_decode_row(threads, nh, nkv, hd, dtype):
    "A decode row of BatchInvariantAttention alone and among 2 to 32 other decodes."
    torch.manual_seed(nkv * hd)
    block_size, max_r = 16, max(BATCHES)
    lens = [70] + [random.Random(i).randrange(1, 150) for i in range(max_r - 1)]
    tables = _block_tables(lens, block_size, nkv)
    num_blocks = sum(map(len, tables))
    cache = [torch.randn(num_blocks, block_size, nkv, hd, dtype=dtype) for _ in range(2)]
    q = torch.randn(max_r, nh, hd, dtype=dtype)
    k, v = torch.randn(2, max_r, nkv, hd, dtype=dtype)
    backend = BatchInvariantAttention()

    def attend(q_rows):
        r = q_rows.shape[0]
        md = AttentionMetadata.build(tables[:r], [n - 1 for n in lens[:r]], [1] * r,
                                     block_size, None, backend)      # one new token each
        return backend.forward(q_rows, k[:r], v[:r], [c.clone() for c in cache], md, hd ** -0.5)
    _rows_equal(attend, q)


@pytest.mark.parametrize("kind", ["linear", "packed", "int8"])
def test_linear_row(threads, kind):
    "BatchInvariantLinear over nn.Linear, oneDNN-packed bf16 and int8, at the CPU's tile."
    torch.manual_seed(0)
    linear = torch.nn.Linear(576, 1536, bias=False, dtype=torch.bfloat16)
    if kind == "packed":
        if not packed_linear_available(torch.bfloat16):
            pytest.skip("this torch has no oneDNN-packed bf16 linear")
        linear = PackedLinear(linear.weight.data)
    elif kind == "int8":
        linear = Int8Linear.from_linear(linear)
    wrapped = BatchInvariantLinear(linear, 1)
    x = torch.randn(32, 576, dtype=torch.bfloat16)
    with torch.no_grad():
        _rows_equal(wrapped, x)


def test_rms_norm_and_rope_rows(threads):
    "RMSNorm over a row's channels and RoPE of a row's heads: alone as among others."
    torch.manual_seed(0)
    for hidden in (576, 4096):
        norm = RMSNorm(hidden).to(torch.bfloat16)
        with torch.no_grad():
            _rows_equal(norm, torch.randn(32, hidden, dtype=torch.bfloat16))
    rope = RotaryEmbedding(64, 1e6, 4096)
    positions = torch.randint(0, 4096, (32,))
    qk = torch.randn(32, 6, 64, dtype=torch.bfloat16)
    _rows_equal(lambda x: rope(positions[:x.shape[0]], x, x)[0], qk)


@pytest.mark.parametrize("vocab", [1000, 49152])
@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_sampler_rows(threads, vocab, seeded):
    "Greedy or seeded top-p draws and logprobs of a row, alone and among others (long rows too)."
    torch.manual_seed(0)
    logits = torch.randn(32, vocab) * 4
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=i, logprobs=3) if seeded else
              SamplingParams(temperature=0, logprobs=3) for i in range(32)]
    sampler = Sampler()

    def sample(rows):
        "Row 0's token, then its logprobs: [1, 1 + 4]."
        r = rows.shape[0]
        out = sampler(rows, params[:r], [[5]] * r, [[]] * r)
        return torch.tensor([[out.token_ids[0], *out.logprobs[0].values()]], dtype=torch.float64)
    _rows_equal(sample, logits)


def test_the_audit_sees_a_view_against_a_copy():
    "The layout audit tells a transposed view (R = 1) from a contiguous copy (R = 2)."
    keys = torch.randn(2, 64, 3, 32)                                  # [R, S, nkv, hd]

    def scores(k):
        return torch.bmm(torch.randn(3 * k.shape[0], 2, 32),
                         k.permute(0, 2, 3, 1).reshape(3 * k.shape[0], 32, -1))
    assert _layouts(scores, keys[:1]) != _layouts(scores, keys)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_engine_layouts(tmp_path, backend):
    "A whole engine step in the mode: the same layouts for one request as for five together."
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=300, hidden_size=96, intermediate_size=192, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=3, head_dim=32, max_position_embeddings=256,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    transformers.Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path)
    llm = LLM(tmp_path, dtype='bfloat16', kv_cache_memory=2**22, block_size=4,
              attention_backend=backend, batch_invariant=True, enable_prefix_caching=False)
    prompts = [[5 + i] * (3 + 4 * i) for i in range(5)]
    params = SamplingParams(temperature=0.7, seed=3, max_tokens=3, ignore_eos=True, logprobs=2)
    alone = _layouts(lambda: llm.generate(prompts[:1], params, use_tqdm=False))
    assert alone == _layouts(lambda: llm.generate(prompts, params, use_tqdm=False))
