"""The OpenAI-compatible server over HTTP: `petite-llm serve` in a subprocess, driven by `openai`.

A random-weight Qwen3 (float64, so greedy ties cannot flip) with the real Qwen3 tokenizer, as in
test_engine.py's `qwen3_text`. The server runs as a subprocess on a free 127.0.0.1 port; the
reference is the synchronous engine (`LLM`) on the same folder and dtype, each prompt alone. Every
network wait has a timeout, and the subprocess is killed in the fixture's teardown.
"""
import asyncio
import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
import transformers

from petite_llm.bench.serving import free_port
from petite_llm.engine.llm_engine import LLM
from petite_llm.model.sampling_params import SamplingParams

openai = pytest.importorskip("openai")

KEY, NAME, MAX_LEN = "sk-test", "tiny-qwen3", 1024
CONV = [{"role": "user", "content": "Hi! What is the capital of France?"}]
NO_THINK = {"enable_thinking": False}


def write_checkpoint(path, dtype=torch.float64):
    "A random-weight Qwen3 (2 layers, hidden 32) in dtype, with Qwen3's tokenizer files."
    qwen3_tokenizer = pytest.importorskip("qwen3_tokenizer")
    try:
        qwen3_tokenizer.write_qwen3_tokenizer(path)
    except Exception as e:
        pytest.skip(f"no offline Qwen3 tokenizer here: {e}")
    cfg = transformers.Qwen3Config(
        vocab_size=151936, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=MAX_LEN,
        tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645, pad_token_id=0,
        initializer_range=0.5)
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(cfg).to(dtype).save_pretrained(path)


@contextlib.contextmanager
def serving(path, *options, timeout: float = 60):
    "`petite-llm serve path *options` in a subprocess: its base URL once /health answers."
    # killed on the way out, the tail of its log printed (pytest shows it when a test fails)
    port, log = free_port(), open(Path(path) / "server.log", "w+")
    main = "import sys; from petite_llm.cli.main import main; sys.exit(main())"
    cmd = [sys.executable, "-c", main, "serve", str(path), "--port", str(port), *options]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            assert proc.poll() is None, f"the server exited: {log.name}"
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"the server did not answer /health in {timeout} s"
            time.sleep(0.2)
        yield base
    finally:
        proc.kill()
        proc.wait(timeout=10)
        log.seek(0)
        print(log.read()[-3000:])
        log.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    "(base url, reference LLM): `petite-llm serve` running in a subprocess, killed at the end."
    path = tmp_path_factory.mktemp("qwen3_served")
    write_checkpoint(path)
    with serving(path, "--api-key", KEY, "--served-model-name", NAME, "--dtype", "float64",
                 "--device", "cpu", "--max-model-len", str(MAX_LEN),
                 "--log-level", "warning") as base:
        yield base, LLM(path, dtype=torch.float64, device="cpu", max_model_len=MAX_LEN)


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key=KEY, max_retries=0, timeout=30)


def _metric(base, name) -> float:
    "One value of /metrics."
    text = httpx.get(f"{base}/metrics", timeout=5).text
    return next(float(line.split()[-1]) for line in text.splitlines()
                if line.startswith(f"petite_llm:{name} "))


def _greedy(n=16, **kw):
    return SamplingParams(temperature=0, max_tokens=n, **kw)


def test_models_health_tokenize(server, client):
    base, llm = server
    assert [m.id for m in client.models.list().data] == [NAME]
    auth = {"Authorization": f"Bearer {KEY}"}
    t = httpx.post(f"{base}/tokenize", json={"model": NAME, "prompt": "Hello, world"},
                   headers=auth, timeout=5).json()
    assert t == {"tokens": llm.tokenizer.encode("Hello, world", add_special_tokens=True),
                 "count": len(t["tokens"]), "max_model_len": MAX_LEN}
    d = httpx.post(f"{base}/detokenize", json={"model": NAME, "tokens": t["tokens"]},
                   headers=auth, timeout=5).json()
    assert d == {"prompt": "Hello, world"}


def test_completion_greedy_usage_and_stream(server, client):
    "Greedy text == LLM.generate; exact usage; the stream adds up to it, finish_reason once."
    _, llm = server
    ref = llm.generate("Hello, world", _greedy(), use_tqdm=False)[0]
    r = client.completions.create(model=NAME, prompt="Hello, world", max_tokens=16, temperature=0)
    assert r.choices[0].text == ref.outputs[0].text
    assert r.choices[0].finish_reason == ref.outputs[0].finish_reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (
        len(ref.prompt_token_ids), len(ref.outputs[0].token_ids))
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    chunks = list(client.completions.create(model=NAME, prompt="Hello, world", max_tokens=16,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.outputs[0].text
    assert sum(c.choices[0].finish_reason is not None for c in chunks if c.choices) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage == r.usage


def test_chat_greedy_usage_and_stream(server, client):
    "Chat: text == LLM.chat, prompt tokens == the chat template's; streamed the same."
    _, llm = server
    ref = llm.chat(CONV, _greedy(), enable_thinking=False, use_tqdm=False)[0]
    template_ids = llm.tokenizer.apply_chat_template(CONV, enable_thinking=False, tokenize=True)
    r = client.chat.completions.create(model=NAME, messages=CONV, max_tokens=16, temperature=0,
                                       extra_body={"chat_template_kwargs": NO_THINK})
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.outputs[0].text
    assert r.usage.prompt_tokens == len(template_ids) == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref.outputs[0].token_ids)
    chunks = list(client.chat.completions.create(
        model=NAME, messages=CONV, max_completion_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"chat_template_kwargs": NO_THINK}))
    first = chunks[0].choices[0].delta
    assert (first.role, first.content) == ("assistant", "")
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.outputs[0].text
    assert sum(c.choices[0].finish_reason is not None for c in chunks if c.choices) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage == r.usage


def test_n_seed_stop_and_logprobs(server, client):
    "n=2 with a seed == LLM.generate's; a stop string never leaks; logprobs have the right sizes."
    _, llm = server
    sp = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=8)
    ref = llm.generate("The ocean", sp, use_tqdm=False)[0]
    r = client.completions.create(model=NAME, prompt="The ocean", n=2, temperature=0.8, seed=3,
                                  max_tokens=8)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [
        o.text for o in ref.outputs]
    assert r.usage.completion_tokens == sum(len(o.token_ids) for o in ref.outputs)
    # a stop string from the middle of the greedy text: cut there, in both shapes
    full = llm.generate("Hello, world", _greedy(24), use_tqdm=False)[0].outputs[0].text
    stop = next(full[i:i + 2] for i in range(len(full) // 2, len(full) - 1)
                if full[i:i + 2].strip() == full[i:i + 2])
    r = client.completions.create(model=NAME, prompt="Hello, world", max_tokens=24,
                                  temperature=0, stop=[stop])
    assert r.choices[0].text == full[:full.index(stop)] and r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=NAME, prompt="Hello, world", max_tokens=24, temperature=0, stop=stop, stream=True))
    assert streamed == full[:full.index(stop)] and stop not in streamed
    # logprobs: one entry per generated token
    r = client.completions.create(model=NAME, prompt="Hello, world", max_tokens=6,
                                  temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert all(1 <= len(top) <= 2 and v <= 0 for top, v in zip(lp.top_logprobs,
                                                                 lp.token_logprobs))
    assert "".join(lp.tokens) == r.choices[0].text
    r = client.chat.completions.create(model=NAME, messages=CONV, max_tokens=6, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob >= t.logprob - 1e-9
               for t in content)


def test_concurrent_streams_each_get_their_own_text(server):
    "64 concurrent streaming clients: each gets exactly the text its prompt gets alone."
    base, llm = server
    prompts = [f"Item {i}: the weather in city number {i * 7} is" for i in range(64)]
    alone = [llm.generate(p, _greedy(12), use_tqdm=False)[0].outputs[0].text for p in prompts]

    async def one(client, prompt):
        stream = await client.completions.create(model=NAME, prompt=prompt, max_tokens=12,
                                                 temperature=0, stream=True)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0,
                                      timeout=120) as client:
            return await asyncio.wait_for(
                asyncio.gather(*[one(client, p) for p in prompts]), 150)

    assert asyncio.run(main()) == alone


def test_disconnect_mid_stream_aborts(server, client):
    "A client that leaves mid-stream: nothing running and an empty KV pool soon after."
    base, _ = server
    finished_before = _metric(base, "e2e_request_latency_seconds_count")
    stream = client.completions.create(model=NAME, prompt="Tell me a story", max_tokens=1000,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    for _, _chunk in zip(range(3), stream):
        pass
    stream.close()
    deadline = time.monotonic() + 15
    while (_metric(base, "num_requests_running"), _metric(base, "kv_cache_usage_perc")) != (0, 0):
        assert time.monotonic() < deadline, "the disconnected request is still running"
        time.sleep(0.05)
    assert _metric(base, "num_requests_waiting") == 0
    # aborted, not finished: a finished request would be in the latency histogram
    assert _metric(base, "e2e_request_latency_seconds_count") == finished_before
    assert _metric(base, "generation_tokens_total") > 0


def test_disconnect_before_the_answer_aborts(server):
    "A non-streamed request whose client gives up: aborted, not run to its 1000 tokens."
    base, _ = server
    finished_before = _metric(base, "e2e_request_latency_seconds_count")
    body = {"model": NAME, "prompt": "Tell me a story", "max_tokens": 1000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base}/v1/completions", json=body, timeout=0.5,
                   headers={"Authorization": f"Bearer {KEY}"})
    deadline = time.monotonic() + 15
    while (_metric(base, "num_requests_running"), _metric(base, "kv_cache_usage_perc")) != (0, 0):
        assert time.monotonic() < deadline, "the abandoned request is still running"
        time.sleep(0.05)
    assert _metric(base, "e2e_request_latency_seconds_count") == finished_before


BAD = [  # (request fields, the openai exception, a piece of its message)
    (dict(prompt=5), openai.BadRequestError, "prompt"),
    (dict(max_tokens="many"), openai.BadRequestError, "max_tokens"),
    (dict(temperature=-1.0), openai.BadRequestError, "temperature"),
    (dict(top_p=0.0), openai.BadRequestError, "top_p"),
    (dict(max_tokens=10**6), openai.BadRequestError, "max_tokens=1000000 is too large"),
    (dict(prompt="ocean " * 1100), openai.BadRequestError, "max_model_len"),
    (dict(model="gpt-9"), openai.NotFoundError, "gpt-9"),
]


@pytest.mark.parametrize("bad,error,message", BAD, ids=[e[2][:12] for e in BAD])
def test_bad_requests_get_openai_errors(server, client, bad, error, message):
    "Each bad request: the right status, OpenAI's error shape; the next good request works."
    _, llm = server
    with pytest.raises(error) as e:
        client.completions.create(**{"model": NAME, "prompt": "Hi", "max_tokens": 4, **bad})
    assert message in e.value.body["message"] and e.value.body["type"]
    ref = llm.generate("Hi", _greedy(4), use_tqdm=False)[0].outputs[0].text
    ok = client.completions.create(model=NAME, prompt="Hi", max_tokens=4, temperature=0)
    assert ok.choices[0].text == ref


def test_malformed_json_and_api_keys(server, client):
    base, _ = server
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    r = httpx.post(f"{base}/v1/chat/completions", content=b'{"model": ', headers=headers,
                   timeout=5)
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(f"{base}/v1/completions", json={"model": NAME, "prompt": "Hi"}, timeout=5)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    wrong = openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0, timeout=10)
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model=NAME, messages=CONV, max_tokens=2)
    assert httpx.get(f"{base}/health", timeout=5).status_code == 200   # no key needed
    assert client.completions.create(model=NAME, prompt="Hi", max_tokens=2).usage.total_tokens


def test_load_generator_streams_every_request_with_its_tokens(server):
    "bench_serve.run_load: Poisson arrivals, a concurrency cap, exact lengths, ordered percentiles."
    from petite_llm.bench.serving import make_load, run_load, summarize
    base, llm = server
    load = make_load(llm.tokenizer, 12, 4, 24, seed=3)
    results, duration = asyncio.run(asyncio.wait_for(
        run_load(base, NAME, load, rate=50.0, max_concurrency=3, api_key=KEY, seed=3), 120))
    s = summarize(results, duration)
    assert (s["requests"], s["completed"], s["failed"], s["errors"]) == (12, 12, 0, [])
    assert [r.output_tokens for r in results] == [r.max_tokens for r in load]
    assert [r.prompt_tokens for r in results] == [r.prompt_tokens for r in load]
    assert s["output_tokens"] == s["output_tokens_expected"] == sum(r.max_tokens for r in load)
    for r in results:
        assert r.arrival <= r.sent < r.chunk_times[0] and r.chunk_times == sorted(r.chunk_times)
        assert r.chunk_times[-1] <= r.end
    # never more than max_concurrency requests between their sending and their end
    events = sorted([(r.sent, 1) for r in results] + [(r.end, -1) for r in results])
    in_flight = [sum(step for _, step in events[:i + 1]) for i in range(len(events))]
    assert max(in_flight) <= 3
    for name in ("ttft", "tpot", "itl", "e2e"):
        stats = s[f"{name}_ms"]
        assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"] and stats["mean"] > 0, name
    assert s["request_throughput"] > 0 and s["output_throughput"] > 0


def test_load_generator_records_failures(server):
    "A request the server refuses is counted as failed, with its error, not raised."
    from petite_llm.bench.serving import make_load, run_load, summarize
    base, llm = server
    load = make_load(llm.tokenizer, 2, 4, 8, seed=4)
    results, duration = asyncio.run(asyncio.wait_for(
        run_load(base, "gpt-9", load, api_key=KEY), 60))
    s = summarize(results, duration)
    assert (s["completed"], s["failed"]) == (0, 2) and "NotFoundError" in s["errors"][0]
    assert s["ttft_ms"] == {"mean": None, "p50": None, "p90": None, "p99": None}
