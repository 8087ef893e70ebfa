"""The paged KV cache: pool sizing, the block manager's prefix cache, and the torch attention
backend against `causal_attention` (the reference of chapter 03) and the model's no-cache path."""
import random
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, strategies as st

from petite_llm.model.layers.attention import causal_attention
from petite_llm.model.kv_cache import kv_bytes_per_token
from petite_llm.engine.backends import AttentionMetadata, TorchAttentionBackend, group_by_length
from petite_llm.engine.paging import (BlockManager, allocate_kv_cache, cdiv, check_block_accounting,
                               hash_block, kv_bytes_per_block, num_kv_blocks)
import petite_llm.engine.paging as paging


class Seq:
    "What the block manager reads and writes of a sequence."
    def __init__(self, token_ids):
        self.token_ids = list(token_ids)
        self.num_computed_tokens = 0
        self.block_table = []
        self.lora_id = 0                  # the base model (chapter 24)


def test_pool_sizing():
    cfg = SimpleNamespace(num_hidden_layers=28, num_key_value_heads=8, head_dim=128)
    assert kv_bytes_per_block(cfg, 16, torch.bfloat16) == 2 * 28 * 16 * 8 * 128 * 2
    bf16_block = kv_bytes_per_block(cfg, 16, torch.bfloat16)
    assert bf16_block == 16 * kv_bytes_per_token(cfg, torch.bfloat16)
    assert kv_bytes_per_block(cfg, 16, torch.float32) == 2 * bf16_block
    assert num_kv_blocks(cfg, 16, 10 * bf16_block + 5, torch.bfloat16) == 10
    draft = SimpleNamespace(num_hidden_layers=2, num_key_value_heads=8, head_dim=128)
    assert kv_bytes_per_block([cfg, draft], 16, torch.bfloat16) == 2 * 30 * 16 * 8 * 128 * 2
    with pytest.raises(ValueError, match="kv_cache_memory"):
        num_kv_blocks(cfg, 16, 1000, torch.bfloat16)


def tiny_config(**kw):
    from petite_llm.model.config import ModelConfig
    d = dict(model_type='qwen3', vocab_size=97, hidden_size=64, intermediate_size=96,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
             rope_theta=1e6)
    d.update(kw)
    return ModelConfig(**d)


def test_allocate_kv_cache_on_the_model():
    from petite_llm.model.qwen3 import Qwen3ForCausalLM
    model = Qwen3ForCausalLM(tiny_config(num_hidden_layers=3)).to(torch.float64)
    caches = allocate_kv_cache(model, num_blocks=7, block_size=4)
    layers = [l.self_attn for l in model.model.layers]
    assert len(caches) == 3 and all(a.kv_cache is c for a, c in zip(layers, caches))
    k, v = caches[0]
    assert k.shape == v.shape == (7, 4, 2, 24) and k.dtype == torch.float64 and not k.any()
    assert k.data_ptr() != v.data_ptr()


def test_prefix_cache_hits_are_verified(monkeypatch):
    "Even when every block hashes to the same key, a lookup never returns a block of other tokens."
    monkeypatch.setattr(paging, 'hash_block', lambda parent, toks: 42)
    bm = BlockManager(8, 2)
    a = Seq([1, 2, 3, 4, 5])
    bm.allocate(a)
    a.num_computed_tokens = 5
    bm.commit(a)
    b = Seq([9, 9, 3, 4, 5])
    assert bm.allocate(b) == 0 and not set(b.block_table) & set(a.block_table)
    c = Seq([1, 2, 7, 7, 7])
    assert bm.allocate(c) == 2 and c.block_table[0] == a.block_table[0]


def test_hash_chain_depends_on_the_whole_prefix():
    bm = BlockManager(16, 2)
    a = Seq([1, 2, 3, 4, 0])
    bm.allocate(a)
    a.num_computed_tokens = 5
    bm.commit(a)
    b = Seq([5, 6, 3, 4, 0])                          # same second block, different first block
    assert bm.allocate(b) == 0
    assert hash_block(None, [3, 4]) != hash_block(hash_block(None, [1, 2]), [3, 4])


def test_full_prefix_hit_keeps_one_block_to_compute():
    for bs in (1, 2, 4):
        bm = BlockManager(32, bs)
        a = Seq(range(8))
        bm.allocate(a)
        a.num_computed_tokens = 8
        bm.commit(a)
        b = Seq(range(8))
        assert bm.allocate(b) == (7 // bs) * bs < 8
        # the recomputed block is private: nobody reads it while it is written
        assert b.block_table[-1] not in a.block_table


def test_disabled_prefix_cache_never_hits():
    bm = BlockManager(8, 2, enable_prefix_caching=False)
    a = Seq(range(6))
    bm.allocate(a)
    a.num_computed_tokens = 6
    bm.commit(a)
    assert bm.allocate(Seq(range(6))) == 0 and not bm.cached


def test_commit_hashes_only_computed_full_blocks():
    bm = BlockManager(8, 4)
    a = Seq(range(10))
    bm.allocate(a)
    a.num_computed_tokens = 7
    bm.commit(a)
    assert [bm.blocks[b].hash is not None for b in a.block_table] == [True, False, False]
    a.num_computed_tokens = 10
    bm.commit(a)
    assert [bm.blocks[b].hash is not None for b in a.block_table] == [True, True, False]


def test_lru_order_and_blank_blocks_first():
    bm = BlockManager(4, 1)
    seqs = [Seq([i, 100]) for i in range(2)]          # each: 1 hashed block + 1 unhashed
    for s in seqs:
        bm.allocate(s)
        s.num_computed_tokens = 1
        bm.commit(s)
    for s in seqs:
        bm.free(s)
    x = Seq([7, 7])
    bm.allocate(x)                                    # two blank (unhashed) blocks go first
    assert {bm.blocks[b].hash for b in x.block_table} == {None} and len(bm.cached) == 2
    y = Seq([8])
    bm.allocate(y)                         # evicts seq 0's block (freed first), keeps seq 1's
    bm.free(x)
    assert len(bm.cached) == 1 and bm.allocate(Seq([1, 5])) == 1
    assert bm._lookup(Seq([0, 5])) == []


def test_append_and_commit():
    bm = BlockManager(8, 4)
    a = Seq(range(5))
    bm.allocate(a)
    a.num_computed_tokens = 5
    assert bm.can_append(a, 4) and len(a.block_table) == 2
    bm.append_slots(a, 4)
    assert len(a.block_table) == 3                                 # tokens 5..8 need a third block
    a.num_computed_tokens = 9
    a.token_ids += [1, 2, 3, 4]
    bm.commit(a)
    assert bm.blocks[a.block_table[1]].hash is not None
    assert bm.blocks[a.block_table[2]].hash is None                # 1 of 4 tokens: not full
    assert bm.num_used_blocks == 3
    check_block_accounting(bm, [a])
    assert not bm.can_append(Seq([]), 4 * 7)


# ---------------------------------------------------------------- attention over the paged cache

def qkv(T, nh, nkv, hd, g, dtype):
    r = lambda n: torch.randn(T, n, hd, generator=g, dtype=dtype)
    return r(nh), r(nkv), r(nkv)


def run_paged(seqs, steps, bs, nh, nkv, hd, dtype, seed=0, max_padding=None):
    "Each sequence's q/k/v through the paged backend in `steps` [(seq, n new)...]; outputs per seq."
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(cdiv(len(q), bs) for q, _, _ in seqs) + 3
    k_cache = torch.zeros(num_blocks, bs, nkv, hd, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[perm.pop() for _ in range(cdiv(len(q), bs))] for q, _, _ in seqs]
    done, outs = [0] * len(seqs), [[] for _ in seqs]
    backend = TorchAttentionBackend(max_padding)
    for step in steps:
        md = AttentionMetadata.build([tables[i] for i, _ in step], [done[i] for i, _ in step],
                                     [n for _, n in step], bs, 'cpu', backend)
        q, k, v = (torch.cat([seqs[i][j][done[i]:done[i] + n] for i, n in step]) for j in range(3))
        o = backend.forward(q, k, v, (k_cache, v_cache), md, hd ** -0.5)
        assert o.shape == (md.query_start_loc_cpu[-1], nh, hd)
        for (i, n), start in zip(step, md.query_start_loc_cpu):
            outs[i].append(o[start:start + n])
            done[i] += n
    return [torch.cat(o) for o in outs]


def random_steps(rng, lens, budget):
    "A random schedule: each step, unfinished sequences advance by 1 or a chunk; decodes first."
    done, steps = [0] * len(lens), []
    while any(d < n for d, n in zip(done, lens)):
        step = []
        for i in rng.sample(range(len(lens)), len(lens)):
            if done[i] < lens[i] and rng.random() < 0.8:
                n = min(lens[i] - done[i], rng.choice([1, 1, rng.randint(1, budget)]))
                step.append((i, n))
                done[i] += n
        if step:
            steps.append(sorted(step, key=lambda e: e[1] != 1))
    return steps


@pytest.mark.parametrize("bs", [1, 4, 16])
@pytest.mark.parametrize("nh,nkv", [(4, 4), (6, 2), (4, 1)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
# one padded call (a GPU's default), groups of near-equal length (a CPU's), one per length
@pytest.mark.parametrize("max_padding", [0.0, 0.25, 1.0])
def test_backend_matches_causal_attention(bs, nh, nkv, dtype, max_padding):
    rng = random.Random(bs * 100 + nh * 10 + nkv)
    g, hd = torch.Generator().manual_seed(bs + nh + nkv), 8
    for trial in range(2):
        lens = [rng.randint(1, 40) for _ in range(rng.randint(1, 5))]
        seqs = [qkv(T, nh, nkv, hd, g, dtype) for T in lens]
        outs = run_paged(seqs, random_steps(rng, lens, 12), bs, nh, nkv, hd, dtype, seed=trial,
                         max_padding=max_padding)
        for (q, k, v), o in zip(seqs, outs):
            torch.testing.assert_close(o, causal_attention(q, k, v, hd ** -0.5))


def test_metadata_fields():
    backend = TorchAttentionBackend()
    md = AttentionMetadata.build([[3, 1], [0], [2, 4, 5]], [5, 0, 4], [1, 3, 6], 4, 'cpu', backend)
    assert md.num_single_token == 1 and md.backend is backend
    assert md.slot_mapping.tolist() == [1 * 4 + 1, 0, 1, 2, 16, 17, 18, 19, 20, 21]
    assert md.positions.tolist() == [5, 0, 1, 2, 4, 5, 6, 7, 8, 9]
    assert md.context_lens.tolist() == md.context_lens_cpu == [6, 3, 10]
    assert md.query_start_loc.tolist() == md.query_start_loc_cpu == [0, 1, 4, 10]
    assert md.block_tables.tolist() == [[3, 1, 0], [0, 0, 0], [2, 4, 5]]
    assert md.block_tables.dtype == torch.int32 and md.slot_mapping.dtype == torch.long
    with pytest.raises(ValueError, match="cannot hold"):
        AttentionMetadata.build([[0]], [3], [2], 4, 'cpu', backend)


@pytest.mark.parametrize("max_padding", [0.0, 0.25, 1.0])
def test_padding_slots_are_skipped(max_padding):
    g = torch.Generator().manual_seed(0)
    kc = torch.randn(3, 2, 1, 4, generator=g, dtype=torch.float64)
    vc = kc.clone()
    before = kc.clone()
    be = TorchAttentionBackend(max_padding)
    md = AttentionMetadata.build([[1], [0], [2]], [0, 0, 0], [1, 1, 1], 2, 'cpu', be)
    md.context_lens_cpu = [1, 0, 0]
    md.slot_mapping[1:] = -1
    md.context_lens[1:] = 0
    q, k, v = qkv(3, 2, 1, 4, g, torch.float64)
    out = md.backend.forward(q, k, v, (kc, vc), md, 0.5)
    assert torch.equal(kc[[0, 2]], before[[0, 2]]) and torch.equal(kc[1, 0], k[0])
    assert torch.isfinite(out).all()
    # a batch of nothing but padding
    md = AttentionMetadata.build([[0], [2]], [0, 0], [1, 1], 2, 'cpu', be)
    md.slot_mapping[:] = -1
    md.context_lens[:] = 0
    md.context_lens_cpu = [0, 0]
    assert torch.isfinite(md.backend.forward(q[:2], k[:2], v[:2], (kc, vc), md, 0.5)).all()


@pytest.mark.parametrize("bs", [1, 4, 16])
@pytest.mark.parametrize("nkv", [1, 2])
def test_model_paged_matches_reference_path(bs, nkv):
    "Chunked prefills and decodes of several sequences in mixed batches = the no-cache reference."
    from petite_llm.model.qwen3 import Qwen3ForCausalLM
    torch.manual_seed(bs + nkv)
    model = Qwen3ForCausalLM(tiny_config(num_key_value_heads=nkv)).to(torch.float64).eval()
    rng = random.Random(bs)
    lens = [rng.randint(1, 30) for _ in range(4)]
    seqs = [torch.randint(0, 97, (n,)) for n in lens]
    num_blocks = sum(cdiv(n, bs) for n in lens)
    allocate_kv_cache(model, num_blocks, bs)
    perm = list(range(num_blocks))
    rng.shuffle(perm)
    tables = [[perm.pop() for _ in range(cdiv(n, bs))] for n in lens]
    done, logits = [0] * 4, [[] for _ in range(4)]
    backend = TorchAttentionBackend()
    with torch.no_grad():
        for step in random_steps(rng, lens, 9):
            md = AttentionMetadata.build([tables[i] for i, _ in step], [done[i] for i, _ in step],
                                         [n for _, n in step], bs, 'cpu', backend)
            ids = torch.cat([seqs[i][done[i]:done[i] + n] for i, n in step])
            hidden = model.model(ids, md.positions, md)
            out = model.compute_logits(hidden)
            for (i, n), start in zip(step, md.query_start_loc_cpu):
                logits[i].append(out[start:start + n])
                done[i] += n
        for ids, got in zip(seqs, logits):
            ref = model(ids, torch.arange(len(ids)))
            torch.testing.assert_close(torch.cat(got), ref, rtol=1e-9, atol=1e-9)


# ---------------------------------------------------- the block manager alone, as a state machine

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule


class BlockManagerMachine(RuleBasedStateMachine):
    "Random allocate, compute + commit, append, free; a fake cache records each slot."

    @initialize(num_blocks=st.integers(1, 12), bs=st.sampled_from([1, 2, 3, 4]),
                prefix_caching=st.booleans())
    def setup(self, num_blocks, bs, prefix_caching):
        self.bm = BlockManager(num_blocks, bs, prefix_caching)
        self.bs, self.seqs, self.slots = bs, [], {}
        self.prefixes = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 9, 9, 9, 9, 9], [7] * 9]

    def slot(self, s, p):
        return s.block_table[p // self.bs] * self.bs + p % self.bs

    @rule(which=st.integers(0, 2), n=st.integers(1, 9),
          tail=st.lists(st.integers(0, 3), max_size=3))
    def add(self, which, n, tail):
        s = Seq(self.prefixes[which][:n] + tail)
        if not self.bm.can_allocate(s):
            return
        free_before = self.bm.num_free_blocks
        num_cached_tokens = self.bm.allocate(s)
        # full blocks only; never the whole sequence
        assert num_cached_tokens % self.bs == 0 and num_cached_tokens < len(s.token_ids)
        for p in range(num_cached_tokens):      # a hit holds exactly this sequence's prefix
            assert self.slots.get(self.slot(s, p)) == (s.token_ids[p], p)
        assert len(s.block_table) == cdiv(len(s.token_ids), self.bs)
        assert free_before >= self.bm.num_free_blocks
        s.num_computed_tokens = num_cached_tokens
        self.seqs.append(s)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 100), n=st.integers(1, 5))
    def compute(self, i, n):
        "Run n more of its tokens: write them into their slots, then commit (hash full blocks)."
        s = self.seqs[i % len(self.seqs)]
        n = min(n, len(s.token_ids) - s.num_computed_tokens)
        for p in range(s.num_computed_tokens, s.num_computed_tokens + n):
            b = self.bm.blocks[s.block_table[p // self.bs]]
            assert b.ref_count == 1 and b.hash is None, "writing into a shared or hashed block"
            self.slots[self.slot(s, p)] = (s.token_ids[p], p)
        s.num_computed_tokens += n
        self.bm.commit(s)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 100), tok=st.integers(0, 3))
    def append(self, i, tok):
        "A decode: the sequence grows by one token once everything it has is computed."
        s = self.seqs[i % len(self.seqs)]
        if s.num_computed_tokens < len(s.token_ids) or not self.bm.can_append(s, 1):
            return
        s.token_ids.append(tok)
        self.bm.append_slots(s, 1)
        assert len(s.block_table) == cdiv(len(s.token_ids), self.bs)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 100))
    def free(self, i):
        self.bm.free(self.seqs.pop(i % len(self.seqs)))

    @invariant()
    def consistent(self):
        if not hasattr(self, 'bm'):
            return
        check_block_accounting(self.bm, self.seqs)
        for block_id in self.bm.cached.values():   # and the fake cache holds what the hash says
            for j, t in enumerate(self.bm.blocks[block_id].token_ids):
                written = self.slots.get(block_id * self.bs + j)
                assert written is not None and written[0] == t


BlockManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                                 deadline=None)
TestBlockManagerMachine = BlockManagerMachine.TestCase


@given(st.lists(st.integers(1, 600), min_size=1, max_size=40), st.sampled_from([0.0, 0.25, 1.0]))
def test_group_by_length_bounds_padding(lengths, max_padding):
    "Every decode lands in exactly one group, and none pads past max_padding of its group's longest."
    groups = group_by_length(lengths, max_padding)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        longest = max(lengths[i] for i in g)
        assert all(lengths[i] >= (1 - max_padding) * longest for i in g)
    if max_padding == 1.0:
        assert len(groups) == 1
    if max_padding == 0.0:
        assert len(groups) == len(set(lengths))


@pytest.mark.parametrize("shape", [(3, 4, 2, 8), (0, 4, 2, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kv_pools_are_zeros_made_when_touched(shape, dtype):
    "A CPU pool of zeros from the OS's mapping: every byte 0, writable, separate from the next."
    a, b = paging.zeros(shape, dtype, 'cpu'), paging.zeros(shape, dtype, 'cpu')
    assert a.shape == shape and a.dtype == dtype and a.is_contiguous() and not a.any()
    a.fill_(1.5)
    assert not b.any() and (a == 1.5).all()
