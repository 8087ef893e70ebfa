"""Scheduler and block manager under random request streams (hypothesis), plus the named corners.

The FakeModel of doubles.py (chapter 12's) writes (token, position) into the slots the scheduler
hands out and samples from the context it reads *back through the block table*, so a wrong prefix
hit, an overwritten shared block or a block hashed before it was written shows up as a wrong token
or a failed assertion.
"""
import random
from collections import Counter

import pytest
from hypothesis import given, settings, strategies as st, HealthCheck

from petite_llm.engine.paging import BlockManager, cdiv, check_block_accounting
from petite_llm.model.sampling_params import SamplingParams
from petite_llm.engine.scheduler import Scheduler, Sequence, SequenceStatus
from petite_llm.engine.speculative import SpeculativeScheduler
from doubles import FakeModel

EOS = 0


def check_invariants(sched):
    "The pool's books balance (chapter 11's check), and the queues agree with each status."
    bm = sched.block_manager
    check_block_accounting(bm, sched.running)
    assert all(not s.block_table and s.status is SequenceStatus.WAITING for s in sched.waiting)
    assert all(s.status is SequenceStatus.RUNNING for s in sched.running)
    for s in sched.running:
        assert len(s.block_table) >= cdiv(s.num_computed_tokens, bm.block_size)
        # a verify step computes the drafts past the pending token too
        assert s.num_computed_tokens <= s.num_tokens + len(s.spec_token_ids)
    assert len(sched.running) <= sched.max_num_seqs
    assert set(sched.seqs) == {s.seq_id for s in sched.running + sched.waiting}


def drive(sched, model, arrivals, aborts, check_order=True, num_speculative_tokens=0):
    """Run until every request finished, checking invariants and budgets every step; with
    num_speculative_tokens, decodes verify the fake model's drafts (right for a while, then wrong).
    Returns the finished sequences, the steps after the last arrival, all steps, drafts verified."""
    finished, step, after, verified = {}, 0, 0, 0
    while step < len(arrivals) or sched.has_unfinished_requests():
        for seq in (arrivals[step] if step < len(arrivals) else []):
            sched.add(seq)
        if step in aborts and sched.seqs:
            victim = sorted(sched.seqs)[aborts[step] % len(sched.seqs)]
            finished[victim] = sched.abort(victim)
        if num_speculative_tokens:
            for seq in sched.awaiting_drafts():
                seq.spec_token_ids = model.propose(seq,
                                                   sched.max_drafts(seq, num_speculative_tokens))
        waiting_before, had_work = set(map(id, sched.waiting)), sched.has_unfinished_requests()
        out = sched.schedule()
        check_invariants(sched)
        assert out.num_batched_tokens <= sched.max_num_batched_tokens
        assert all(n >= 1 for n in out.num_new_tokens)
        # a recompute whose prefix hits reach its last token is admitted and computes nothing
        admitted = [s for s in sched.running if id(s) in waiting_before]
        assert len(out) > 0 or admitted or not had_work, "requests left, nothing done: a stall"
        assert len(out.input_ids) == out.num_batched_tokens
        assert len(out.logits_indices) == sum(len(d) + 1 for d, samples
                                              in zip(out.spec_token_ids, out.do_sample) if samples)
        # decodes lead the batch: output tokens, and only the newest one left to compute
        decodes = [s.num_output_tokens > 0 and done == len(s.token_ids) - 1
                   for s, done in zip(out.seqs, out.num_computed_tokens)]
        assert decodes == [i < out.num_decodes for i in range(len(out))]
        assert all(n == 1 + len(d) for n, d in zip(out.num_new_tokens[:out.num_decodes],
                                                   out.spec_token_ids))
        scheduled_ids = {s.seq_id for s in out.seqs}
        assert len(scheduled_ids) == len(out.seqs) and not set(out.preempted_ids) & scheduled_ids
        # admissions take the head of the queue: nobody admitted is less urgent than anyone left
        if check_order:
            admitted = [s for s in out.seqs if id(s) in waiting_before]
            if admitted and sched.waiting:
                assert max(s.urgency for s in admitted) < min(s.urgency for s in sched.waiting)
        verified += sum(map(len, out.spec_token_ids))
        for seq in sched.update(out, model.step(out)):
            finished[seq.seq_id] = seq
        check_invariants(sched)
        step += 1
        after += step > len(arrivals)
    assert sched.block_manager.num_used_blocks == 0 and not sched.running and not sched.waiting
    return finished, after, step, verified


def drive_async(sched, model, arrivals, aborts):
    """drive() with async scheduling: step n+1 is scheduled and run before step n's update, its
    pending tokens read from step n's samples. Returns the finished sequences, the steps, and
    how many pending tokens met a finished sequence (dropped) or a preempted one (kept)."""
    finished, step, prev, late = {}, 0, None, Counter()
    while step < len(arrivals) or sched.has_unfinished_requests() or prev is not None:
        for seq in (arrivals[step] if step < len(arrivals) else []):
            sched.add(seq)
        if step in aborts and sched.seqs:
            victim = sorted(sched.seqs)[aborts[step] % len(sched.seqs)]
            finished[victim] = sched.abort(victim)
        out = sched.schedule()
        check_invariants(sched)
        assert out.num_batched_tokens <= sched.max_num_batched_tokens
        assert len(out.input_ids) == out.num_batched_tokens
        # launched before the step in flight is resolved: its tokens are still pending
        sampled = model.step(out, prev[1] if prev is not None else None)
        if prev is not None:
            for seq, samples in zip(prev[0].seqs, prev[0].do_sample):
                late['dropped'] += samples and seq.is_finished
                late['kept_preempted'] += samples and seq.status is SequenceStatus.WAITING
            for seq in sched.update(*prev):
                finished[seq.seq_id] = seq
            check_invariants(sched)
        prev = (out, sampled) if len(out) else None
        step += 1
        assert step < 5000, "a stall"
    assert sched.block_manager.num_used_blocks == 0 and not sched.running and not sched.waiting
    assert all(s.num_pending == 0 for s in finished.values() if s.finish_reason != 'abort')
    return finished, step, late


def make_stream(rng, n, vocab, prefixes, max_prompt, max_out, groups):
    reqs, i = [], 0
    while len(reqs) < n:
        prompt = rng.choice(prefixes)[:rng.randint(0, max_prompt)]
        prompt += [rng.randrange(1, vocab) for _ in range(rng.randint(1, max_prompt))]
        prompt = prompt[:max_prompt] or [1]
        mt = rng.randint(1, max_out)
        sp = SamplingParams(max_tokens=mt, min_tokens=min(mt, rng.choice([0, 0, 2])),
                            ignore_eos=rng.random() < 0.2, stop_token_ids=rng.choice([[], [], [3]]))
        prio = rng.choice([0, 0, 0, 1, 5])
        k = rng.choice([1, 1, 1, 3]) if groups else 1
        for _ in range(k):
            group_id = 1000 + len(reqs) if k > 1 else None
            reqs.append(Sequence(i, prompt, sp, priority=prio, group_id=group_id))
            i += 1
    return reqs


def run_stream(seed, block_size, extra_blocks, budget, max_num_seqs, prefix_caching, groups,
               num_speculative_tokens=0, async_scheduling=False):
    "One random request stream through a scheduler, checked every step; returns its counters."
    rng = random.Random(seed)
    vocab, max_prompt, max_out, max_model_len = 23, 30, 20, 40
    prefixes = [[rng.randrange(1, vocab) for _ in range(max_prompt)] for _ in range(3)]
    reqs = make_stream(rng, rng.randint(1, 14), vocab, prefixes, max_prompt, max_out, groups)
    need = max(cdiv(min(r.num_tokens + r.sampling_params.max_tokens, max_model_len) - 1, block_size)
               for r in reqs)
    bm = BlockManager(need + extra_blocks, block_size, enable_prefix_caching=prefix_caching)
    scheduler_type = SpeculativeScheduler if num_speculative_tokens else Scheduler
    sched = scheduler_type(bm, max_num_batched_tokens=max(budget, max_num_seqs),
                           max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                           eos_token_ids=[EOS])
    model = FakeModel(block_size, vocab)
    arrivals = [[] for _ in range(rng.randint(1, 30))]
    for r in reqs:
        arrivals[rng.randrange(len(arrivals))].append(r)
    aborts = {rng.randrange(60): rng.randrange(100) for _ in range(rng.choice([0, 0, 2]))}
    if async_scheduling:
        finished, steps, late = drive_async(sched, model, arrivals, aborts)
        after = verified = 0
    else:
        finished, after, steps, verified = drive(sched, model, arrivals, aborts, not groups,
                                                 num_speculative_tokens)
    assert set(finished) == {r.seq_id for r in reqs}
    for r in reqs:
        assert r.status is SequenceStatus.FINISHED
        if r.finish_reason == 'abort':
            continue
        assert (r.output_token_ids, r.finish_reason) == model.alone(r, max_model_len, [EOS])
    # once arrivals stop, everything finishes within a bounded number of steps (recompute included)
    work = sum(r.num_prompt_tokens + r.sampling_params.max_tokens for r in reqs)
    assert after <= 2 * work + 10
    return Counter(steps=steps, preemptions=sched.num_preemptions, prefix_hits=bm.num_hit_tokens,
                   drafts_verified=verified, **(late if async_scheduling else {}))


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**32 - 1), block_size=st.sampled_from([1, 2, 4, 8]),
       extra_blocks=st.integers(0, 6), budget=st.integers(4, 40), max_num_seqs=st.integers(1, 8),
       prefix_caching=st.booleans(), groups=st.booleans(),
       num_speculative_tokens=st.sampled_from([0, 0, 1, 4]))
def test_random_streams(seed, block_size, extra_blocks, budget, max_num_seqs, prefix_caching,
                        groups, num_speculative_tokens):
    run_stream(seed, block_size, extra_blocks, budget, max_num_seqs, prefix_caching, groups,
               num_speculative_tokens)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**32 - 1), block_size=st.sampled_from([1, 2, 4, 8]),
       extra_blocks=st.integers(0, 6), budget=st.integers(4, 40), max_num_seqs=st.integers(1, 8),
       prefix_caching=st.booleans(), groups=st.booleans())
def test_random_streams_async(seed, block_size, extra_blocks, budget, max_num_seqs,
                              prefix_caching, groups):
    "Async scheduling: every request still gets the tokens it gets alone, stops and all."
    run_stream(seed, block_size, extra_blocks, budget, max_num_seqs, prefix_caching, groups,
               async_scheduling=True)


def test_async_streams_preempt_and_stop_late():
    "The async streams preempt sequences whose token is pending and run steps after a stop."
    rng, totals = random.Random(1), Counter()
    for _ in range(40):
        totals += run_stream(seed=rng.randrange(2**32), block_size=rng.choice([1, 2, 4, 8]),
                             extra_blocks=rng.randint(0, 6), budget=rng.randint(4, 40),
                             max_num_seqs=rng.randint(1, 8), prefix_caching=rng.random() < 0.5,
                             groups=rng.random() < 0.5, async_scheduling=True)
    assert totals['preemptions'] > 20 and totals['prefix_hits'] > 50, totals
    assert totals['dropped'] > 20 and totals['kept_preempted'] > 10, totals


# test_many_steps_were_run draws this many streams as the property test does, and needs at least
# the original bar: thousands of steps, dozens of preemptions, a hundred prefix-hit tokens, and
# hundreds of drafts verified
STREAMS, MIN_STEPS, MIN_PREEMPTIONS, MIN_PREFIX_HITS, MIN_DRAFTS = 60, 2000, 50, 100, 300


def test_many_steps_were_run():
    "The streams the property test draws run many steps, preempt, hit the prefix cache, speculate."
    rng = random.Random(0)
    totals = Counter()
    for _ in range(STREAMS):
        totals += run_stream(seed=rng.randrange(2**32), block_size=rng.choice([1, 2, 4, 8]),
                             extra_blocks=rng.randint(0, 6), budget=rng.randint(4, 40),
                             max_num_seqs=rng.randint(1, 8), prefix_caching=rng.random() < 0.5,
                             groups=rng.random() < 0.5,
                             num_speculative_tokens=rng.choice([0, 0, 3]))
    print(f"{STREAMS} streams: {dict(totals)}")
    assert totals['steps'] > MIN_STEPS and totals['preemptions'] > MIN_PREEMPTIONS, totals
    assert totals['prefix_hits'] > MIN_PREFIX_HITS, totals
    assert totals['drafts_verified'] > MIN_DRAFTS, totals


def _sched(num_blocks=16, bs=4, budget=32, seqs=8, max_model_len=64, scheduler_type=Scheduler,
           **kw):
    bm = BlockManager(num_blocks, bs, **kw)
    sched = scheduler_type(bm, max_num_batched_tokens=budget, max_num_seqs=seqs,
                           max_model_len=max_model_len, eos_token_ids=[EOS])
    return sched, FakeModel(bs, 50)


def _step(sched, model):
    "One scheduled step through the fake model; returns the sequences that finished."
    out = sched.schedule()
    return sched.update(out, model.step(out))


def test_chunked_prefill_never_stalls_decodes():
    sched, model = _sched(num_blocks=64, budget=8)
    sched.add(Sequence(0, [5] * 3, SamplingParams(max_tokens=30, ignore_eos=True)))
    _step(sched, model)
    # 40 tokens, budget 8
    sched.add(Sequence(1, list(range(1, 41)), SamplingParams(max_tokens=2, ignore_eos=True)))
    chunks = []
    for _ in range(6):
        out = sched.schedule()
        # the decode runs every step
        assert out.seqs[0].seq_id == 0 and out.num_new_tokens[0] == 1 and out.num_decodes >= 1
        chunks += [n for s, n in zip(out.seqs, out.num_new_tokens) if s.seq_id == 1]
        sched.update(out, model.step(out))
    assert chunks == [7, 7, 7, 7, 7, 5] and sched.seqs[1].num_output_tokens == 1


def test_full_prefix_hit_still_computes_the_last_token():
    sched, model = _sched()
    prompt = list(range(1, 17))                       # 4 full blocks
    sched.add(Sequence(0, prompt, SamplingParams(max_tokens=1)))
    _step(sched, model)
    assert not sched.has_unfinished_requests()
    sched.add(Sequence(1, prompt, SamplingParams(max_tokens=2)))
    out = sched.schedule()
    assert out.num_computed_tokens == [12] and out.num_new_tokens == [4] and out.do_sample == [True]
    finished = sched.update(out, model.step(out))
    assert sched.block_manager.num_hit_tokens == 12 and not finished
    [s] = _step(sched, model)
    assert (s.output_token_ids, s.finish_reason) == model.alone(s, 64, [EOS])


def test_n_samples_share_prompt_blocks():
    sched, model = _sched(num_blocks=32)
    for i in range(4):
        sched.add(Sequence(i, list(range(1, 14)), SamplingParams(max_tokens=3, ignore_eos=True),
                           group_id=7))
    out = sched.schedule()
    assert [s.seq_id for s in out.seqs] == [0]
    sched.update(out, model.step(out))
    out = sched.schedule()
    tables = [sched.seqs[i].block_table for i in range(4)]
    assert all(t[:3] == tables[0][:3] for t in tables) and len({t[3] for t in tables}) == 4
    assert sched.block_manager.blocks[tables[0][0]].ref_count == 4
    sched.update(out, model.step(out))


def test_refusals():
    sched, _ = _sched(num_blocks=4, max_model_len=20)
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add(Sequence(0, [1] * 20))
    with pytest.raises(ValueError, match="KV blocks"):
        sched.add(Sequence(1, [1] * 10, SamplingParams(max_tokens=9)))
    sched.add(Sequence(2, [1] * 10, SamplingParams(max_tokens=7)))
    with pytest.raises(ValueError, match="already queued"):
        sched.add(Sequence(2, [1]))
    with pytest.raises(ValueError, match="empty"):
        Sequence(3, [])
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        Scheduler(BlockManager(4, 4), max_num_batched_tokens=4, max_num_seqs=8)


def test_stop_rules():
    sched, _ = _sched()

    def go(sp, tokens, max_model_len=64):
        sched.max_model_len = max_model_len
        sched.add(Sequence(99, [1, 2, 3], sp))
        for t in tokens:
            out = sched.schedule()
            if fin := sched.update(out, [t]):
                return fin[0]

    s = go(SamplingParams(max_tokens=10), [4, EOS])
    assert (s.output_token_ids, s.finish_reason, s.stop_reason) == ([4, EOS], 'stop', EOS)
    s = go(SamplingParams(max_tokens=10, min_tokens=2), [EOS, EOS, 5, EOS])
    assert s.output_token_ids == [EOS, EOS, 5, EOS]
    s = go(SamplingParams(max_tokens=3, ignore_eos=True), [EOS, EOS, EOS])
    assert s.finish_reason == 'length'
    s = go(SamplingParams(max_tokens=10, ignore_eos=True, stop_token_ids=[7]), [EOS, 7])
    assert (s.finish_reason, s.stop_reason) == ('stop', 7)
    s = go(SamplingParams(max_tokens=10), [4, 4, 4], max_model_len=5)
    assert (s.output_token_ids, s.finish_reason) == ([4, 4], 'length')


def test_verify_step_takes_accepted_drafts_and_stops_midway():
    "A decode with drafts computes them all; the tokens after a stop among them are dropped."
    sched, model = _sched(scheduler_type=SpeculativeScheduler)
    sched.add(Sequence(0, [1, 2], SamplingParams(max_tokens=10)))
    _step(sched, model)                               # the prefill samples the first token
    seq = sched.seqs[0]
    seq.spec_token_ids = [5, 6, EOS]
    out = sched.schedule()
    # a decode that verifies three drafts: four tokens, four rows of logits
    assert out.num_new_tokens == [4] and out.num_decodes == 1 and out.logits_indices == [0, 1, 2, 3]
    assert out.input_ids == [seq.token_ids[-1], 5, 6, EOS] and out.spec_token_ids == [[5, 6, EOS]]
    [s] = sched.update(out, {0: [5, 6, EOS, 8]})
    assert s.output_token_ids[1:] == [5, 6, EOS] and s.finish_reason == 'stop'


def test_rejected_drafts_roll_back_and_are_never_hashed():
    sched, model = _sched(bs=4, scheduler_type=SpeculativeScheduler)
    sched.add(Sequence(0, [1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True)))
    _step(sched, model)                               # 3 prompt tokens computed, 1 output token
    seq, bm = sched.seqs[0], sched.block_manager
    seq.spec_token_ids = [7, 8, 9, 10]
    out = sched.schedule()                            # positions 3..7: two blocks
    assert out.num_new_tokens == [5] and len(seq.block_table) == 2
    sched.update(out, {0: [7, 11]})                   # 7 accepted, 8 rejected: 11 instead
    assert seq.output_token_ids[1:] == [7, 11] and seq.num_computed_tokens == 5
    # block 0 holds 4 computed tokens; block 1 holds 7 and stale drafts: not in the prefix cache
    assert bm.blocks[seq.block_table[0]].hash is not None
    assert bm.blocks[seq.block_table[1]].hash is None
    out = sched.schedule()                            # the next decode reuses the stale slots
    assert out.num_computed_tokens == [5] and out.num_new_tokens == [1]
    assert len(seq.block_table) == 2


def test_verify_is_scheduled_whole_or_waits():
    "A decode whose drafts do not fit this step's budget waits, whole, while others run."
    sched, model = _sched(budget=8, num_blocks=32, scheduler_type=SpeculativeScheduler)
    for i in range(2):
        sched.add(Sequence(i, [1 + i, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True)))
    _step(sched, model)
    a, b = sched.seqs[0], sched.seqs[1]
    a.spec_token_ids, b.spec_token_ids = [4, 4, 4], [5] * 6     # 4 + 7 tokens > budget 8
    out = sched.schedule()
    assert [s.seq_id for s in out.seqs] == [0] and b.spec_token_ids == [5] * 6
    sched.update(out, model.step(out))
    out = sched.schedule()
    assert [s.seq_id for s in out.seqs] == [0, 1] and out.num_new_tokens == [1, 7]
    assert sched.max_drafts(a, 20) == 7                # the budget caps a proposal
    assert sched.max_drafts(Sequence(9, [1], SamplingParams(max_tokens=3)), 5) == 2


def test_preemption_drops_drafts_and_recomputes_all_but_the_last_token():
    sched, model = _sched(num_blocks=5, budget=16, seqs=4, bs=4,
                          scheduler_type=SpeculativeScheduler)
    low = Sequence(0, list(range(1, 9)), SamplingParams(max_tokens=8, ignore_eos=True))
    sched.add(low)
    for _ in range(2):
        _step(sched, model)
    low.spec_token_ids = model.propose(low, 2)
    high = Sequence(1, list(range(20, 32)), SamplingParams(max_tokens=2, ignore_eos=True),
                    priority=1)
    sched.add(high)
    out = sched.schedule()
    assert out.preempted_ids == [0] and low.spec_token_ids == []
    sched.update(out, model.step(out))
    while sched.has_unfinished_requests() and low.status is not SequenceStatus.RUNNING:
        _step(sched, model)
    # back in: it computes its tokens up to the last one, which then runs as a decode
    assert low.num_computed_tokens <= low.num_tokens - 1
    while not low.is_decoding:
        _step(sched, model)
    while sched.has_unfinished_requests():
        _step(sched, model)
    assert low.output_token_ids == model.alone(low, 64, [EOS])[0]


def test_abort_and_finish_free_everything():
    sched, model = _sched(num_blocks=8, budget=8, seqs=2)
    for i in range(3):
        sched.add(Sequence(i, list(range(1, 12)), SamplingParams(max_tokens=5, ignore_eos=True)))
    out = sched.schedule()
    sampled = model.step(out)                         # the forward ran; then, before update():
    assert sched.abort(2).finish_reason == 'abort'    # a waiting request is aborted
    # a running one hit a stop string
    assert sched.finish(0, 'stop', stop_reason='</s>').stop_reason == '</s>'
    assert sched.update(out, sampled) == [] and sched.abort(0) is None
    check_invariants(sched)
    assert list(sched.seqs) == [1]
    sched.abort(1)
    assert sched.block_manager.num_used_blocks == 0 and not sched.has_unfinished_requests()


def test_priority_preempts_less_urgent():
    sched, model = _sched(num_blocks=6, budget=8, seqs=4)
    low = Sequence(0, list(range(1, 15)), SamplingParams(max_tokens=8, ignore_eos=True))
    high = Sequence(1, list(range(20, 34)), SamplingParams(max_tokens=8, ignore_eos=True),
                    priority=5)
    sched.add(low)
    for _ in range(3):
        _step(sched, model)
    sched.add(high)
    out = sched.schedule()
    assert out.preempted_ids == [0] and [s.seq_id for s in out.seqs] == [1]
    assert low.num_computed_tokens == 0
    order = [s.seq_id for s in sched.update(out, model.step(out))]
    while sched.has_unfinished_requests():
        order += [s.seq_id for s in _step(sched, model)]
    assert order == [1, 0] and sched.num_preemptions == 1
    assert low.output_token_ids == model.alone(low, 64, [EOS])[0]


def test_lru_revives_freed_prefix_after_preemption():
    "A preempted sequence's committed blocks survive in the free list and come back as prefix hits."
    sched, model = _sched(num_blocks=8, budget=8, seqs=4)
    a = Sequence(0, list(range(1, 13)), SamplingParams(max_tokens=4, ignore_eos=True))
    sched.add(a)
    for _ in range(2):
        _step(sched, model)
    # 5 blocks, no decode
    b = Sequence(1, list(range(30, 50)), SamplingParams(max_tokens=1, ignore_eos=True), priority=1)
    sched.add(b)
    out = sched.schedule()
    assert out.preempted_ids == [0]
    sched.update(out, model.step(out))
    while sched.has_unfinished_requests():
        _step(sched, model)
    assert a.num_cached_tokens == 12 and a.output_token_ids == model.alone(a, 64, [EOS])[0]


def test_scheduler_drives_the_real_model():
    "Scheduler, block manager, paged attention and the model, greedy in float64 = a no-cache loop."
    import torch
    from petite_llm.model.config import ModelConfig
    from petite_llm.model.qwen3 import Qwen3ForCausalLM
    from petite_llm.engine.backends import AttentionMetadata, TorchAttentionBackend
    from petite_llm.engine.paging import allocate_kv_cache
    torch.manual_seed(0)
    cfg = ModelConfig(model_type='qwen3', vocab_size=97, hidden_size=64, intermediate_size=96,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, rope_theta=1e6)
    model = Qwen3ForCausalLM(cfg).to(torch.float64).eval()
    rng = random.Random(0)
    shared = [rng.randrange(97) for _ in range(13)]
    prompts = [shared[:rng.randint(0, 13)] + [rng.randrange(97) for _ in range(rng.randint(1, 12))]
               for _ in range(8)]
    # a repeat (a full prefix hit when 8 divides its length) and a prefix
    prompts += [prompts[0], prompts[0][:8]]
    max_tokens = 6

    @torch.no_grad()
    def reference(p):
        ids = list(p)
        for _ in range(max_tokens):
            ids.append(int(model(torch.tensor(ids), torch.arange(len(ids)))[-1].argmax()))
        return ids[len(p):]

    want = [reference(p) for p in prompts]
    for bs, num_blocks, budget in ((1, 40, 8), (4, 10, 8), (16, 4, 16)):
        bm = BlockManager(num_blocks, bs)
        allocate_kv_cache(model, num_blocks, bs)
        backend = TorchAttentionBackend()
        sched = Scheduler(bm, max_num_batched_tokens=budget, max_num_seqs=4, max_model_len=64)
        for i, p in enumerate(prompts):
            sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            sched.add(Sequence(i, p, sp, priority=i % 3))
        got = {}
        with torch.no_grad():
            while sched.has_unfinished_requests():
                out = sched.schedule()
                md = AttentionMetadata.build([s.block_table for s in out.seqs],
                                             out.num_computed_tokens, out.num_new_tokens, bs,
                                             'cpu', backend)
                hidden = model.model(torch.tensor(out.input_ids), md.positions, md)   # [T, H]
                logits = model.compute_logits(hidden[out.logits_indices])
                for s in sched.update(out, logits.argmax(-1).tolist()):
                    got[s.seq_id] = s.output_token_ids
        assert [got[i] for i in range(len(prompts))] == want, f"block_size={bs}"
        # prompts are shorter than 2 blocks of 16: no hits there
        assert sched.num_preemptions > 0 and (bm.num_hit_tokens > 0 or bs == 16), (bs, sched.stats)


@settings(max_examples=40, deadline=None)
@given(prios=st.lists(st.integers(0, 3), min_size=2, max_size=10), prompt_len=st.integers(1, 20),
       max_tokens=st.integers(1, 10), bs=st.sampled_from([1, 4]), budget=st.integers(4, 24),
       max_num_seqs=st.integers(1, 4), extra=st.integers(0, 6))
def test_identical_requests_finish_in_urgency_order(prios, prompt_len, max_tokens, bs, budget,
                                                    max_num_seqs, extra):
    "Same work, all arriving at once: no request finishes after a less urgent one."
    need = cdiv(prompt_len + max_tokens - 1, bs)
    sched = Scheduler(BlockManager(need + extra, bs), max(budget, max_num_seqs), max_num_seqs,
                      max_model_len=64)
    model = FakeModel(bs, 50)
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    seqs = [Sequence(i, [i + 1] * prompt_len, sp, priority=p) for i, p in enumerate(prios)]
    for s in seqs:
        sched.add(s)
    finished_at, step = {}, 0
    while sched.has_unfinished_requests():
        for s in _step(sched, model):
            finished_at[s.seq_id] = step
        step += 1
    # urgency: higher priority, then earlier arrival
    order = sorted(seqs, key=lambda s: s.urgency)
    assert [finished_at[s.seq_id] for s in order] == sorted(finished_at[s.seq_id] for s in order)
