"""The HTTP app in-process (FastAPI's TestClient) on a scripted engine that needs no model:
/health follows the engine thread; Qwen3's reasoning comes back apart from the answer, whole and
streamed, however the tags are cut across the engine's deltas."""
import json
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from petite_llm.serve.async_engine import StreamBacklogError
from petite_llm.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from petite_llm.serve.server import build_app

CONV = [{"role": "user", "content": "What is the capital of France?"}]


class ScriptedTokenizer:
    "Enough of a tokenizer for the chat route: any conversation is three tokens."
    # not byte-level: the server finds no character bound for its prompts (and needs none)
    backend = SimpleNamespace(normalizer=None, pre_tokenizer=None)

    def chat_ids(self, messages, tools=None, enable_thinking=None, **template_kwargs):
        if messages[-1]["role"] not in ("user", "assistant"):
            # as Tokenizer.chat_ids reports a template's raise_exception
            raise ValueError(f"the chat template failed: unknown role {messages[-1]['role']}")
        return [1, 2, 3]


class ScriptedEngine:
    "Stands in for AsyncLLMEngine: every request gets the same reply, one scripted delta a step."
    def __init__(self, deltas: list[str], running: bool = True, batch_invariant: bool = False,
                 no_grammars: str | None = None):
        self.deltas, self.is_running = deltas, running
        self.engine = SimpleNamespace(tokenizer=ScriptedTokenizer(), max_model_len=64, lora=None,
                                      config=SimpleNamespace(batch_invariant=batch_invariant),
                                      choices=SimpleNamespace(structured_outputs=no_grammars))

    async def generate(self, ids, params, request_id=None, **stream_limits):
        text, tokens = "", []
        for i, delta in enumerate(self.deltas):
            last = i == len(self.deltas) - 1
            text, tokens = text + delta, tokens + [10 + i]
            out = CompletionOutput(0, text=text, token_ids=list(tokens),
                                   finish_reason="stop" if last else None,
                                   delta_text=delta, delta_token_ids=[10 + i])
            yield RequestOutput(request_id, None, list(ids), [out], last, RequestMetrics(0.0))


def _client(deltas, running=True) -> TestClient:
    return TestClient(build_app(ScriptedEngine(deltas, running), "m"))



@pytest.mark.parametrize("batch_invariant", [False, True])
def test_models_card_says_whether_the_engine_is_batch_invariant(batch_invariant):
    "/v1/models: the one model, its max_model_len, and the engine's batch_invariant mode."
    engine = ScriptedEngine(["Paris"], batch_invariant=batch_invariant)
    cards = TestClient(build_app(engine, "m")).get("/v1/models").json()["data"]
    assert [(c["id"], c["max_model_len"], c["batch_invariant"]) for c in cards] == [
        ("m", 64, batch_invariant)]

@pytest.mark.parametrize("no_grammars", [None, "structured_outputs do not run with speculative"])
def test_models_card_says_whether_grammars_run(no_grammars):
    "/v1/models: structured_outputs is false where the engine refuses them (as with speculation)."
    engine = ScriptedEngine(["Paris"], no_grammars=no_grammars)
    card = TestClient(build_app(engine, "m")).get("/v1/models").json()["data"][0]
    assert card["structured_outputs"] is (no_grammars is None)

def test_health_follows_the_engine_thread():
    assert _client(["x"]).get("/health").status_code == 200
    r = _client(["x"], running=False).get("/health")
    assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"


# the tags cut across deltas, as tokens cut them
SPLIT_TAGS = ["<th", "ink>\nhm", "m\n</thi", "nk>\n\nPar", "is."]


@pytest.mark.parametrize("deltas, reasoning, content", [
    (SPLIT_TAGS, "\nhmm\n", "\n\nParis."),
    (["Paris", "."], None, "Paris."),
    (["<think>", "still thinking"], "still thinking", ""),
])
def test_chat_returns_reasoning_apart_whole_and_streamed(deltas, reasoning, content):
    client = _client(deltas)
    whole = client.post("/v1/chat/completions", json={"model": "m", "messages": CONV})
    message = whole.json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (reasoning, content)

    streamed = client.post("/v1/chat/completions",
                           json={"model": "m", "messages": CONV, "stream": True})
    events = [line.removeprefix("data: ") for line in streamed.text.splitlines()
              if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    deltas_out = [c["delta"] for c in chunks[1:]]          # the first carries only the role
    assert chunks[0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(d.get("reasoning_content") or "" for d in deltas_out) == (reasoning or "")
    assert "".join(d.get("content") or "" for d in deltas_out) == content
    assert not any("<think>" in (d.get("content") or "") for d in deltas_out)
    assert [c["finish_reason"] for c in chunks].count("stop") == 1


def test_a_failing_chat_template_is_a_400_on_messages():
    r = _client(["x"]).post("/v1/chat/completions",
                            json={"model": "m", "messages": [{"role": "tool", "content": "42"}]})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "messages"
    assert error["message"] == "the chat template failed: unknown role tool"


def test_an_unknown_role_is_a_400_naming_the_roles():
    "Refused before the template, which might skip the message and answer another conversation."
    r = _client(["x"]).post("/v1/chat/completions",
                            json={"model": "m", "messages": [{"role": "user", "content": "hi"},
                                                             {"role": "wizard", "content": "!"}]})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "messages[1].role"
    assert "'wizard'" in error["message"]
    assert "system, user, assistant, tool, developer" in error["message"]


def test_chat_template_kwargs_cannot_replace_the_messages():
    "A template kwarg named like one of chat_ids' own arguments is the client's error, a 400."
    r = _client(["x"]).post("/v1/chat/completions",
                            json={"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                  "chat_template_kwargs": {"messages": []}})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "chat_template_kwargs"
    assert "messages" in error["message"]


class LaggingEngine(ScriptedEngine):
    "A stream whose reader fell too far behind: one delta, then the slot's StreamBacklogError."
    async def generate(self, ids, params, request_id=None, **stream_limits):
        async for out in super().generate(ids, params, request_id):
            yield out
            raise StreamBacklogError("the reader left 99 tokens unread")


def test_a_stream_too_far_behind_ends_with_an_openai_error_event():
    "The 200 is sent, so the error comes as the stream's last event (the openai client raises it)."
    client = TestClient(build_app(LaggingEngine(["Par", "is"]), "m"))
    r = client.post("/v1/chat/completions", json={"model": "m", "messages": CONV, "stream": True})
    events = [line.removeprefix("data: ") for line in r.text.splitlines()
              if line.startswith("data: ")]
    assert json.loads(events[1])["choices"][0]["delta"]["content"] == "Par"
    error = json.loads(events[-1])["error"]
    assert error["code"] == "stream_backlog_exceeded" and "99 tokens unread" in error["message"]
    assert "[DONE]" not in events
