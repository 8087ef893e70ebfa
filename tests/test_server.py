"""AsyncLLMEngine: streams at once equal the engine alone; slow readers, leaving, errors, shutdown.

A random-weight Qwen3 in float64 (random weights give near-ties that fp32 could flip), built with
transformers as in test_engine.py and saved without tokenizer files: prompts are token ids. The
reference is the synchronous engine (`LLM`) on each prompt alone, itself checked against
transformers in test_engine.py. Every test runs its coroutine with asyncio.run under
asyncio.wait_for, so a bug cannot hang the suite.
"""
import asyncio
import random
import time
from contextlib import aclosing

import pytest
import torch
import transformers

from petite_llm.engine.llm_engine import LLM, LLMEngine
from petite_llm.model.sampling_params import SamplingParams
from petite_llm.serve.async_engine import AsyncLLMEngine, StreamBacklogError

VOCAB, EOS = 300, 2


# tiny models: one torch thread (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    "A random-weight Qwen3 in float64 (2 layers, hidden 64, 4 q heads on 2 KV heads): its folder."
    path = tmp_path_factory.mktemp("qwen3_f64")
    cfg = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=EOS, pad_token_id=0,
        initializer_range=0.2)
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(cfg).to(torch.float64).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model(checkpoint):
    "Our float64 model of the checkpoint."
    return LLMEngine.from_pretrained(checkpoint, dtype=torch.float64, device='cpu').model


def _engine(model, **kwargs) -> AsyncLLMEngine:
    "An AsyncLLMEngine with small blocks and a small prefill budget (chunked, interleaved)."
    kw = dict(block_size=4, kv_cache_memory=2**22, max_model_len=128, max_num_batched_tokens=16)
    kw.update(kwargs)
    return AsyncLLMEngine(LLMEngine(model, **kw))


def _prompts(k=8, seed=0):
    "k prompts of 1 to 40 token ids."
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 40))] for _ in range(k)]


def _alone(model, prompts, params):
    "Each prompt generated alone by the synchronous engine: its final RequestOutput."
    llm = LLM(model, kv_cache_memory=2**22, max_model_len=128)
    return [llm.generate([p], sp, use_tqdm=False)[0] for p, sp in zip(prompts, params)]


def run(coro, timeout=20):
    "Run a coroutine in a fresh event loop, failing (not hanging) after timeout seconds."
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def _read(engine, prompt, params, delay=0.0, **kwargs):
    "All outputs of one stream (a reader that sleeps delay seconds after each)."
    outs = []
    async for out in engine.generate(prompt, params, **kwargs):
        outs.append(out)
        await asyncio.sleep(delay)
    return outs


def _joined(outs) -> list[int]:
    "The token ids a stream's deltas add up to."
    return [t for out in outs for t in out.outputs[0].delta_token_ids]


async def _until_idle(engine):
    "Wait until the engine holds no request and no KV block; its stats then."
    while True:
        stats = await engine.get_stats()
        if stats.kv_blocks_used == stats.num_running == stats.num_waiting == 0:
            return stats
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_concurrent_streams_equal_the_engine_alone(model, async_scheduling):
    "8 streams at once, mixed lengths and priorities: each gets its prompt's greedy tokens alone."
    prompts = _prompts()
    params = [SamplingParams(temperature=0, max_tokens=m) for m in (3, 9, 12, 5, 1, 16, 7, 10)]
    want = _alone(model, prompts, params)

    async def main():
        async with _engine(model, async_scheduling=async_scheduling) as engine:
            streams = await asyncio.gather(*(_read(engine, p, sp, priority=i % 3) for i, (p, sp)
                                             in enumerate(zip(prompts, params))))
            return streams, await _until_idle(engine)

    streams, stats = run(main())
    for i, (outs, ref) in enumerate(zip(streams, want)):
        assert outs[-1].token_ids == ref.token_ids, f"prompt {i}"
        assert _joined(outs) == ref.token_ids, f"prompt {i}: the deltas do not add up"
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        assert outs[-1].finish_reason == ref.finish_reason
    assert stats.num_generated_tokens == sum(len(r.token_ids) for r in want)



def test_batch_invariant_option_reaches_the_async_engine(checkpoint, model):
    "AsyncLLMEngine.from_pretrained(..., batch_invariant=True): chapter 21's layers, lone tokens."
    from petite_llm.engine.batch_invariant import BatchInvariantLinear
    prompts = _prompts(6, seed=1)
    params = [SamplingParams(temperature=0, max_tokens=m) for m in (4, 9, 2, 12, 6, 8)]
    want = _alone(model, prompts, params)

    async def main():
        async with AsyncLLMEngine.from_pretrained(
                checkpoint, dtype=torch.float64, device='cpu', batch_invariant=True,
                block_size=4, kv_cache_memory=2**22, max_model_len=128) as engine:
            inner = engine.engine
            assert inner.config.batch_invariant and inner.runner.backend.batch_invariant
            assert any(isinstance(m, BatchInvariantLinear) for m in inner.model.modules())
            return await asyncio.gather(*(_read(engine, p, sp) for p, sp in zip(prompts, params)))

    for i, (outs, ref) in enumerate(zip(run(main()), want)):
        assert outs[-1].token_ids == ref.token_ids, f"prompt {i}"

def test_a_slow_reader_gets_merged_deltas(model):
    "A reader away for the whole generation gets one merged output with everything it missed."
    prompt, sp = _prompts(1, seed=1)[0], SamplingParams(temperature=0, max_tokens=30,
                                                        ignore_eos=True)
    want = _alone(model, [prompt], [sp])[0]

    async def main():
        async with _engine(model) as engine:
            stream = engine.generate(prompt, sp)
            outs = [await anext(stream)]
            await _until_idle(engine)          # the rest is made while nobody reads
            outs += [out async for out in stream]
            # and a reader that sleeps after every output
            slow = await _read(engine, prompt, sp, delay=0.05)
            return outs, slow

    outs, slow = run(main())
    assert len(outs) <= 2 and outs[-1].finished
    assert _joined(outs) == outs[-1].token_ids == want.token_ids
    assert len(slow) < 30 and _joined(slow) == want.token_ids


def test_leaving_early_aborts_and_frees_blocks(model):
    "Cancel, break (with and without aclosing), aclose while adding, abort(): all free the pool."
    long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    prompt, sp = _prompts(1, seed=2)[0], SamplingParams(temperature=0, max_tokens=12)
    want = _alone(model, [prompt], [sp])[0]

    async def main():
        async with _engine(model) as engine:
            async def read_forever():
                async for _ in engine.generate([5, 6, 7], long):
                    pass
            task = asyncio.create_task(read_forever())
            while (await engine.get_stats()).num_generated_tokens < 2:
                await asyncio.sleep(0.005)
            assert (await engine.get_stats()).kv_blocks_used > 0
            task.cancel()
            await _until_idle(engine)
            async with aclosing(engine.generate([8, 9], long)) as stream:
                async for out in stream:
                    break
            await _until_idle(engine)
            async for out in engine.generate([10, 11], long):     # no aclosing: finalized later
                break
            await _until_idle(engine)
            for _ in range(5):        # cancelled while the engine thread adds it
                adding = asyncio.create_task(anext(engine.generate([12, 13], long)))
                await asyncio.sleep(0)
                adding.cancel()
                await _until_idle(engine)
            aborted = asyncio.create_task(_read(engine, [14, 15], long, request_id='x'))
            while (await engine.get_stats()).num_running == 0:
                await asyncio.sleep(0.005)
            assert await engine.abort('x') and not await engine.abort('unknown')
            outs = await aborted
            stats = await _until_idle(engine)
            return outs, stats, await _read(engine, prompt, sp)

    outs, stats, after = run(main())
    assert outs[-1].finished and outs[-1].finish_reason == 'abort' and len(outs[-1].token_ids) < 100
    assert stats.kv_blocks_used == 0
    assert after[-1].token_ids == want.token_ids


def test_a_reader_too_far_behind_is_aborted_and_the_others_go_on(model):
    """Past max_unread_tokens or max_unread_seconds of unread output, a stream's request is aborted
    (blocks freed) and its next take raises; a request that finishes within the bound is whole."""
    long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    prompt, sp = _prompts(1, seed=4)[0], SamplingParams(temperature=0, max_tokens=12)
    want = _alone(model, [prompt], [sp])[0]

    async def left_unread(engine, **bounds):
        "Take one output, wait until the engine has let the request go, take again."
        stream = engine.generate([5, 6, 7], long, **bounds)
        async with aclosing(stream):
            await anext(stream)
            while (await engine.get_stats()).num_running:
                await asyncio.sleep(0.01)
            return await anext(stream)

    async def main():
        async with _engine(model) as engine:
            errors = []
            for bounds in (dict(max_unread_tokens=8), dict(max_unread_seconds=0.01)):
                reader = asyncio.create_task(left_unread(engine, **bounds))
                beside = await _read(engine, prompt, sp)
                with pytest.raises(StreamBacklogError) as e:
                    await reader
                errors.append(str(e.value))
                assert _joined(beside) == want.token_ids
                assert (await _until_idle(engine)).kv_blocks_used == 0
            # unread until it finished: under the bound while it ran, so it is whole
            stream = engine.generate(prompt, sp, max_unread_tokens=len(want.token_ids))
            first = await anext(stream)
            await _until_idle(engine)
            return errors, [first] + [out async for out in stream]

    errors, outs = run(main())
    assert "tokens unread" in errors[0] and "read the stream as it comes" in errors[1]
    assert outs[-1].finished and _joined(outs) == want.token_ids


def test_errors_reach_the_caller_and_the_engine_goes_on(model):
    "add_request's ValueErrors rise from generate; the engine thread keeps serving."
    prompt, sp = _prompts(1, seed=3)[0], SamplingParams(temperature=0, max_tokens=10)
    want = _alone(model, [prompt], [sp])[0]

    async def main():
        async with _engine(model) as engine:
            with pytest.raises(ValueError, match="max_model_len=128"):
                await _read(engine, list(range(3, 203)), sp)
            with pytest.raises(ValueError, match="token ids"):
                await _read(engine, [VOCAB], sp)
            with pytest.raises(ValueError, match="stop strings need a tokenizer"):
                await _read(engine, [5], SamplingParams(stop=['x']))
            first = engine.generate([5, 6], SamplingParams(max_tokens=50), request_id='dup')
            await anext(first)
            with pytest.raises(ValueError, match="already in use"):
                await _read(engine, [7], sp, request_id='dup')
            await first.aclose()
            assert engine.is_running
            return await _read(engine, prompt, sp), await _until_idle(engine)

    outs, stats = run(main())
    assert outs[-1].token_ids == want.token_ids and stats.kv_blocks_used == 0


def test_idle_thread_sleeps_and_shutdown_joins(model):
    "No steps and little CPU while idle; shutdown joins the thread, open streams raise, work stops."
    sp = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)

    async def main():
        async with _engine(model) as engine:
            await _read(engine, [5, 6, 7], SamplingParams(temperature=0, max_tokens=3))
            steps, cpu = (await engine.get_stats()).num_steps, time.process_time()
            await asyncio.sleep(0.3)
            idle_cpu = time.process_time() - cpu
            assert (await engine.get_stats()).num_steps == steps
            stream = engine.generate([8, 9], sp)
            await anext(stream)
        assert not engine.is_running
        with pytest.raises(RuntimeError, match="shut down"):
            async for out in stream:          # what was made before shutdown, then the error
                assert not out.finished
        with pytest.raises(RuntimeError, match="shut down"):
            await _read(engine, [5], sp)
        return engine, idle_cpu

    engine, idle_cpu = run(main())
    assert idle_cpu < 0.1, f"the idle engine thread used {idle_cpu:.2f} s of CPU in 0.3 s"
    assert engine.engine.stats.kv_blocks_used == 0          # the thread is gone: safe to read
    engine.shutdown()                                        # twice is harmless


def test_a_failing_step_ends_every_stream_with_its_error(model):
    "A step that raises stops the thread; open streams and new requests raise instead of hanging."
    sp = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)

    def boom():
        raise MemoryError("out of KV memory")

    async def main():
        engine = _engine(model)
        stream = engine.generate([5, 6], sp)
        await anext(stream)
        engine.engine.step = boom             # the next step the thread takes raises
        with pytest.raises(RuntimeError, match="engine failed.*out of KV memory"):
            async for _ in stream:
                pass
        with pytest.raises(RuntimeError, match="engine failed"):
            await _read(engine, [5], sp)
        engine.shutdown(timeout=5)
        return engine

    assert not run(main()).is_running
