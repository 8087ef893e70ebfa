"""The server's limits, through a real server on 127.0.0.1 and the official `openai` client (raw
HTTP for the body limit): each refused with an OpenAI-shaped 4xx before any work, the server going
on; the character bound on prompts, checked on Qwen3's tokenizer; tokenizing off the event loop;
a stream left unread, aborted.

The app (`build_app` with small `ServerLimits`) runs under uvicorn in a thread of this process, on
a random-weight float32 Qwen3 (2 layers, hidden 32) with Qwen3's tokenizer, so the tests can reach
the engine's block manager. Every network wait has a timeout.
"""
import copy
import json
import re
import socket
import threading
import time

import httpx
import pytest
import torch
import uvicorn

from petite_llm.serve.async_engine import AsyncLLMEngine
from petite_llm.bench.serving import free_port
from petite_llm.engine.llm_engine import LLMEngine
from petite_llm.engine.paging import check_block_accounting
from petite_llm.serve.server import build_app
from petite_llm.serve.limits import (CHARS_PER_BYTE, ServerLimits, add_limit_args,
                                      limits_from_args, prompt_char_bound)
from petite_llm.model.tokenizer import Tokenizer
from test_server_http import MAX_LEN, NAME, write_checkpoint

openai = pytest.importorskip("openai")
qwen3_tokenizer = pytest.importorskip("qwen3_tokenizer")

LIMITS = ServerLimits(max_body_bytes=2**20, max_logprobs=5, max_n=4, stream_backlog_tokens=32,
                      stream_backlog_seconds=30.0)
pytestmark = pytest.mark.usefixtures("one_thread")


def serve(app) -> tuple[str, uvicorn.Server]:
    "Run app under uvicorn in a daemon thread; its base URL once it listens."
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}", server


def served_engine(path, limits: ServerLimits | None = None):
    "Yield (base URL, AsyncLLMEngine): a float32 tiny Qwen3 at path behind build_app's limits."
    write_checkpoint(path, torch.float32)
    engine = AsyncLLMEngine(LLMEngine.from_pretrained(
        path, dtype=torch.float32, device="cpu", max_model_len=MAX_LEN, kv_cache_memory=2**25))
    base, server = serve(build_app(engine, NAME, limits=limits))
    yield base, engine
    server.should_exit = True
    engine.shutdown()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    "(base URL, the AsyncLLMEngine): build_app(..., limits=LIMITS) served on 127.0.0.1."
    yield from served_engine(tmp_path_factory.mktemp("qwen3_f32"), LIMITS)


@pytest.fixture()
def client(served):
    return openai.OpenAI(base_url=f"{served[0]}/v1", api_key="none", max_retries=0, timeout=60)


def idle(base: str, timeout: float = 60.0) -> dict:
    "/metrics once nothing runs or waits and the KV pool is empty (fails after timeout s)."
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(f"{base}/metrics", timeout=10).text
        m = {line.split()[0]: float(line.split()[-1]) for line in text.splitlines()
             if line.startswith("petite_llm:")}
        now = [m[f"petite_llm:{k}"] for k in ("num_requests_running", "num_requests_waiting",
                                              "kv_cache_usage_perc")]
        if now == [0, 0, 0]:
            return m
        assert time.monotonic() < deadline, f"still busy: {now}"
        time.sleep(0.1)


def refused(call) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as e:
        call()
    assert set(e.value.body) >= {"message", "type", "param", "code"}
    return e.value


def test_logprobs_n_and_roles_over_their_limits_are_400s(served, client):
    ask = dict(model=NAME, prompt="Hello", max_tokens=2, temperature=0)
    e = refused(lambda: client.completions.create(**ask, logprobs=6))
    assert (e.status_code, e.body["param"]) == (400, "logprobs") and "0 to 5" in e.body["message"]
    e = refused(lambda: client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, logprobs=True,
        top_logprobs=6))
    assert (e.status_code, e.body["param"]) == (400, "top_logprobs")
    e = refused(lambda: client.completions.create(**ask, n=5))
    assert (e.status_code, e.body["param"]) == (400, "n") and "limit of 4" in e.body["message"]
    e = refused(lambda: client.chat.completions.create(
        model=NAME, max_tokens=2, messages=[{"role": "wizard", "content": "Hi"}]))
    assert (e.status_code, e.body["param"]) == (400, "messages[0].role")
    assert "system, user, assistant, tool, developer" in e.body["message"]
    # at the limits: served
    r = client.completions.create(**ask, logprobs=5, n=4)
    assert len(r.choices) == 4 and len(r.choices[0].logprobs.top_logprobs[0]) == 5
    r = client.chat.completions.create(model=NAME, max_tokens=2, messages=[
        {"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert r.usage.completion_tokens == 2
    idle(served[0])


def test_a_prompt_over_the_character_bound_is_refused_before_tokenizing(served, client):
    bound = prompt_char_bound(served[1].engine.tokenizer, MAX_LEN)
    e = refused(lambda: client.completions.create(model=NAME, prompt="x" * (bound + 1),
                                                  max_tokens=2))
    assert (e.status_code, e.body["param"]) == (400, "prompt")
    assert "shorten it" in e.body["message"]
    e = refused(lambda: client.chat.completions.create(
        model=NAME, max_tokens=2, messages=[{"role": "user", "content": "x" * (bound + 1)}]))
    assert e.status_code == 400 and "shorten it" in e.body["message"]
    # under the bound but over the context: the engine's own 400, once tokenized
    e = refused(lambda: client.completions.create(model=NAME, prompt="ocean " * 2000,
                                                  max_tokens=2))
    assert e.status_code == 400 and "max_model_len" in e.body["message"]


def _read_reply(s: socket.socket) -> tuple[str, str]:
    "A reply's head and its whole body (Content-Length bytes), however the packets split them."
    data = b""
    while b"\r\n\r\n" not in data and (chunk := s.recv(65536)):
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
    while len(body) < length and (chunk := s.recv(65536)):
        body += chunk
    return head.decode(), body.decode()


def test_the_body_limit_is_a_413_by_length_and_by_chunks(served):
    base = served[0]
    url, headers = f"{base}/v1/completions", {"Content-Type": "application/json"}
    big = json.dumps({"model": NAME, "prompt": "ocean " * 200_000, "max_tokens": 2}).encode()
    # the headers alone: a Content-Length over the limit is refused before a byte of body
    with socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1])), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nContent-Length: " + str(len(big)).encode() + b"\r\n\r\n")
        head, body = _read_reply(s)
    assert head.startswith("HTTP/1.1 413")
    assert "--max-body-bytes" in json.loads(body)["error"]["message"]
    # chunked: no length to check, so the bytes are counted as they come
    chunks = (big[i:i + 2**14] for i in range(0, len(big), 2**14))
    r = httpx.post(url, content=chunks, headers=headers, timeout=30)
    assert r.status_code == 413 and "--max-body-bytes" in r.json()["error"]["message"]
    # under the limit, chunked or not: served
    small = json.dumps({"model": NAME, "prompt": "Hello", "max_tokens": 2}).encode()
    for content in (small, iter([small[:10], small[10:]])):
        r = httpx.post(url, content=content, headers=headers, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


class BlockingBackend:
    "A tokenizers backend whose encode_batch waits until released (a stand-in for a slow prompt)."
    def __init__(self, backend):
        self.backend, self.entered, self.release = backend, threading.Event(), threading.Event()

    def encode_batch(self, texts, **kw):
        if texts[0].startswith("slow"):
            self.entered.set()
            assert self.release.wait(60), "never released"
        return self.backend.encode_batch(texts, **kw)

    def __getattr__(self, name):
        return getattr(self.backend, name)


def test_tokenizing_does_not_hold_the_event_loop(served):
    "While one prompt is being tokenized, another request is answered: an ordering, not a time."
    engine = served[1]
    tokenizer = engine.engine.tokenizer
    blocking = copy.copy(tokenizer)
    blocking.backend = BlockingBackend(tokenizer.backend)
    engine.engine.tokenizer = blocking
    try:
        base, server = serve(build_app(engine, NAME, limits=LIMITS))
    finally:
        engine.engine.tokenizer = tokenizer
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)
    done = []
    slow = threading.Thread(target=lambda: done.append(client.completions.create(
        model=NAME, prompt="slow prompt", max_tokens=2)))
    slow.start()
    try:
        assert blocking.backend.entered.wait(30)
        # the event loop is free: a whole completion is tokenized, generated and answered
        r = client.completions.create(model=NAME, prompt="quick", max_tokens=2)
        assert r.usage.completion_tokens == 2 and not done
    finally:
        blocking.backend.release.set()
        slow.join(60)
        server.should_exit = True
    assert done[0].usage.completion_tokens == 2


def test_a_stream_nobody_reads_is_aborted_and_frees_its_blocks(served, client):
    """A client that sends a streamed request and never reads: once the socket buffers are full (a
    few MB on loopback; 16 choices with 20 logprobs a token fill them) the server cannot send, its
    unread tokens pass the backlog, and the request is aborted; a client beside it is served."""
    engine = served[1]
    limits = ServerLimits(max_n=16, max_logprobs=20, stream_backlog_tokens=64)
    base, server = serve(build_app(engine, NAME, limits=limits))
    body = json.dumps({"model": NAME, "prompt": "Tell me", "max_tokens": 700, "n": 16,
                       "logprobs": 20, "stream": True, "ignore_eos": True}).encode()
    lone = client.completions.create(model=NAME, prompt="Hello", max_tokens=12, temperature=0)
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)   # before connect: a small window
    s.settimeout(60)
    try:
        s.connect(("127.0.0.1", int(base.rsplit(":", 1)[1])))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        beside = client.completions.create(model=NAME, prompt="Hello", max_tokens=12,
                                           temperature=0)
        assert beside.choices[0].text == lone.choices[0].text
        idle(base)                                        # aborted: nothing runs, no blocks held
        check_block_accounting(engine.engine.block_manager, [])
        received = b""
        while not received.endswith(b"0\r\n\r\n"):        # the end of the chunked response
            data = s.recv(1 << 20)
            if not data:
                break
            received += data
    finally:
        s.close()
        server.should_exit = True
    events = [line for line in received.decode(errors="replace").splitlines()
              if line.startswith("data: ")]
    assert "stream_backlog_exceeded" in events[-1] and "[DONE]" not in events[-1]
    # cut short: far fewer chunks (one per choice per token) than the 16 * 700 asked for
    assert len(events) - 1 < 16 * 700


def test_limit_flags_build_the_limits():
    parser = add_limit_args(__import__("argparse").ArgumentParser())
    assert limits_from_args(parser.parse_args([])) == ServerLimits()
    args = parser.parse_args(["--max-body-bytes", "100", "--max-logprobs", "3", "--max-n", "2",
                              "--stream-backlog-tokens", "7", "--stream-backlog-seconds", "1.5"])
    assert limits_from_args(args) == ServerLimits(100, 3, 2, 7, 1.5)
    with pytest.raises(ValueError, match="max_logprobs must be > 0"):
        limits_from_args(parser.parse_args(["--max-logprobs", "0"]))


def test_the_character_bound_holds_on_qwen3s_tokenizer():
    "No text over the bound fits in the tokens: the longest token over and over, composed accents."
    tok = Tokenizer.from_pretrained(qwen3_tokenizer.qwen3_tokenizer_dir())
    per_token = prompt_char_bound(tok, 1)            # characters per token, at most
    assert per_token == int(128 * CHARS_PER_BYTE["NFD"])      # Qwen3: NFC, 128 spaces a token
    texts = [" " * 128 * 50, "u\u0308\u0304" * 400, "\u1100\u1161\u11a8" * 300,
             "Hello, world! " * 100, "<|im_start|>" * 30]
    for text in texts:
        assert len(text) <= per_token * len(tok.encode(text)), text[:20]
    # the normalizer composes: three code points become one character, one token or two
    assert len(tok.encode("u\u0308\u0304")) <= 2


def test_no_bound_where_a_tokenizer_can_drop_text():
    from tokenizers import AddedToken, normalizers
    tok = Tokenizer.from_pretrained(qwen3_tokenizer.qwen3_tokenizer_dir())
    stripping = copy.deepcopy(tok)
    stripping.backend.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Strip()])
    assert prompt_char_bound(stripping, 100) is None
    swallowing = copy.deepcopy(tok)
    swallowing.backend.add_tokens([AddedToken("<sep>", lstrip=True)])
    assert prompt_char_bound(swallowing, 100) is None
