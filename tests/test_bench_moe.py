"""`petite-llm bench moe` and `petite-llm bench structured` (chapter 18): the MoE shapes, the bytes a
token reads, and every figure of a quick run. No timing is asserted: timings depend on the machine."""
import argparse, json

import pytest
import torch
from transformers import AutoModelForCausalLM

from petite_llm.bench.moe import (active_weight_bytes, add_moe_arguments, moe_decode_profile,
                                  moe_table, run_moe, run_moe_benchmark)
from petite_llm.bench.offline import linear_shapes
from petite_llm.bench.peers import make_random_checkpoint, shape_config
from petite_llm.bench.structured import add_structured_arguments, run_structured
from petite_llm.cli.main import bench_modes
from petite_llm.model.layers.linear import packed_linear_available


def test_tiny_moe_checkpoint_and_the_bytes_one_token_reads(tmp_path):
    path = make_random_checkpoint(tmp_path/'ck', shape='tiny-moe', num_layers=2)
    model = AutoModelForCausalLM.from_pretrained(path)
    cfg = shape_config('tiny-moe', num_layers=2)
    assert type(model).__name__ == 'Qwen3MoeForCausalLM' and not model.config.tie_word_embeddings
    assert model.config.num_experts == cfg['num_experts'] and model.dtype == torch.bfloat16
    k, E = cfg['num_experts_per_tok'], cfg['num_experts']
    params = dict(model.named_parameters())
    # a token passes every dense linear and k of each layer's E experts
    dense = sum(p.numel() for n, p in params.items()
                if n.endswith('.weight') and p.dim() == 2 and 'embed_tokens' not in n)
    experts = sum(p.numel() for n, p in params.items() if '.experts.' in n)
    assert sum(o * i for o, i in linear_shapes(cfg)) == dense + experts * k // E
    norms = sum(p.numel() for n, p in params.items() if p.dim() == 1)
    expected = 2 * (dense + experts * k // E + norms + cfg['hidden_size'])
    assert active_weight_bytes(cfg, torch.bfloat16) == expected


def test_qwen3_30b_a3b_shape_activates_its_3_3b_parameters():
    "Qwen3-30B-A3B's model card: 3.3B activated parameters (embedding and lm_head both counted)."
    cfg = shape_config('qwen3-30b-a3b')
    activated = active_weight_bytes(cfg) / 2 + cfg['vocab_size'] * cfg['hidden_size']
    assert abs(activated / 1e9 - 3.3) < 0.1


def test_a_dense_shape_is_refused():
    with pytest.raises(ValueError, match='has no experts'):
        run_moe_benchmark(shape='tiny', quick=True)


def test_quick_moe_run_prints_json_with_every_figure(tmp_path, capsys):
    args = add_moe_arguments(argparse.ArgumentParser()).parse_args(
        ['--quick', '--threads', '1', '--out', str(tmp_path)])
    res = run_moe(args)
    printed = json.loads(capsys.readouterr().out)
    assert printed['ratios'] == res['ratios']
    assert json.loads((tmp_path/'bench_moe.json').read_text())['shape'] == 'tiny-moe'
    for engine in ('petite_llm', 'transformers'):
        assert set(res[engine]) >= {'batch_1', 'batch_4'}
        assert all(res[engine][b]['decode_tok_s'] > 0 for b in ('batch_1', 'batch_4'))
    assert set(res['ratios']) == {'batch_1_vs_transformers', 'batch_4_vs_transformers',
                                  'petite_llm_batch_1_vs_bound', 'transformers_batch_1_vs_bound'}
    samples = res['memory_read_samples_gb_s']                                # before, after
    assert len(samples) == 2
    assert res['memory_read_gb_s'] == max(v for sample in samples for v in sample.values())
    # a bf16 CPU run with oneDNN's packed products also reads through them (the engine's kernel)
    ways = {'sum', 'products'} if packed_linear_available(torch.bfloat16) else {'sum'}
    assert all(set(sample) == ways for sample in samples)
    # and then the table says how fast those products alone are against transformers
    assert ('products_tok_s' in res) == ('products' in ways)
    assert ("one token's products alone" in moe_table(res)) == ('products' in ways)
    assert res['bound_tok_s'] == pytest.approx(res['memory_read_gb_s'] * 1e9
                                               / res['active_weight_bytes'])
    assert 'goal >= 3.0x' in moe_table(res)
    assert 'no engine can be more than' in moe_table(res)


def test_the_decode_profile_puts_the_experts_ops_under_experts(tmp_path):
    "Every op inside an expert stack's forward counts as 'experts', whatever op it is."
    path = make_random_checkpoint(tmp_path/'moe', 'tiny-moe', torch.bfloat16, 2, 0)
    ms = moe_decode_profile(path, threads=(1,), decode_tokens=2, prompt_len=4)[1]
    assert set(ms) <= {'wall', 'experts', 'packed linears', 'other ops'}
    assert ms['experts'] > 0 and ms['other ops'] > 0 and ms['wall'] > 0


def test_structured_cost_on_the_default_model(capsys):
    args = add_structured_arguments(argparse.ArgumentParser()).parse_args(
        ['--batch-size', '2', '--max-tokens', '3', '--repeats', '1', '--threads', '1'])
    res = run_structured(args)
    assert json.loads(capsys.readouterr().out)['json_vs_free'] == res['json_vs_free']
    assert res['json_tok_s'] > 0 and res['free_tok_s'] > 0 and res['compile_ms'] > 0
    assert res['model'].endswith('.gguf')


def test_the_cli_knows_both_modes():
    modes = bench_modes()
    assert modes['moe'][1] is run_moe and modes['structured'][1] is run_structured
