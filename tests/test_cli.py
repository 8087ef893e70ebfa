"""The petite-llm command: the demo answers, --help works, bad arguments exit 2 with a message."""
import io
import json
import os
import signal
import subprocess
import sys
import types
from contextlib import redirect_stderr, redirect_stdout

import pytest
import torch

from petite_llm.cli.main import BENCH_WORKLOADS, bench_modes, build_parser, main


def run(argv, stdin=None, monkeypatch=None):
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), err.getvalue()


def test_demo_answers_paris():
    code, out, err = run(['generate', '--chat', '--temperature', '0', '--max-tokens', '48',
                          'What is the capital of France?'])
    assert code == 0, err
    assert 'Paris' in out
    assert 'tok/s' in err and 'tokens' in err          # the summary line goes to stderr
    assert 'tok/s' not in out


@pytest.mark.parametrize('argv', [['--help'], ['generate', '--help'], ['chat', '--help'],
                                  ['bench', 'serve', '--help']])
def test_help(argv):
    code, out, _ = run(argv)
    assert code == 0 and 'usage: petite-llm' in out


def test_help_is_fast_and_works_as_a_script():
    script = 'import sys; from petite_llm.cli.main import main; sys.exit(main())'
    r = subprocess.run([sys.executable, '-c', script, '--help'],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0
    assert 'generate' in r.stdout and 'chat' in r.stdout and 'bench' in r.stdout


@pytest.mark.parametrize('argv,msg', [
    (['generate', '--max-tokens', 'lots', 'hi'], "invalid int value: 'lots'"),
    (['generate', '--dtype', 'int3', 'hi'], 'invalid choice'),
    (['frobnicate'], 'invalid choice'),
    ([], 'required'),
    (['generate', '--no-such-flag', 'hi'], 'unrecognized arguments'),
    (['generate', '--priority', 'high', 'hi'], 'expected comma-separated integers'),
    (['generate', '--explain', 'one', 'two'], '--explain narrates one generation'),
    (['generate', '--xray', 'one', 'two'], '--xray shows one forward pass'),
    (['generate', '--system', 'be nice', 'hi'], '--system only makes sense with --chat'),
    (['generate', '--attention-backend', 'flash', 'hi'], 'invalid choice'),
    (['generate', '--num-speculative-tokens', 'x', 'hi'], "invalid int value: 'x'"),
    (['generate', '--quantization', 'int4', 'hi'], 'invalid choice'),
])
def test_bad_arguments_exit_2(argv, msg):
    code, _, err = run(argv)
    assert code == 2 and msg in err, err


@pytest.mark.parametrize('argv,msg', [
    (['--temperature', '-0.5'], '--temperature must be a number >= 0'),
    (['--top-p', '0'], '--top-p must be in (0, 1]'),
    (['--top-k', '-3'], '--top-k must be'),
    (['--max-tokens', '0'], '--max-tokens must be an int >= 1'),
    (['--presence-penalty', '5'], '--presence-penalty must be in [-2, 2]'),
])
def test_invalid_sampling_values_exit_2(argv, msg):
    code, _, err = run(['generate', *argv, 'hi'])
    assert code == 2 and msg in err, err
    assert 'Traceback' not in err


def test_engine_config():
    "The model flags become one EngineConfig, with vLLM's speculative_config keys."
    from petite_llm.cli.runner import engine_config
    from petite_llm.engine.config import EngineConfig
    parse = build_parser().parse_args
    assert engine_config(parse(['generate', '--device', 'cpu', 'hi'])) == EngineConfig(
        device='cpu', attention_backend='auto', enforce_eager=False, enable_torch_compile=False,
        quantization=None)
    assert engine_config(parse(['chat', '--enable-torch-compile'])).enable_torch_compile
    assert engine_config(parse(['serve', '--async-scheduling'])).async_scheduling
    assert engine_config(parse(['serve', '--no-async-scheduling'])).async_scheduling is False
    assert engine_config(parse(['serve'])).async_scheduling is None     # the device decides
    assert engine_config(parse(['generate', '--quantization', 'int8', 'hi'])).quantization \
        == 'int8'
    assert engine_config(parse(['generate', '--dtype', 'float64', 'hi'])).dtype == torch.float64
    args = parse(['serve', '--attention-backend', 'torch', '--enforce-eager',
                  '--speculative', 'ngram', '--num-speculative-tokens', '3'])
    config = engine_config(args, max_model_len=64)
    assert config.attention_backend == 'torch' and config.enforce_eager
    assert config.max_model_len == 64
    assert config.speculative_config == dict(method='ngram', num_speculative_tokens=3,
                                             prompt_lookup_min=2, prompt_lookup_max=4)
    draft = engine_config(parse(['chat', '--speculative', '/models/draft']))
    assert draft.speculative_config == dict(method='draft_model', model='/models/draft',
                                            num_speculative_tokens=4)



@pytest.mark.parametrize('command', [['generate', 'hi'], ['chat'], ['serve']])
def test_batch_invariant_flag_reaches_the_engine_config(command):
    "--batch-invariant on every model command sets EngineConfig.batch_invariant; off by default."
    from petite_llm.cli.runner import engine_config
    parse = build_parser().parse_args
    assert engine_config(parse([*command, '--batch-invariant'])).batch_invariant
    assert not engine_config(parse(command)).batch_invariant
    with pytest.raises(ValueError, match='enable_torch_compile'):
        engine_config(parse([*command, '--batch-invariant', '--enable-torch-compile']))

def test_serve_limit_flags():
    "`petite-llm serve` takes chapter 17's limits; a bad one is a clear error, not a server."
    from petite_llm.serve.limits import ServerLimits, limits_from_args
    parse = build_parser().parse_args
    assert limits_from_args(parse(['serve'])) == ServerLimits()
    limits = limits_from_args(parse(['serve', '--max-n', '4', '--max-logprobs', '5']))
    assert (limits.max_n, limits.max_logprobs) == (4, 5)
    err = io.StringIO()
    with redirect_stderr(err):
        assert main(['serve', 'no-such-model', '--max-n', '0']) == 1
    assert 'max_n must be > 0' in err.getvalue()


def test_speculative_flag_keeps_greedy_text():
    "--speculative ngram on the real model: the same greedy text; a bad k is a clear error."
    prompt = ['generate', '--temperature', '0', '--max-tokens', '24',
              'Repeat exactly: the cat sat on the mat, the cat sat on the mat.']
    code, plain, err = run(prompt)
    assert code == 0, err
    code, spec, err = run(prompt[:1] + ['--speculative', 'ngram'] + prompt[1:])
    assert code == 0, err
    assert spec == plain
    # refused before any model loads: a model that does not exist is not even looked for
    code, _, err = run(prompt[:1] + ['--speculative', 'ngram', '--num-speculative-tokens', '0',
                                     '--model', 'no/such-model'] + prompt[1:])
    assert code == 1 and 'num_speculative_tokens must be an int >= 1' in err, err


def test_missing_model_is_a_clear_error(tmp_path):
    code, _, err = run(['generate', '--model', str(tmp_path / 'nope'), 'hi'])
    assert code == 1 and 'error' in err and 'Traceback' not in err


def test_parser_has_the_subcommands():
    p = build_parser()
    a = p.parse_args(['generate', '--chat', '--seed', '3', '--stop', 'x', '--stop', 'y', 'a', 'b'])
    assert a.prompt == ['a', 'b'] and a.stop == ['x', 'y'] and a.seed == 3 and a.chat
    assert p.parse_args(['bench', '--quick', '--out', 'x']).args == ['--quick', '--out', 'x']
    assert p.parse_args(['bench', 'serve', '--requests', '3']).args == ['serve', '--requests', '3']
    a = p.parse_args(['top', '--url', 'http://h:1', '--interval', '0.5', '--once'])
    assert a.url == 'http://h:1' and a.interval == 0.5 and a.once and a.api_key is None


class FakeRunner:
    "Stands in for the model: scripted replies; a '!' in a reply sends SIGINT (Ctrl-C) there."
    model_name, device, generation_config = 'fake', 'cpu', {}

    def __init__(self, replies):
        self.replies, self.conversations = list(replies), []
        self.tokenizer = types.SimpleNamespace(chat_ids=self.chat_ids)

    def chat_ids(self, messages, **kw):
        self.conversations.append([dict(m) for m in messages])
        return [1, 2, 3]

    def stream(self, prompt, params, priority=0):
        from petite_llm.model.generate import GenerationResult, GenerationStream
        reply = self.replies.pop(0)

        def steps():
            for ch in reply:
                if ch == '!':
                    os.kill(os.getpid(), signal.SIGINT)   # the user presses Ctrl-C mid-reply
                else:
                    yield ch
            return GenerationResult(reply, [7] * len(reply), 'stop', prompt, elapsed=0.5,
                                    time_to_first_token=0.1)
        return GenerationStream(steps())


def test_chat_repl_history_think_and_ctrl_c(monkeypatch):
    import petite_llm.cli.main as cli
    fake = FakeRunner(['<think>pondering</think>Paris.', 'Lyon is big!ger', 'Hi.'])
    monkeypatch.setattr(cli, '_load', lambda args: fake)
    monkeypatch.setattr('sys.stdin', io.StringIO('capital?\nsecond city?\n/reset\nhello\n'))
    # the handler this process started with: Python's, or SIG_IGN for a job started in the
    # background of a non-interactive shell
    started_with = signal.getsignal(signal.SIGINT)
    code, out, err = run(['chat', '--temperature', '0'])
    assert code == 0
    # not a terminal: reasoning shown between its tags
    assert '<think>pondering</think>Paris.' in out
    # Ctrl-C ended the reply, not the REPL
    assert 'Lyon is big' in out and 'ger' not in out and '[stopped]' in err
    # and Ctrl-C does again what it did before the REPL
    assert signal.getsignal(signal.SIGINT) is started_with
    c1, c2, c3 = fake.conversations
    assert c1 == [{'role': 'user', 'content': 'capital?'}]
    # the reasoning is not kept in the history
    assert c2[1] == {'role': 'assistant', 'content': 'Paris.'}
    assert c2[2:] == [{'role': 'user', 'content': 'second city?'}]
    assert c3 == [{'role': 'user', 'content': 'hello'}]             # /reset forgot the conversation
    assert 'tok/s' in err


def test_explain_lines():
    from petite_llm.cli.explain import explain_lines
    from petite_llm.model.generate import GenerationResult

    class Tok:
        def __len__(self):
            return 100

        def decode(self, ids, skip_special_tokens=True):
            return ''.join(f'<{i}>' for i in ids)
    lps = [{5: -0.1, 6: -2.5, 7: -3.0},
           {9: -0.5, 8: -1.2, 3: -2.0, 4: -2.2, 2: -3.0, 1: -4.0, 42: -9.0}]
    r = GenerationResult('x', [5, 42], 'length', [1, 2, 3], logprobs=lps)
    text = '\n'.join(explain_lines(Tok(), r))
    assert 'The prompt is 3 tokens' in text and 'step 1 (after the prefill)' in text
    assert "after reading '<5>'" in text
    assert "-> " in text and '90.48%' in text       # exp(-0.1), the chosen token of step 1
    step2 = text.split('step 2')[1]
    # the top 5, plus the chosen one from outside them
    assert "'<42>'" in step2 and "'<1>'" not in step2


@pytest.fixture(scope='module')
def loaded():
    "One engine on the default model, shared by the tests below (loading is most of their time)."
    import petite_llm.cli.main as cli
    return cli.Runner(cli.default_model(), cli.engine_config(build_parser().parse_args(['chat'])))


@pytest.fixture
def shared_runner(monkeypatch, loaded):
    import petite_llm.cli.main as cli
    monkeypatch.setattr(cli, '_load', lambda args: loaded)


def test_several_prompts_batched_with_priorities(shared_runner):
    code, out, err = run(['generate', '--chat', '--temperature', '0', '--max-tokens', '12',
                          '--priority', '0,5',
                          'What is the capital of France?', 'What is the capital of Italy?'])
    assert code == 0, err
    assert '=== [0] What is the capital of France?' in out
    assert '=== [1] What is the capital of Italy?' in out
    assert 'Paris' in out.split('=== [1]')[0]


def test_priority_needs_one_value_per_prompt():
    code, _, err = run(['generate', '--priority', '1,2', 'only one prompt'])
    assert code == 2 and '--priority needs one value per prompt' in err


@pytest.mark.slow
def test_no_cache_loop_answers_too():
    code, out, err = run(['generate', '--no-cache', '--chat', '--temperature', '0',
                          '--max-tokens', '48', 'What is the capital of France?'])
    assert code == 0 and 'Paris' in out, err


def test_explain_through_the_engine(shared_runner):
    code, out, err = run(['generate', '--chat', '--temperature', '0', '--max-tokens', '4',
                          '--explain', 'What is the capital of France?'])
    assert code == 0, err
    assert 'The prompt is' in out and 'Prefill' in out and 'step 4' in out and out.count('->') == 4


def test_xray_through_the_engine(shared_runner):
    "--xray prints the prompt's forward pass, module by module, then generates as usual."
    code, out, err = run(['generate', '--temperature', '0', '--max-tokens', '4', '--xray',
                          'The capital of France is'])
    assert code == 0, err
    xray, text = out.split('\n\n', 1)
    assert xray.startswith('one forward pass over ') and 'model.layers.0.mlp.down_proj' in xray
    assert 'model.layers.1.' not in xray and 'repeat layer 0' in xray
    assert text.strip()


# --- petite-llm top ---------------------------------------------------------------------------

METRICS_TEXT = """\
# HELP petite_llm:num_requests_running Requests running
# TYPE petite_llm:num_requests_running gauge
petite_llm:num_requests_running 4.0
# HELP petite_llm:num_requests_waiting Requests waiting
# TYPE petite_llm:num_requests_waiting gauge
petite_llm:num_requests_waiting 2.0
# HELP petite_llm:kv_cache_usage_perc Fraction of KV blocks used (0-1)
# TYPE petite_llm:kv_cache_usage_perc gauge
petite_llm:kv_cache_usage_perc 0.625
# HELP petite_llm:prefix_cache_hit_rate Prefix cache hit rate (0-1)
# TYPE petite_llm:prefix_cache_hit_rate gauge
petite_llm:prefix_cache_hit_rate 0.5
# HELP petite_llm:num_preemptions_total Preemptions
# TYPE petite_llm:num_preemptions_total counter
petite_llm:num_preemptions_total 7.0
# HELP petite_llm:prompt_tokens_total Prompt tokens of finished requests
# TYPE petite_llm:prompt_tokens_total counter
petite_llm:prompt_tokens_total 1234.0
# HELP petite_llm:generation_tokens_total Generated tokens of finished requests
# TYPE petite_llm:generation_tokens_total counter
petite_llm:generation_tokens_total 567.0
# HELP petite_llm:time_to_first_token_seconds Time to first token
# TYPE petite_llm:time_to_first_token_seconds histogram
petite_llm:time_to_first_token_seconds_bucket{le="0.01"} 0.0
petite_llm:time_to_first_token_seconds_bucket{le="0.02"} 20.0
petite_llm:time_to_first_token_seconds_bucket{le="0.05"} 60.0
petite_llm:time_to_first_token_seconds_bucket{le="0.1"} 100.0
petite_llm:time_to_first_token_seconds_bucket{le="+Inf"} 100.0
petite_llm:time_to_first_token_seconds_count 100.0
petite_llm:time_to_first_token_seconds_sum 4.0
"""


def test_parse_metrics_and_quantiles():
    import math
    from petite_llm.cli.top import histogram_quantile
    from petite_llm.serve.metrics import parse_metrics
    m = parse_metrics(METRICS_TEXT)
    assert m['petite_llm:num_requests_running'] == 4
    assert m['petite_llm:kv_cache_usage_perc'] == 0.625
    assert m['petite_llm:prompt_tokens_total'] == 1234
    h = m['petite_llm:time_to_first_token_seconds']
    assert h['count'] == 100 and h['sum'] == 4.0
    assert h['buckets'][:2] == [(0.01, 0.0), (0.02, 20.0)] and math.isinf(h['buckets'][-1][0])
    b = h['buckets']
    # p50: rank 50 lies in (0.02, 0.05], 30 of its 40 -> 0.02 + 0.03 * 30/40 = 0.0425
    assert math.isclose(histogram_quantile(b, 0.5), 0.0425)
    # p90: rank 90 in (0.05, 0.1], 30 of 40 -> 0.05 + 0.05 * 0.75 = 0.0875
    assert math.isclose(histogram_quantile(b, 0.9), 0.0875)
    # p10: rank 10 in (0.01, 0.02], 10 of 20 -> 0.015
    assert math.isclose(histogram_quantile(b, 0.1), 0.015)
    # p99 when only the +Inf bucket holds it: the highest finite bound
    assert histogram_quantile([(0.1, 1.0), (math.inf, 100.0)], 0.99) == 0.1
    assert math.isnan(histogram_quantile([(0.1, 0.0), (math.inf, 0.0)], 0.5))


def test_top_once_against_a_local_server():
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = METRICS_TEXT.encode() if self.path == '/metrics' else b''
            self.send_response(200 if body else 404)
            self.send_header('Content-Type', 'text/plain; version=0.0.4')
            self.send_header('Content-Length', str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(('127.0.0.1', 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f'http://127.0.0.1:{server.server_address[1]}'
        code, out, err = run(['top', '--once', '--url', url])
    finally:
        server.shutdown()
        server.server_close()
    assert code == 0, err
    assert '4 running, 2 waiting' in out and '62.5%' in out and '50.0%' in out
    assert '42.5 ms' in out and '87.5 ms' in out and '(100 requests)' in out


def test_top_unreachable_server_is_a_clear_error():
    code, out, err = run(['top', '--once', '--url', 'http://127.0.0.1:1'])
    assert code == 1
    assert 'petite-llm top: error: cannot read http://127.0.0.1:1/metrics' in err
    assert err.count('\n') == 1 and 'Traceback' not in err


def test_json_schema_and_regex_shape_the_answer(tmp_path):
    "--json-schema FILE: JSON that follows it; --regex: text it matches; not both; no file: exit 2."
    schema = tmp_path / 'city.json'
    schema.write_text(json.dumps({'type': 'object', 'required': ['city'],
                                  'properties': {'city': {'type': 'string'}}}))
    code, out, err = run(['generate', '--chat', '--temperature', '0', '--max-tokens', '30',
                          '--json-schema', str(schema), 'What is the capital of France?'])
    assert code == 0, err
    assert isinstance(json.loads(out)['city'], str)
    code, out, err = run(['generate', '--temperature', '0', '--max-tokens', '8',
                          '--regex', '(yes|no)', 'Is water wet?'])
    assert code == 0 and out.strip() in ('yes', 'no'), (out, err)
    code, _, err = run(['generate', '--json-schema', str(schema), '--regex', 'a', 'hi'])
    assert code == 2 and 'not allowed with' in err
    code, _, err = run(['generate', '--json-schema', str(tmp_path / 'none.json'), 'hi'])
    assert code == 2 and '--json-schema' in err


def test_the_help_names_every_bench_workload():
    "BENCH_WORKLOADS, which the help texts list, are the modes `petite-llm bench` runs."
    assert set(bench_modes()) == {'', *BENCH_WORKLOADS}
