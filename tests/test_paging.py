"""The paged KV cache: pool sizing, the block manager's prefix cache, and the torch attention backend against
`causal_attention` (the reference of chapter 03) and the model's own no-cache path."""
import random
from types import SimpleNamespace

import pytest
import torch

from petite_llm.layers.attention import causal_attention
from petite_llm.paging import (AttentionMetadata, BlockManager, TorchAttentionBackend, allocate_kv_cache, cdiv, hash_block,
                               kv_bytes_per_block, num_kv_blocks)
import petite_llm.paging as paging


class Seq:
    def __init__(self, toks): self.token_ids, self.num_computed_tokens, self.block_table = list(toks), 0, []


def test_pool_sizing():
    cfg = SimpleNamespace(num_hidden_layers=28, num_key_value_heads=8, head_dim=128)
    assert kv_bytes_per_block(cfg, 16, torch.bfloat16) == 2 * 28 * 16 * 8 * 128 * 2
    assert kv_bytes_per_block(cfg, 16, torch.float32) == 2 * kv_bytes_per_block(cfg, 16, torch.bfloat16)
    assert num_kv_blocks(cfg, 16, 10 * kv_bytes_per_block(cfg, 16, torch.bfloat16) + 5, torch.bfloat16) == 10
    draft = SimpleNamespace(num_hidden_layers=2, num_key_value_heads=8, head_dim=128)
    assert kv_bytes_per_block([cfg, draft], 16, torch.bfloat16) == 2 * 30 * 16 * 8 * 128 * 2
    with pytest.raises(ValueError, match="kv_cache_memory"): num_kv_blocks(cfg, 16, 1000, torch.bfloat16)


def tiny_config(**kw):
    from petite_llm.config import ModelConfig
    d = dict(model_type='qwen3', vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=24, rope_theta=1e6)
    d.update(kw)
    return ModelConfig(**d)


def test_allocate_kv_cache_on_the_model():
    from petite_llm.model import Qwen3ForCausalLM
    model = Qwen3ForCausalLM(tiny_config(num_hidden_layers=3)).to(torch.float64)
    caches = allocate_kv_cache(model, num_blocks=7, block_size=4)
    layers = [l.self_attn for l in model.model.layers]
    assert len(caches) == 3 and all(a.kv_cache is c for a, c in zip(layers, caches))
    k, v = caches[0]
    assert k.shape == v.shape == (7, 4, 2, 24) and k.dtype == torch.float64 and not k.any()
    assert k.data_ptr() != v.data_ptr()


def test_prefix_cache_hits_are_verified(monkeypatch):
    "Even when every block hashes to the same key, a lookup never returns a block holding other tokens."
    monkeypatch.setattr(paging, 'hash_block', lambda parent, toks: 42)
    bm = BlockManager(8, 2)
    a = Seq([1, 2, 3, 4, 5]); bm.allocate(a); a.num_computed_tokens = 5; bm.commit(a)
    b = Seq([9, 9, 3, 4, 5])
    assert bm.allocate(b) == 0 and not set(b.block_table) & set(a.block_table)
    c = Seq([1, 2, 7, 7, 7])
    assert bm.allocate(c) == 2 and c.block_table[0] == a.block_table[0]


def test_hash_chain_depends_on_the_whole_prefix():
    bm = BlockManager(16, 2)
    a = Seq([1, 2, 3, 4, 0]); bm.allocate(a); a.num_computed_tokens = 5; bm.commit(a)
    b = Seq([5, 6, 3, 4, 0])                          # same second block, different first block
    assert bm.allocate(b) == 0
    assert hash_block(None, [3, 4]) != hash_block(hash_block(None, [1, 2]), [3, 4])


def test_full_prefix_hit_keeps_one_block_to_compute():
    for bs in (1, 2, 4):
        bm = BlockManager(32, bs)
        a = Seq(range(8)); bm.allocate(a); a.num_computed_tokens = 8; bm.commit(a)
        b = Seq(range(8))
        assert bm.allocate(b) == (7 // bs) * bs < 8
        assert b.block_table[-1] not in a.block_table     # the recomputed block is private: nobody reads while it is written


def test_disabled_prefix_cache_never_hits():
    bm = BlockManager(8, 2, enable_prefix_caching=False)
    a = Seq(range(6)); bm.allocate(a); a.num_computed_tokens = 6; bm.commit(a)
    assert bm.allocate(Seq(range(6))) == 0 and not bm.cached


def test_commit_hashes_only_computed_full_blocks():
    bm = BlockManager(8, 4)
    a = Seq(range(10)); bm.allocate(a)
    a.num_computed_tokens = 7; bm.commit(a)
    assert [bm.blocks[b].hash is not None for b in a.block_table] == [True, False, False]
    a.num_computed_tokens = 10; bm.commit(a)
    assert [bm.blocks[b].hash is not None for b in a.block_table] == [True, True, False]


def test_lru_order_and_blank_blocks_first():
    bm = BlockManager(4, 1)
    seqs = [Seq([i, 100]) for i in range(2)]          # each: 1 hashed block + 1 unhashed
    for s in seqs: bm.allocate(s); s.num_computed_tokens = 1; bm.commit(s)
    for s in seqs: bm.free(s)
    x = Seq([7, 7]); bm.allocate(x)                    # two blank (unhashed) blocks go first
    assert {bm.blocks[b].hash for b in x.block_table} == {None} and len(bm.cached) == 2
    y = Seq([8]); bm.allocate(y)                      # evicts seq 0's block (freed first), keeps seq 1's
    bm.free(x)
    assert len(bm.cached) == 1 and bm.allocate(Seq([1, 5])) == 1 and bm._lookup(Seq([0, 5])) == []


def test_append_and_truncate():
    bm = BlockManager(8, 4)
    a = Seq(range(5)); bm.allocate(a); a.num_computed_tokens = 5
    assert bm.can_append(a, 4) and len(a.block_table) == 2
    bm.append_slots(a, 4); assert len(a.block_table) == 3          # tokens 5..8 need a third block
    a.num_computed_tokens = 9; a.token_ids += [1, 2, 3, 4]; bm.commit(a)
    assert bm.blocks[a.block_table[1]].hash is not None
    bm.truncate(a, 6)                                              # drafts rejected: keep 6 tokens
    assert len(a.block_table) == 2 and bm.blocks[a.block_table[1]].hash is None and bm.num_used_blocks == 2
    assert not bm.can_append(Seq([]), 4 * 7)


# ---------------------------------------------------------------- attention over the paged cache

def qkv(T, nh, nkv, hd, g, dtype):
    r = lambda n: torch.randn(T, n, hd, generator=g, dtype=dtype)
    return r(nh), r(nkv), r(nkv)


def run_paged(seqs, steps, bs, nh, nkv, hd, dtype, seed=0, batch_decodes=None):
    "Run each sequence's q/k/v through the paged backend in the given steps [(seq, n new)...]; outputs per sequence."
    g = torch.Generator().manual_seed(seed)
    nblocks = sum(cdiv(len(q), bs) for q, _, _ in seqs) + 3
    k_cache = torch.zeros(nblocks, bs, nkv, hd, dtype=dtype); v_cache = torch.zeros_like(k_cache)
    perm = torch.randperm(nblocks, generator=g).tolist()
    tables = [[perm.pop() for _ in range(cdiv(len(q), bs))] for q, _, _ in seqs]
    done, outs = [0] * len(seqs), [[] for _ in seqs]
    backend = TorchAttentionBackend(batch_decodes)
    for step in steps:
        md = AttentionMetadata.build([tables[i] for i, _ in step], [done[i] for i, _ in step], [n for _, n in step], bs, backend=backend)
        cat = lambda j: torch.cat([seqs[i][j][done[i]:done[i] + n] for i, n in step])
        o = backend.forward(cat(0), cat(1), cat(2), (k_cache, v_cache), md, hd ** -0.5)
        assert o.shape == (md.num_decode_tokens + md.num_prefill_tokens, nh, hd)
        for (i, n), s in zip(step, md.query_start_loc_cpu): outs[i].append(o[s:s + n]); done[i] += n
    return [torch.cat(o) for o in outs]


def random_steps(rng, lens, budget):
    "A random schedule: each step, every unfinished sequence advances by 1 (decode-like) or a chunk; decodes first."
    done, steps = [0] * len(lens), []
    while any(d < n for d, n in zip(done, lens)):
        step = []
        for i in rng.sample(range(len(lens)), len(lens)):
            if done[i] < lens[i] and rng.random() < 0.8:
                n = min(lens[i] - done[i], rng.choice([1, 1, rng.randint(1, budget)]))
                step.append((i, n)); done[i] += n
        if step: steps.append(sorted(step, key=lambda e: e[1] != 1))
    return steps


@pytest.mark.parametrize("bs", [1, 4, 16])
@pytest.mark.parametrize("nh,nkv", [(4, 4), (6, 2), (4, 1)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("batch_decodes", [True, False])   # the GPU's batched decodes and the CPU's one-at-a-time, both checked here
def test_backend_matches_causal_attention(bs, nh, nkv, dtype, batch_decodes):
    rng, g, hd = random.Random(bs * 100 + nh * 10 + nkv), torch.Generator().manual_seed(bs + nh + nkv), 8
    for trial in range(2):
        lens = [rng.randint(1, 40) for _ in range(rng.randint(1, 5))]
        seqs = [qkv(T, nh, nkv, hd, g, dtype) for T in lens]
        outs = run_paged(seqs, random_steps(rng, lens, 12), bs, nh, nkv, hd, dtype, seed=trial, batch_decodes=batch_decodes)
        for (q, k, v), o in zip(seqs, outs):
            torch.testing.assert_close(o, causal_attention(q, k, v, hd ** -0.5))


def test_metadata_fields():
    md = AttentionMetadata.build([[3, 1], [0], [2, 4, 5]], [5, 0, 4], [1, 3, 6], 4)
    assert md.num_decodes == md.num_decode_tokens == 1 and md.num_prefill_tokens == 9
    assert md.slot_mapping.tolist() == [1 * 4 + 1, 0, 1, 2, 16, 17, 18, 19, 20, 21]
    assert md.positions.tolist() == [5, 0, 1, 2, 4, 5, 6, 7, 8, 9]
    assert md.context_lens.tolist() == md.context_lens_cpu == [6, 3, 10]
    assert md.query_start_loc.tolist() == md.query_start_loc_cpu == [0, 1, 4, 10]
    assert md.block_tables.tolist() == [[3, 1, 0], [0, 0, 0], [2, 4, 5]] and md.block_tables.dtype == torch.int32
    assert md.slot_mapping.dtype == torch.long and (md.max_query_len, md.max_context_len) == (6, 10)
    with pytest.raises(ValueError, match="cannot hold"): AttentionMetadata.build([[0]], [3], [2], 4)


@pytest.mark.parametrize("batch_decodes", [True, False])
def test_padding_slots_are_skipped(batch_decodes):
    g = torch.Generator().manual_seed(0)
    kc = torch.randn(3, 2, 1, 4, generator=g, dtype=torch.float64); vc = kc.clone(); before = kc.clone()
    be = TorchAttentionBackend(batch_decodes)
    md = AttentionMetadata.build([[1], [0], [2]], [0, 0, 0], [1, 1, 1], 2, backend=be)
    md.context_lens_cpu = [1, 0, 0]
    md.slot_mapping[1:] = -1; md.context_lens[1:] = 0
    q, k, v = qkv(3, 2, 1, 4, g, torch.float64)
    out = md.backend.forward(q, k, v, (kc, vc), md, 0.5)
    assert torch.equal(kc[[0, 2]], before[[0, 2]]) and torch.equal(kc[1, 0], k[0]) and torch.isfinite(out).all()
    md = AttentionMetadata.build([[0], [2]], [0, 0], [1, 1], 2, backend=be)      # a batch of nothing but padding
    md.slot_mapping[:] = -1; md.context_lens[:] = 0; md.context_lens_cpu = [0, 0]
    assert torch.isfinite(md.backend.forward(q[:2], k[:2], v[:2], (kc, vc), md, 0.5)).all()


@pytest.mark.parametrize("bs", [1, 4, 16])
@pytest.mark.parametrize("nkv", [1, 2])
def test_model_paged_matches_reference_path(bs, nkv):
    "Chunked prefill + decodes of several sequences in mixed batches through the model = the no-cache reference, per sequence."
    from petite_llm.model import Qwen3ForCausalLM
    torch.manual_seed(bs + nkv)
    model = Qwen3ForCausalLM(tiny_config(num_key_value_heads=nkv)).to(torch.float64).eval()
    rng = random.Random(bs)
    lens = [rng.randint(1, 30) for _ in range(4)]
    seqs = [torch.randint(0, 97, (n,)) for n in lens]
    nblocks = sum(cdiv(n, bs) for n in lens)
    allocate_kv_cache(model, nblocks, bs)
    perm = list(range(nblocks)); rng.shuffle(perm)
    tables = [[perm.pop() for _ in range(cdiv(n, bs))] for n in lens]
    done, logits = [0] * 4, [[] for _ in range(4)]
    with torch.no_grad():
        for step in random_steps(rng, lens, 9):
            md = AttentionMetadata.build([tables[i] for i, _ in step], [done[i] for i, _ in step], [n for _, n in step], bs)
            ids = torch.cat([seqs[i][done[i]:done[i] + n] for i, n in step])
            hidden = model(ids, md.positions, md)
            out = model.compute_logits(hidden)
            for (i, n), s in zip(step, md.query_start_loc_cpu): logits[i].append(out[s:s + n]); done[i] += n
        for ids, got in zip(seqs, logits):
            ref = model(ids, torch.arange(len(ids)))
            torch.testing.assert_close(torch.cat(got), ref, rtol=1e-9, atol=1e-9)


# ---------------------------------------------------------------- the block manager alone, as a state machine

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule


class BlockManagerMachine(RuleBasedStateMachine):
    "Random allocate / compute+commit / append / truncate / free on a tiny pool; a fake cache records what each slot holds."

    @initialize(num_blocks=st.integers(1, 12), bs=st.sampled_from([1, 2, 3, 4]), prefix_caching=st.booleans())
    def setup(self, num_blocks, bs, prefix_caching):
        self.bm, self.bs, self.seqs, self.slots = BlockManager(num_blocks, bs, prefix_caching), bs, [], {}
        self.prefixes = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 9, 9, 9, 9, 9], [7] * 9]

    def slot(self, s, p): return s.block_table[p // self.bs] * self.bs + p % self.bs

    @rule(which=st.integers(0, 2), n=st.integers(1, 9), tail=st.lists(st.integers(0, 3), max_size=3))
    def add(self, which, n, tail):
        s = Seq(self.prefixes[which][:n] + tail)
        if not self.bm.can_allocate(s): return
        free_before = self.bm.num_free_blocks
        cached = self.bm.allocate(s)
        assert cached % self.bs == 0 and cached < len(s.token_ids)            # full blocks only; never the whole sequence
        for p in range(cached):                                               # a hit holds exactly this sequence's prefix
            assert self.slots.get(self.slot(s, p)) == (s.token_ids[p], p)
        assert len(s.block_table) == cdiv(len(s.token_ids), self.bs) and free_before >= self.bm.num_free_blocks
        s.num_computed_tokens = cached
        self.seqs.append(s)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 100), n=st.integers(1, 5))
    def compute(self, i, n):
        "Run n more of its tokens: write them into their slots, then commit (hash what became full)."
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
        if s.num_computed_tokens < len(s.token_ids) or not self.bm.can_append(s, 1): return
        s.token_ids.append(tok)
        self.bm.append_slots(s, 1)
        assert len(s.block_table) == cdiv(len(s.token_ids), self.bs)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 100), k=st.integers(1, 3))
    def truncate(self, i, k):
        "Reject the last k uncommitted tokens (never below what is hashed)."
        s = self.seqs[i % len(self.seqs)]
        hashed = sum(self.bm.blocks[b].hash is not None for b in s.block_table) * self.bs
        keep = max(len(s.token_ids) - k, hashed, 1)
        del s.token_ids[keep:]
        s.num_computed_tokens = min(s.num_computed_tokens, keep)
        self.bm.truncate(s, keep)
        assert len(s.block_table) == cdiv(keep, self.bs)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 100))
    def free(self, i):
        self.bm.free(self.seqs.pop(i % len(self.seqs)))

    @invariant()
    def consistent(self):
        if not hasattr(self, 'bm'): return
        bm, refs = self.bm, [0] * self.bm.num_blocks
        for s in self.seqs:
            for b in s.block_table: refs[b] += 1
        assert [b.ref_count for b in bm.blocks] == refs
        assert set(bm.free_ids) == {i for i, r in enumerate(refs) if r == 0}
        assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks
        for h, bid in bm.cached.items():                                       # every cached block holds what its hash says
            b = bm.blocks[bid]
            assert b.hash == h and all(self.slots.get(bid * self.bs + j) is not None and self.slots[bid * self.bs + j][0] == t
                                       for j, t in enumerate(b.token_ids))


BlockManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestBlockManagerMachine = BlockManagerMachine.TestCase
