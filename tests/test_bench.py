"""`petite-llm bench`: the quick run produces every figure; its helpers agree with transformers.

No timing is asserted anywhere: timings depend on the machine and its load."""
import argparse, json, math

import pytest
import torch
from transformers import AutoModelForCausalLM

from petite_llm.bench.offline import (add_arguments, linear_shapes, packed_linear_available, run,
                              weight_bytes)
from petite_llm.bench.peers import (SHAPES, as_dtype, dtype_name, make_random_checkpoint,
                                    make_requests, shape_config)


def _parse(*argv):
    return add_arguments(argparse.ArgumentParser(prog='petite-llm bench')).parse_args(list(argv))


def test_help_lists_every_option():
    h = add_arguments(argparse.ArgumentParser(prog='petite-llm bench')).format_help()
    for opt in ('--quick', '--out', '--layers', '--threads', '--dtype', '--requests', '--shape',
                '--model', '--only'):
        assert opt in h


# the 8B shape would write 2.5 GB even at one layer: its count is checked against Qwen's own below;
# the MoE shapes (experts are no nn.Linear) in test_bench_moe.py
@pytest.mark.parametrize('shape', sorted(s for s in SHAPES
                                         if s != 'qwen3-8b' and 'num_experts' not in SHAPES[s]))
def test_checkpoint_has_the_shape_and_linear_shapes_count_its_linears(tmp_path, shape):
    path = make_random_checkpoint(tmp_path/'ck', shape=shape, num_layers=1)
    # transformers reads it back: the shape is the one asked for
    model = AutoModelForCausalLM.from_pretrained(path)
    cfg = shape_config(shape, num_layers=1)
    for k in ('hidden_size', 'intermediate_size', 'num_attention_heads', 'num_key_value_heads',
              'head_dim', 'vocab_size'):
        assert getattr(model.config, k) == cfg[k]
    assert model.config.num_hidden_layers == 1 and model.config.tie_word_embeddings
    assert model.dtype == torch.bfloat16
    # every nn.Linear transformers runs per token, counted by the bound's shape list
    n_linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert sum(o * i for o, i in linear_shapes(cfg)) == n_linear
    assert weight_bytes(cfg, torch.bfloat16) == 2 * n_linear


def test_full_shape_is_qwen3_06b_bytes():
    assert abs(weight_bytes(shape_config('qwen3-0.6b')) / 1e9 - 1.19) < 0.01


def test_8b_shape_has_qwen3_8b_parameters():
    "Qwen3-8B's model card: 6.95B parameters besides the embedding (the lm_head, untied, is extra)."
    cfg = shape_config('qwen3-8b')
    non_embedding = weight_bytes(cfg) / 2 - cfg['vocab_size'] * cfg['hidden_size']
    assert abs(non_embedding / 1e9 - 6.95) < 0.01 and not cfg['tie_word_embeddings']


def test_requests_are_seeded_and_in_range():
    r = make_requests(20, 5, 9, 100, seed=3)
    assert r == make_requests(20, 5, 9, 100, seed=3)
    assert all(5 <= len(p) <= 9 and 5 <= n <= 9 and all(0 <= t < 100 for t in p) for p, n in r)


def test_quick_run_prints_json_and_writes_outputs(tmp_path, capsys):
    res = run(_parse('--quick', '--out', str(tmp_path)))
    printed = json.loads(capsys.readouterr().out)  # stdout is pure JSON
    assert printed == json.loads(json.dumps(res))
    assert json.loads((tmp_path/'bench.json').read_text()) == printed
    assert (tmp_path/'bench_tok_s.png').stat().st_size > 0
    for k in ('shape', 'dtype', 'threads', 'torch', 'lengths', 'linear_bound', 'petite_llm',
              'transformers', 'ratios'):
        assert k in res
    assert res['dtype'] == 'bfloat16' and res['threads'] >= 1
    for engine in ('petite_llm', 'transformers'):
        for k in ('prefill_tok_s', 'decode_tok_s', 'offline_tok_s'):
            assert math.isfinite(res[engine][k]) and res[engine][k] > 0
    assert res['transformers']['batch_size'] in (1, 4, 8, 16)
    assert set(res['transformers']['batch_size_tok_s']) == {1, 4, 8, 16}
    assert res['linear_bound']['tok_s'] > 0 and res['memory_read_gb_s'] > 0
    if packed_linear_available(torch.bfloat16):
        assert res['linear_bound_packed']['tok_s'] > 0
    for k in ('prefill_vs_transformers', 'decode_vs_transformers', 'offline_vs_transformers',
              'decode_vs_linear_bound'):
        assert res['ratios'][k] > 0
    assert res['lengths']['offline_output_tokens'] == res['petite_llm']['offline_output_tokens']
    # the engine's own figures come with the throughput, each beside its goal
    assert res['engine']['launches_per_layer']['triton'] > 0
    for k in ('launches_per_layer', 'host_us_per_seq_step', 'host_us_per_seq_step_qwen3',
              'host_ms_lone_step'):
        assert res['engine'][k]['goal'] > 0


def test_only_the_engines_own_figures_in_seconds(tmp_path, capsys):
    res = run(_parse('--only', 'host', '--out', str(tmp_path)))
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(res))
    assert set(res) == {'engine'} and 'launches_per_layer' not in res['engine']
    assert res['engine']['host_us_per_seq_step']['batch'] == 256
    # the user's path beside LLM.generate's: Qwen3's own sampling, streamed
    assert res['engine']['host_us_per_seq_step_qwen3']['detail']['sampling'] == 'qwen3'
    assert res['engine']['host_ms_lone_step']['value'] > 0
    assert not (tmp_path/'bench.json').exists()     # a saved throughput run is left alone
    assert json.loads((tmp_path/'bench_engine.json').read_text()) == json.loads(json.dumps(res))
    with pytest.raises(ValueError, match='unknown --only'):
        run(_parse('--only', 'host,speed'))


def test_bad_arguments_raise_clear_errors():
    from petite_llm.bench.offline import run_benchmark
    with pytest.raises(ValueError, match='unknown shape'):
        shape_config('qwen3-7b')
    with pytest.raises(ValueError, match='decode_tokens'):
        run_benchmark(quick=True, decode_tokens=1)
    with pytest.raises(ValueError, match='unknown engines'):
        run_benchmark(quick=True, engines=('vllm',))


def test_dtypes_come_from_the_one_table():
    "as_dtype reads petite_llm.model.config's table (any spelling) and refuses None and 'auto'."
    assert as_dtype('BF16') is torch.bfloat16 and as_dtype('torch.float16') is torch.float16
    assert as_dtype(torch.float32) is torch.float32 and dtype_name('fp64') == 'float64'
    for bad in (None, 'auto'):
        with pytest.raises(ValueError, match='explicit dtype'):
            as_dtype(bad)
    with pytest.raises(ValueError, match='unknown dtype'):
        as_dtype('int3')


class FakeDevice:
    "An asynchronous device: launches queue work that runs only when the host waits for it."
    def __init__(self):
        self.now, self.queued = 0.0, 0.0

    def clock(self) -> float:
        return self.now                  # host code takes no time on this clock

    def launch(self, seconds: float):
        self.queued += seconds

    def synchronize(self):
        self.now, self.queued = self.now + self.queued, 0.0


@pytest.fixture(scope='module')
def tiny_engine_factory(tmp_path_factory):
    from petite_llm.engine.llm_engine import LLM
    from petite_llm.model.sampling_params import SamplingParams
    path = make_random_checkpoint(tmp_path_factory.mktemp('ck'), shape='tiny', num_layers=1)

    def make(device: FakeDevice):
        "An engine whose forward queues 5 ms and whose lm_head queues 1 ms, then reads (waits)."
        engine = LLM(str(path), dtype=torch.float32, device='cpu').engine
        model = engine.runner.model
        # the runner calls the decoder stack (model.model) for hidden states, then compute_logits
        forward, compute_logits = model.model.forward, model.compute_logits

        def queued_forward(*args, **kwargs):
            out = forward(*args, **kwargs)
            device.launch(0.005)
            return out

        def logits_then_read(hidden):
            out = compute_logits(hidden)
            device.launch(0.001)
            device.synchronize()         # the sampler reads the logits: the host waits here
            return out
        model.model.forward, model.compute_logits = queued_forward, logits_then_read
        engine.add_request(list(range(1, 9)),
                           SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        engine.step()                    # the prefill: what follows are decodes
        return engine
    return make


def test_time_step_parts_charges_queued_work_to_the_part_that_queued_it(tiny_engine_factory):
    from petite_llm.bench.profile import time_step_parts
    device = FakeDevice()
    step_ms, parts = time_step_parts(tiny_engine_factory(device), 3, device.clock,
                                     device.synchronize)
    assert parts['model forward'] == pytest.approx(5.0)
    assert parts['lm_head and sampling'] == pytest.approx(1.0)
    assert step_ms == pytest.approx(6.0)
    assert all(parts[k] == pytest.approx(0.0, abs=1e-9) for k in parts if k.startswith('host'))


def test_time_step_parts_without_synchronize_misplaces_the_forward(tiny_engine_factory):
    "What a CPU clock around asynchronous launches reports: the forward costs nothing."
    from petite_llm.bench.profile import time_step_parts
    device = FakeDevice()
    step_ms, parts = time_step_parts(tiny_engine_factory(device), 3, device.clock)
    assert parts['model forward'] == 0.0 and parts['lm_head and sampling'] == pytest.approx(6.0)
    assert step_ms == pytest.approx(6.0)


@pytest.fixture(scope='module')
def cheap_cost():
    "invariance_cost at its batch sizes on a one-layer tiny model, one short run of each figure."
    from petite_llm.bench.invariance import invariance_cost
    return invariance_cost(layers=1, steps=1, repeats=1, rounds=1, prefill_len=16)


def test_invariance_cost_reports_both_modes_at_each_batch_size(cheap_cost):
    "Decode at batch 1, 16, 64 and prefill, flag off and on, and each cost as on over off."
    inv = cheap_cost
    assert (inv['shape'], inv['layers'], inv['dtype']) == ('tiny', 1, 'bfloat16')
    for mode in ('off', 'on'):
        assert set(inv[mode]['decode_ms']) == {1, 16, 64} and inv[mode]['prefill_tok_s'] > 0
        for b, ms in inv[mode]['decode_ms'].items():
            assert math.isclose(inv[mode]['decode_tok_s'][b], b * 1e3 / ms)
    for b in (1, 16, 64):
        assert math.isclose(inv['cost']['decode'][b],
                            inv['on']['decode_ms'][b] / inv['off']['decode_ms'][b])
    assert math.isclose(inv['cost']['prefill'],
                        inv['off']['prefill_tok_s'] / inv['on']['prefill_tok_s'])


def test_only_invariance_runs_that_section_alone(cheap_cost, tmp_path, capsys, monkeypatch):
    "--only invariance: its options reach invariance_cost; JSON on stdout, bench_invariance.json."
    import petite_llm.bench.offline as bench
    calls = []
    monkeypatch.setattr(bench, 'invariance_cost', lambda **kw: calls.append(kw) or cheap_cost)
    res = run(_parse('--only', 'invariance', '--layers', '1', '--out', str(tmp_path)))
    assert calls == [dict(shape='tiny', layers=1, dtype='bfloat16', device='cpu')]
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(res))
    assert set(res) == {'invariance'} and not (tmp_path/'bench.json').exists()
    assert json.loads((tmp_path/'bench_invariance.json').read_text()) == json.loads(
        json.dumps(res))
    assert 'invariance' not in _parse().only.split(',')     # it runs only when asked for

def test_batch_invariant_flag_reaches_petite_llms_engine(capsys):
    "bench --batch-invariant: petite_llm's side of the throughput runs in that mode, and says so."
    res = run(_parse('--quick', '--only', 'throughput', '--engines', 'petite_llm',
                     '--batch-invariant'))
    assert res['petite_llm_options'] == {'batch_invariant': True}
    assert 'transformers' not in res and res['petite_llm']['decode_tok_s'] > 0
