"""Tool calls through the real server on a model whose chat template shows the tools (chapter 17).

`petite-llm serve` runs in a subprocess on a random-weight Qwen3 (float64) with Qwen3's tokenizer
and chat template (test_server_http's `write_checkpoint`), driven by the `openai` client. Qwen3's
template lists the tools in the system message and renders past calls and tool results, so what a
user meets with `tool_choice="auto"` is: the tools in the prompt as the template renders them
(checked against transformers' rendering of the same conversation), the model's reply parsed for
`<tool_call>` blocks, a round trip of several calls accepted and rendered.

A random model does not write tool calls by itself. To make it write a given reply, the request
carries vLLM's `structured_outputs={"choice": [reply]}`: the engine decodes under a grammar of
exactly that text, token by token, as it decodes any constrained request. Everything after the
sampler is the path a real model's reply takes: detokenizing, the reasoning split, the hermes
parser, the streamed `delta.tool_calls`, `finish_reason`. (tests/doubles.py's FakeModel is the
scheduler's double, below the server; a hand-written reply fed to the parser skips the server.)
"""
import json

import jsonschema
import pytest
import transformers

from petite_llm.bench.serving import free_port, running_server, server_command
from test_server_http import write_checkpoint

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time now in a time zone.",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["CET"]}},
                   "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris and in Rome?"}]
CALLS = [("get_weather", {"city": "Paris", "unit": "celsius"}),
         ("get_weather", {"city": "Rome", "unit": "celsius"})]
# the reply a model that calls both writes, in the format Qwen3's template asks for
REPLY = "\n".join(f'<tool_call>\n{json.dumps(dict(name=n, arguments=a))}\n</tool_call>'
                  for n, a in CALLS)
WRITE_REPLY = {"structured_outputs": {"choice": [REPLY]}}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    "(base url, model name, checkpoint folder) of one server for the module."
    path = tmp_path_factory.mktemp("qwen3_tools")
    write_checkpoint(path)
    port = free_port()
    command, name = server_command('petite_llm', path, port, 'float64', 'cpu',
                                   ['--max-model-len', '1024'])
    with running_server(command, port, path / "server.log") as url:
        yield url, name, path


@pytest.fixture
def client(served):
    with openai.OpenAI(base_url=f"{served[0]}/v1", api_key="unused", max_retries=0,
                       timeout=600) as c:
        yield c


def rendered(path, messages, tools) -> list[int]:
    "transformers' token ids of the conversation under the checkpoint's chat template (oracle)."
    tok = transformers.AutoTokenizer.from_pretrained(path)
    text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                   tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def served_ids(served, messages, tools) -> list[int]:
    "The server's token ids of the conversation (POST /tokenize, as the chat endpoint renders it)."
    r = httpx.post(f"{served[0]}/tokenize", timeout=60,
                   json=dict(model=served[1], messages=messages, tools=tools))
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_tools_reach_the_prompt(client, served):
    "The tools are in the prompt as Qwen3's template renders them; the chat endpoint sends it."
    ids = served_ids(served, ASK, TOOLS)
    assert ids == rendered(served[2], ASK, TOOLS)
    assert len(ids) > len(rendered(served[2], ASK, None))
    r = client.chat.completions.create(model=served[1], messages=ASK, tools=TOOLS, max_tokens=2,
                                       temperature=0)
    assert r.usage.prompt_tokens == len(ids)


def check_calls(calls, expected):
    "calls (name, arguments text) are expected's, each valid for its tool; ids distinct."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == expected
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in calls:
        assert call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    assert len({c.id for c in calls}) == len(calls) and all(c.id for c in calls)


@pytest.mark.parametrize("parallel", [True, False])
def test_auto_parses_calls(client, served, parallel):
    "tool_choice auto: a reply of two calls is two tool_calls (parallel_tool_calls false: one)."
    r = client.chat.completions.create(model=served[1], messages=ASK, tools=TOOLS, max_tokens=200,
                                       temperature=0, parallel_tool_calls=parallel,
                                       extra_body=WRITE_REPLY)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    check_calls(choice.message.tool_calls, CALLS if parallel else CALLS[:1])


@pytest.mark.parametrize("parallel", [True, False])
def test_auto_streams_calls(client, served, parallel):
    "Streamed: each call opens with its index (0, 1, ...), id and name; its arguments follow."
    stream = client.chat.completions.create(model=served[1], messages=ASK, tools=TOOLS,
                                            max_tokens=200, temperature=0, stream=True,
                                            parallel_tool_calls=parallel, extra_body=WRITE_REPLY)
    opened, arguments, content, finish = [], {}, "", None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
        for call in delta.tool_calls or []:
            if call.id is not None:
                assert call.index == len(opened), "a call opens once, in index order"
                opened.append(call)
            arguments[call.index] = arguments.get(call.index, "") + call.function.arguments
    assert finish == "tool_calls" and content == ""
    for call in opened:
        call.function.arguments = arguments[call.index]
    check_calls(opened, CALLS if parallel else CALLS[:1])


@pytest.mark.parametrize("parallel", [True, False])
def test_required_calls(client, served, parallel):
    """required: calls that validate, one only when parallel_tool_calls is false. With parallel
    calls the grammar lets a model call again after each call, and a random one may never stop:
    then max_tokens ends it ('length') and the calls it finished are the reply's tool_calls."""
    r = client.chat.completions.create(model=served[1], messages=ASK, tools=TOOLS,
                                       tool_choice="required", max_tokens=200, temperature=0,
                                       parallel_tool_calls=parallel)
    choice = r.choices[0]
    calls = choice.message.tool_calls
    check_calls(calls, [(c.function.name, json.loads(c.function.arguments)) for c in calls])
    if parallel:
        assert len(calls) >= 1 and not choice.message.content
        assert choice.finish_reason == "tool_calls" or r.usage.completion_tokens == 200
    else:
        assert len(calls) == 1 and choice.finish_reason == "tool_calls"


def test_round_trip_two_calls(client, served):
    "Two calls, two role 'tool' results with their ids, the final answer: accepted and rendered."
    r = client.chat.completions.create(model=served[1], messages=ASK, tools=TOOLS, max_tokens=200,
                                       temperature=0, extra_body=WRITE_REPLY)
    message = r.choices[0].message
    results = [{"role": "tool", "tool_call_id": call.id,
                "content": json.dumps({"city": city, "temperature": t, "unit": "celsius"})}
               for call, (city, t) in zip(message.tool_calls, [("Paris", 21), ("Rome", 25)])]
    convo = ASK + [message.model_dump(exclude_none=True)] + results
    ids = served_ids(served, convo, TOOLS)
    assert ids == rendered(served[2], convo, TOOLS)
    final = client.chat.completions.create(model=served[1], messages=convo, tools=TOOLS,
                                           max_tokens=8, temperature=0)
    assert final.usage.prompt_tokens == len(ids)
    assert final.choices[0].finish_reason in ("stop", "length")
    assert not final.choices[0].message.tool_calls


@pytest.mark.parametrize("extra, param", [
    (dict(extra_body={"structured_outputs": {"regex": "("}}), "structured_outputs.regex"),
    (dict(extra_body={"structured_outputs": {"choice": ["a"], "regex": "a"}}),
     "structured_outputs"),
    (dict(extra_body={"structured_outputs": {"xml": "a"}}), "structured_outputs"),
    (dict(extra_body=WRITE_REPLY, response_format={"type": "json_object"}), "structured_outputs"),
    (dict(extra_body=WRITE_REPLY, tool_choice="required"), "tool_choice"),
])
def test_structured_outputs_refused(client, served, extra, param):
    "vLLM's structured_outputs: a bad spec, or one beside another shape, is a 400 naming it."
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=served[1], messages=ASK, tools=TOOLS, max_tokens=4,
                                       **extra)
    assert e.value.body["param"] == param, e.value.body
