"""Structured outputs (chapter 22): every constrained output is accepted by its grammar, free
requests beside constrained ones keep their tokens, in every engine mode; refusals are clear."""
import json
import re

import jsonschema
import pytest
import torch
import xgrammar as xgr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from petite_llm.engine.llm_engine import LLM
from petite_llm.engine.structured import to_grammar
from petite_llm.model.sampling_params import SamplingParams, StructuredOutputsParams
from host_reads import HostReads
from test_server_http import write_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def qwen3_path(tmp_path_factory):
    "A random-weight Qwen3 (float64) with the real Qwen3 tokenizer: a grammar needs a real vocab."
    path = tmp_path_factory.mktemp("qwen3_structured")
    write_checkpoint(path)
    return path


_engines = {}

def engine(path, **options) -> LLM:
    "One LLM per set of options, kept for the module (hypothesis draws the same modes again)."
    key = (str(path), tuple(sorted(options.items())))
    if key not in _engines:
        _engines[key] = LLM(path, block_size=4, **options)
    return _engines[key]


MODES = {
    'default': dict(kv_cache_memory=64 * 2**20),
    'chunked': dict(kv_cache_memory=64 * 2**20, max_num_batched_tokens=16, max_num_seqs=16),
    'prefix': dict(kv_cache_memory=64 * 2**20, enable_prefix_caching=True),
    # a pool of 40 blocks of 4 tokens: running sequences are preempted and recomputed
    # (K and V, 2 layers, 4 tokens, 1 KV head of 16, float64: 2048 bytes a block)
    'preempt': dict(kv_cache_memory=40 * 2048, max_num_batched_tokens=32),
    'async': dict(kv_cache_memory=64 * 2**20, async_scheduling=True),
    'invariant': dict(kv_cache_memory=64 * 2**20, batch_invariant=True),
}

words = st.text(alphabet='abcdefgh xyz', min_size=1, max_size=6)
names = st.text(alphabet='abcdefgh', min_size=1, max_size=4)
leaf = st.one_of(
    st.just({'type': 'boolean'}),
    st.just({'type': 'integer', 'minimum': 0, 'maximum': 99}),
    st.builds(lambda n: {'type': 'string', 'maxLength': n}, st.integers(1, 4)),
    st.builds(lambda vs: {'enum': vs}, st.lists(names, min_size=1, max_size=3, unique=True)))
schemas = st.builds(
    lambda props, data: {'type': 'object', 'properties': props, 'additionalProperties': False,
                         'required': data.draw(st.lists(st.sampled_from(sorted(props)),
                                                        unique=True))},
    st.dictionaries(names, leaf, min_size=1, max_size=3), st.data())
specs = st.one_of(
    st.builds(lambda s: {'json': s}, schemas),
    st.just({'json_object': True}),
    st.builds(lambda r: {'regex': r}, st.sampled_from(
        [r'[a-z]{1,6}', r'(yes|no|maybe)', r'[0-9]{2,4}-[A-Z]{1,2}', r'\d+(\.\d{1,2})?'])),
    st.builds(lambda c: {'choice': c}, st.lists(words, min_size=1, max_size=4, unique=True)))


def _matcher(llm, spec) -> xgr.GrammarMatcher:
    "A fresh matcher of spec's grammar, from a compiler of its own (not the engine's cache)."
    info = llm.engine.structured.compile(spec).result().tokenizer_info
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    return xgr.GrammarMatcher(compiler.compile_grammar(to_grammar(spec)))


def check_output(llm, spec: StructuredOutputsParams, completion):
    "The grammar accepts every token; a completion that stopped is a whole sentence of it."
    matcher = _matcher(llm, spec)
    assert all(matcher.accept_token(t) for t in completion.token_ids), completion
    if completion.finish_reason != 'stop':
        assert completion.finish_reason == 'length'
        return
    assert matcher.is_terminated(), completion
    text = completion.text
    if spec.kind in ('json', 'json_object'):
        value = json.loads(text)
        assert isinstance(value, dict)
        jsonschema.validate(value, spec.json if spec.kind == 'json' else {'type': 'object'})
    elif spec.kind == 'regex':
        assert re.fullmatch(spec.regex, text), text
    else:
        assert text in spec.choice


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data(), mode=st.sampled_from(sorted(MODES)), n=st.sampled_from([1, 1, 2]),
       greedy=st.booleans())
def test_constrained_outputs_follow_their_grammar_and_free_ones_are_unchanged(
        qwen3_path, data, mode, n, greedy):
    "A drawn batch of constrained and free requests: grammars hold, free tokens as if alone."
    llm = engine(qwen3_path, **MODES[mode])
    num_free = data.draw(st.integers(1, 3), label='free')
    drawn = data.draw(st.lists(specs, min_size=1, max_size=3), label='specs')
    rng_prompts = data.draw(st.lists(st.lists(st.integers(0, 151000), min_size=1, max_size=12),
                                     min_size=num_free + len(drawn),
                                     max_size=num_free + len(drawn)), label='prompts')
    shared = rng_prompts[0][:3]          # some prompts share a prefix (prefix caching)
    prompts = [shared + p if i % 2 else p for i, p in enumerate(rng_prompts)]

    def params(i, spec=None):
        sampling = dict(temperature=0) if greedy else dict(temperature=1.0, top_k=50, seed=i)
        return SamplingParams(max_tokens=24, n=n, structured_outputs=spec, **sampling)

    free = [params(i) for i in range(num_free)]
    constrained = [params(num_free + i, spec) for i, spec in enumerate(drawn)]
    # free and constrained requests interleaved in one generate call
    order = sorted(range(len(prompts)), key=lambda i: (i % 2, i))
    all_params = free + constrained
    outs = llm.generate([prompts[i] for i in order], [all_params[i] for i in order],
                        use_tqdm=False)
    by_index = dict(zip(order, outs))
    alone = llm.generate(prompts[:num_free], free, use_tqdm=False)
    for i in range(num_free):
        assert [c.token_ids for c in by_index[i].outputs] == [c.token_ids for c in alone[i].outputs]
    for i, p in enumerate(constrained):
        for completion in by_index[num_free + i].outputs:
            check_output(llm, p.structured_outputs, completion)
    assert not llm.engine.has_unfinished_requests() and llm.engine.structured.waiting == []
    assert llm.stats.kv_blocks_used == 0


def test_a_grammar_that_ends_ends_the_request(qwen3_path):
    "ignore_eos does not make a finished grammar go on: the matcher's end is the request's."
    llm = engine(qwen3_path, **MODES['default'])
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                  structured_outputs={'choice': ['ok']}),
                       use_tqdm=False)[0]
    assert (out.outputs[0].text, out.finish_reason) == ('ok', 'stop')


def test_bad_specs_are_refused_when_added(qwen3_path):
    "A spec the grammar engine cannot compile is a ValueError at add_request, naming the problem."
    llm = engine(qwen3_path, **MODES['default'])
    for bad, words_ in [({'json': {'type': 'nonsense'}}, 'nonsense'), ({'regex': '(ab'}, 'paren'),
                        ({'grammar': 'root ::= rule'}, 'rule')]:
        with pytest.raises(ValueError, match=f'structured_outputs.*{words_}'):
            llm.engine.add_request([1, 2], SamplingParams(structured_outputs=bad))
    assert not llm.engine.has_unfinished_requests()


def test_abort_while_the_grammar_compiles(qwen3_path):
    "A request aborted before its grammar compiled never reaches the scheduler."
    llm = engine(qwen3_path, **MODES['default'])
    schema = {'type': 'object', 'properties': {f'p{i}': {'type': 'string', 'pattern': '[a-z]{3}'}
                                               for i in range(20)}}
    request_id = llm.engine.add_request([1, 2], SamplingParams(structured_outputs={'json': schema}))
    assert llm.engine.abort(request_id)
    outs = []
    while llm.engine.has_unfinished_requests():
        outs += llm.engine.step()
    assert [o.finish_reason for o in outs] == ['abort']
    assert llm.engine.structured.waiting == [] and not llm.engine.scheduler.seqs


def test_speculation_and_no_tokenizer_are_refused(qwen3_path):
    "Speculative decoding with a grammar, or a grammar without a tokenizer: a clear ValueError."
    spec = LLM(qwen3_path, block_size=4, kv_cache_memory=64 * 2**20,
               speculative_config={'method': 'ngram', 'num_speculative_tokens': 2})
    with pytest.raises(ValueError, match='speculative'):
        spec.generate([[1, 2]], SamplingParams(structured_outputs={'regex': 'a+'}), use_tqdm=False)
    bare = LLM(qwen3_path, block_size=4, kv_cache_memory=64 * 2**20)
    bare.engine.tokenizer = None          # as for a folder without one
    with pytest.raises(ValueError, match='tokenizer'):
        bare.generate([[1, 2]], SamplingParams(structured_outputs={'regex': 'a+'}), use_tqdm=False)


PERSON = {'type': 'object', 'required': ['name', 'age'], 'additionalProperties': False,
          'properties': {'name': {'type': 'string'}, 'age': {'type': 'integer'}}}

def test_smollm2_answers_in_the_schema_and_would_not_alone():
    "The default model: JSON that validates with the schema; without it, text json.loads refuses."
    from petite_llm.model.weights import smollm2_gguf_path
    llm = LLM(smollm2_gguf_path(), dtype='float32', kv_cache_memory=64 * 2**20)
    prompt = llm.tokenizer.chat_ids([{'role': 'user', 'content': 'Describe a person in JSON.'}])
    free = SamplingParams(temperature=0, max_tokens=60)
    constrained = SamplingParams(temperature=0, max_tokens=60, structured_outputs={'json': PERSON})
    alone, held = llm.generate([prompt, prompt], [free, constrained], use_tqdm=False)
    with pytest.raises(json.JSONDecodeError):
        json.loads(alone.outputs[0].text)
    assert held.finish_reason == 'stop'
    jsonschema.validate(json.loads(held.outputs[0].text), PERSON)


@pytest.mark.parametrize("greedy", [True, False])
def test_async_grammars_sample_the_serial_tokens(qwen3_path, greedy):
    "Async scheduling: a matcher takes its row's pending token, masks, rolls back: serial's tokens."
    specs = [{'json': PERSON}, {'regex': r'[0-9]{2,4}-[A-Z]{1,2}'},
             {'choice': ['yes', 'no', 'maybe']}, None]
    sampling = dict(temperature=0) if greedy else dict(temperature=1.0, top_k=50)
    params = [SamplingParams(max_tokens=20, seed=i, structured_outputs=spec, **sampling)
              for i, spec in enumerate(specs)]
    prompts = [[1, 2, 3], [7] * 9, [11, 12], [5, 6, 7, 8]]
    serial, overlapped = (engine(qwen3_path, **MODES[mode]).generate(prompts, params,
                                                                      use_tqdm=False)
                          for mode in ('default', 'async'))
    assert [o.outputs[0].token_ids for o in overlapped] == [o.outputs[0].token_ids for o in serial]
    for p, out in zip(params[:3], overlapped):
        check_output(engine(qwen3_path, **MODES['async']), p.structured_outputs, out.outputs[0])


# each setup a user asks for; ModelRunner.launch must read none of their tensors back
LAUNCH_SETUPS = {
    'greedy': dict(temperature=0),
    'qwen3': dict(temperature=0.6, top_k=20, top_p=0.95),
    'top_p': dict(temperature=0.8, top_p=0.9),
    'min_p': dict(temperature=1.0, min_p=0.05),
    'seeded': dict(temperature=1.0, seed=7),
    'penalties': dict(temperature=0.7, repetition_penalty=1.2, presence_penalty=0.5,
                      frequency_penalty=0.3),
    'min_tokens': dict(temperature=0.7, min_tokens=4),
    'logprobs': dict(temperature=0.6, top_k=20, top_p=0.95, logprobs=5),
    'json': dict(temperature=0.6, top_k=20, top_p=0.95, structured_outputs={'json': PERSON}),
}
# a Tensor's methods that read its values on the host (on a GPU each waits for the device)
READ_METHODS = ('tolist', 'item', 'cpu', 'numpy', '__int__', '__bool__', '__float__', '__index__')


@pytest.mark.parametrize("setup", sorted(LAUNCH_SETUPS))
def test_launch_reads_no_tensor_back(qwen3_path, monkeypatch, setup):
    "Async launch reads nothing back: no read op, no read method (but of prev's copy, a grammar's)."
    llm = engine(qwen3_path, **MODES['async'])
    runner, launch = llm.engine.runner, llm.engine.runner.launch
    found, allowed, overlapped = [], [], []
    for name in READ_METHODS:
        def recorded(self, *args, _name=name, _original=getattr(torch.Tensor, name), **kwargs):
            if allowed and self is not allowed[-1]:
                found.append(_name)
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, recorded)

    def recorded_launch(scheduled, prev=None):
        # prev's host copy: what a grammar's matcher reads, after this step's forward is queued
        allowed.append(None if prev is None else prev.host_token_ids)
        overlapped.append(prev is not None)
        try:
            with HostReads() as mode:
                return launch(scheduled, prev)
        finally:
            allowed.pop()
            found.extend(mode.found)
    monkeypatch.setattr(runner, 'launch', recorded_launch)
    params = SamplingParams(max_tokens=6, **LAUNCH_SETUPS[setup])
    llm.generate([[1, 2, 3], [4, 5, 6, 7, 8]], params, use_tqdm=False)
    assert found == [] and sum(overlapped) >= 4
