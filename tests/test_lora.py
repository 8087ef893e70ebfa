"""Multi-LoRA serving (chapter 24) against transformers + PEFT, the oracle.

Random-weight Qwen3, Qwen2 and Llama bases are made by transformers, and four LoRA adapters of each
by PEFT (ranks 4 to 64, different target modules, rsLoRA, alphas that are not powers of two, B made
non-zero), saved by PEFT's own `save_pretrained`. In float64, every request of a batch that mixes
the base model and the four adapters gets, at every step, the logits of transformers with PEFT and
its own adapter (to rounding) and the same greedy tokens, also with prefill chunks, prefix hits,
preemption, LRU swaps of the device slots and async scheduling; also with speculation, an int8
base, batch invariance, and on the triton backend (interpreted here) with decode graphs whose slot
indices are inputs (a stand-in recorder on a CPU, real CUDA graphs in the `gpu` test). Two adapters
never share KV blocks. The Triton kernels equal the torch path; the server, through the openai
client, answers the base and two adapters in one burst as their PEFT twins.
"""
import copy
from pathlib import Path

import peft
import pytest
import torch
import transformers

from petite_llm.engine.config import EngineConfig
from petite_llm.engine.llm_engine import LLM, LLMEngine
from petite_llm.engine.lora import LoRALinear, LoRARequest, load_peft_adapter
from petite_llm.engine.paging import kv_bytes_per_block
from petite_llm.model.config import ModelConfig
from petite_llm.model.quantization import Int8Linear
from petite_llm.model.sampling_params import SamplingParams
from test_server_http import serving

VOCAB, EOS = 200, 2
HF = {'qwen3': (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
      'qwen2': (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
      'llama': (transformers.LlamaConfig, transformers.LlamaForCausalLM)}
ALL = ['q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj']
# (name, rank, lora_alpha, targets, rsLoRA)
ADAPTERS = [('qv', 4, 7, ['q_proj', 'v_proj'], False),
            ('all', 8, 12, ALL, True),
            ('mlp', 16, 5, ['gate_proj', 'up_proj', 'down_proj'], False),
            ('ko', 64, 100, ['k_proj', 'o_proj'], False)]

pytestmark = pytest.mark.usefixtures("one_thread")


def _randomize(model, seed, only=None):
    "Unit-scale random values for the parameters (those whose name holds `only`)."
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if only is None or only in name:
                r = torch.randn(param.shape, generator=g, dtype=torch.float64)
                param.copy_(r / param.shape[-1] ** 0.5 if param.dim() == 2 else 1 + 0.2 * r)


def make_lora_models(path, model_type, **overrides):
    "A float64 base and four PEFT adapters saved under path; {LoRARequest or None: HF model}."
    cfg_cls, model_cls = HF[model_type]
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=256, tie_word_embeddings=False, eos_token_id=EOS,
              pad_token_id=0, attn_implementation='sdpa') | overrides
    base = model_cls(cfg_cls(**kw)).double().eval()
    _randomize(base, 0)
    base.save_pretrained(path / 'base')
    models = {None: base}
    for i, (name, rank, alpha, targets, rslora) in enumerate(ADAPTERS, start=1):
        config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                                 use_rslora=rslora)
        adapted = peft.get_peft_model(copy.deepcopy(base), config)
        _randomize(adapted, i, only='lora_')                 # PEFT starts B at zero
        adapted.save_pretrained(path / name)
        models[LoRARequest(name, i, str(path / name))] = adapted.eval()
    return path / 'base', models


@pytest.fixture(scope="module", params=['qwen3', 'qwen2', 'llama'])
def lora_models(request, tmp_path_factory):
    return make_lora_models(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def qwen3_loras(tmp_path_factory):
    return make_lora_models(tmp_path_factory.mktemp('qwen3_lora'), 'qwen3')


def _prompts(n, length=7, shared=0, seed=0):
    "n prompts of `length` random tokens after `shared` tokens they all begin with."
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, VOCAB, (shared,), generator=g).tolist()
    return [prefix + torch.randint(3, VOCAB, (length + i % 3,), generator=g).tolist()
            for i in range(n)]


def _peft_greedy(model, prompt, max_tokens):
    "transformers (+ PEFT) greedy tokens for one prompt alone, stopping at eos as the engine does."
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=max_tokens, do_sample=False, eos_token_id=EOS,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _check(llm, models, prompts, requests, max_tokens=6):
    "One generate call of all prompts; each one's tokens == its adapter's PEFT greedy tokens."
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens),
                           lora_request=requests, use_tqdm=False)
    for i, (prompt, request, out) in enumerate(zip(prompts, requests, outputs)):
        want = _peft_greedy(models[request], prompt, max_tokens)
        assert out.outputs[0].token_ids == want, (i, getattr(request, 'lora_name', 'base'))
    return outputs


def _pool(path, num_blocks, block_size):
    "kv_cache_memory bytes for exactly num_blocks float64 blocks."
    return num_blocks * kv_bytes_per_block(ModelConfig.from_pretrained(path), block_size,
                                           torch.float64)


def test_mixed_batch_logits_and_tokens(lora_models, record_logits):
    "Base + 4 adapters in one batch: each request's logits at each step are PEFT's, its tokens too."
    path, models = lora_models
    llm = LLM(path, dtype=torch.float64, enable_lora=True, max_loras=4, max_lora_rank=64,
              block_size=4)
    rows = record_logits(llm)
    requests = list(models) * 2
    prompts = _prompts(len(requests))
    outputs = _check(llm, models, prompts, requests)
    for prompt, request, out in zip(prompts, requests, outputs):
        ids = prompt + out.outputs[0].token_ids
        with torch.no_grad():
            want = models[request](torch.tensor([ids])).logits[0, len(prompt) - 1:-1]
        got = torch.stack(rows[tuple(prompt)])
        torch.testing.assert_close(got, want, rtol=0, atol=1e-9 * want.abs().max().item())
    assert llm.engine.runner.lora is not None and len(llm.engine.lora.slots) == 4


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_chunks_prefix_hits_preemption_and_slot_swaps(qwen3_loras, async_scheduling):
    "8-token chunks, a shared prefix, a pool that preempts, 2 slots for 4 adapters: PEFT's tokens."
    path, models = qwen3_loras
    llm = LLM(path, dtype=torch.float64, enable_lora=True, max_loras=2, max_lora_rank=64,
              block_size=4, max_num_batched_tokens=8, kv_cache_memory=_pool(path, 12, 4),
              async_scheduling=async_scheduling)
    requests = [request for request in models for _ in range(3)]    # a prefix hit: the 2nd of 3
    prompts = _prompts(len(requests), length=5, shared=9, seed=1)
    _check(llm, models, prompts, requests, max_tokens=8)
    stats = llm.stats
    assert stats.num_preemptions > 0 and stats.prefix_cache_hit_rate > 0
    assert stats.kv_blocks_used == 0


def test_two_adapters_never_share_kv_blocks(qwen3_loras):
    "One prompt under adapters qv, qv, all and the base: only the two qv requests share blocks."
    path, models = qwen3_loras
    engine = LLMEngine.from_pretrained(path, dtype=torch.float64, enable_lora=True, max_loras=4,
                                       max_lora_rank=64, block_size=4)
    qv, all_ = list(models)[1:3]
    prompt = _prompts(1, length=13)[0]                       # 13 tokens: 3 full blocks
    params = SamplingParams(temperature=0, max_tokens=1)
    # the first qv request runs alone, so its full blocks are cached before the others arrive
    engine.add_request(prompt, params, lora_request=qv)
    while engine.has_unfinished_requests():
        engine.step()
    for request in [qv, all_, None]:
        engine.add_request(prompt, params, lora_request=request)
    engine.scheduler.schedule()
    tables = {seq.lora_id: seq.block_table for seq in engine.scheduler.running}
    assert engine.block_manager.num_hit_tokens == 12         # the second qv: 3 blocks hit
    assert not set(tables[2]) & set(tables[1]) and not set(tables[0]) & set(tables[1])
    assert not set(tables[0]) & set(tables[2])


def _lora_of_int8(path, models):
    "Chapter 19's Int8Linear as the base of a LoRALinear: int8 product plus PEFT's delta."
    request = list(models)[2]                                # 'all': rank 8, rsLoRA
    config = ModelConfig.from_pretrained(path)
    adapter = load_peft_adapter(request.lora_path, config, 16, torch.float64)
    peft_layer = models[request].base_model.model.model.layers[0].self_attn
    base = torch.nn.Linear(64, 64, bias=False).double()
    layer = LoRALinear(Int8Linear.from_linear(base), 64, [64], 2, 16, torch.float64, 'cpu')
    layer.set_slot(1, adapter.weights[0, 'o_proj'])
    return layer, peft_layer.o_proj


def test_lora_on_an_int8_base(qwen3_loras):
    "A LoRALinear adds PEFT's s·B(A x) to whatever its base computes: here an Int8Linear's."
    from petite_llm.engine.lora import LoRABatch, LoRAKernels
    path, models = qwen3_loras
    layer, peft_o_proj = _lora_of_int8(path, models)
    x = torch.randn(5, 64, dtype=torch.float64)
    layer.step = (LoRAKernels(), LoRABatch.build([1, -1], [3, 2], 'cpu'))
    scale = peft_o_proj.scaling['default']
    delta = peft_o_proj.lora_B['default'](peft_o_proj.lora_A['default'](x)) * scale
    with torch.no_grad():
        out = layer(x)
        base = layer.base_layer(x)
    torch.testing.assert_close(out[:3], base[:3] + delta[:3], rtol=0, atol=1e-12)
    torch.testing.assert_close(out[3:], base[3:], rtol=0, atol=0)


def _saved(tmp_path, source, **changes):
    "A copy of adapter folder source with adapter_config.json changed."
    import json
    import shutil
    target = Path(tmp_path) / 'changed'
    shutil.copytree(source, target)
    config = json.loads((target / 'adapter_config.json').read_text())
    (target / 'adapter_config.json').write_text(json.dumps(config | changes))
    return str(target)


def test_refusals_name_the_problem(qwen3_loras, tmp_path):
    "modules_to_save, a rank over the limit, another base model, LoRA off, a bad id, a clash."
    path, models = qwen3_loras
    qv, all_, mlp, ko = list(models)[1:]
    llm = LLM(path, dtype=torch.float64, enable_lora=True, max_loras=2, max_lora_rank=16)
    params = SamplingParams(max_tokens=1)
    cases = [(LoRARequest('s', 7, _saved(tmp_path, qv.lora_path, modules_to_save=['lm_head'])),
              'modules_to_save'),
             (ko, 'rank 64 is over max_lora_rank=16'),
             (LoRARequest('zero', 0, qv.lora_path), 'lora_int_id must be an int >= 1'),
             (LoRARequest('qv', 9, mlp.lora_path), "name 'qv' already belongs"),
             (LoRARequest('x', 8, str(tmp_path)), 'adapter_config.json and')]
    llm.generate([[5, 6]], params, lora_request=qv, use_tqdm=False)
    for request, message in cases:
        with pytest.raises(ValueError, match=message):
            llm.generate([[5, 6]], params, lora_request=request, use_tqdm=False)
    from safetensors.torch import load_file, save_file
    cut = _saved(tmp_path / 'cut', qv.lora_path)
    tensors = load_file(f'{cut}/adapter_model.safetensors')
    save_file({k: v for k, v in tensors.items() if not k.endswith('0.self_attn.q_proj.lora_B'
                                                                  '.weight')},
              f'{cut}/adapter_model.safetensors')
    with pytest.raises(ValueError, match='has no .*lora_B.weight beside it'):
        llm.generate([[5, 6]], params, lora_request=LoRARequest('cut', 6, cut), use_tqdm=False)
    other, _ = make_lora_models(tmp_path / 'wide', 'qwen3', hidden_size=32, head_dim=8)
    with pytest.raises(ValueError, match='trained on another base model'):
        llm.generate([[5, 6]], params, lora_request=LoRARequest('w', 5, str(tmp_path / 'wide'
                                                                             / 'qv')),
                     use_tqdm=False)
    plain = LLM(path, dtype=torch.float64)
    with pytest.raises(ValueError, match='enable_lora=True'):
        plain.generate([[5, 6]], params, lora_request=qv, use_tqdm=False)
    with pytest.raises(ValueError, match='enable_lora=True does not run with tensor_parallel'):
        EngineConfig(enable_lora=True, tensor_parallel_size=2)


@pytest.mark.parametrize("out_sizes,rank", [([24, 8, 8], 12), ([40], 16), ([16, 16], 4)])
def test_triton_shrink_expand_equal_the_torch_path(out_sizes, rank):
    "The kernels (interpreted on a CPU) add what the torch path adds: 3 slots, the base, chunks."
    from petite_llm.engine.lora import LoRABatch, LoRAKernels
    from petite_llm.engine.triton_backend import TritonLoRAKernels
    g = torch.Generator().manual_seed(rank)
    layer = LoRALinear(torch.nn.Identity(), 24, out_sizes, 3, rank, torch.float32, 'cpu')
    layer.lora_a.normal_(generator=g)
    layer.lora_b.normal_(generator=g)
    batch = LoRABatch.build([2, -1, 0, 1, 2], [1, 1, 3, 2, 4], 'cpu')
    x = torch.randn(11, 24, generator=g)
    y = torch.randn(11, sum(out_sizes), generator=g)
    want = LoRAKernels().add_lora(y.clone(), x, layer, batch)
    got = TritonLoRAKernels().add_lora(y.clone(), x, layer, batch)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got[1], y[1], rtol=0, atol=0)          # the base model's token


@pytest.fixture(scope="module")
def served_loras(tmp_path_factory):
    "A Qwen3-tokenizer model and its PEFT adapters; `serve` with two of them; killed at the end."
    qwen3_tokenizer = pytest.importorskip("qwen3_tokenizer")
    path = tmp_path_factory.mktemp("served_lora")
    base, models = make_lora_models(path, 'qwen3', vocab_size=151936, hidden_size=32,
                                    head_dim=8, eos_token_id=151645)
    try:
        qwen3_tokenizer.write_qwen3_tokenizer(base)
    except Exception as e:
        pytest.skip(f"no offline Qwen3 tokenizer here: {e}")
    qv, all_ = list(models)[1:3]
    with serving(base, "--served-model-name", "tiny", "--dtype", "float64", "--device", "cpu",
                 "--log-level", "warning", "--enable-lora", "--max-loras", "2",
                 "--lora-modules", f"qv={qv.lora_path}", f"all={all_.lora_path}",
                 timeout=90) as url:
        yield url, base, models


def test_server_answers_by_adapter_in_one_burst(served_loras):
    "Through openai: the base and two adapters at once, each its PEFT twin; load, unload, 4xx."
    import asyncio
    import httpx
    openai = pytest.importorskip("openai")
    url, base, models = served_loras
    none, qv, all_, mlp, ko = list(models)
    reference = LLM(base, dtype=torch.float64, enable_lora=True, max_loras=4, max_lora_rank=64)
    prompt, params = "The capital of France is", SamplingParams(temperature=0, max_tokens=6)

    def expected(request):
        "Our engine's text for the prompt with this adapter, its tokens checked against PEFT's."
        out = reference.generate([prompt], params, lora_request=request, use_tqdm=False)[0]
        ids = torch.tensor([out.prompt_token_ids])
        with torch.inference_mode():
            twin = models[request].generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                            max_new_tokens=6, do_sample=False,
                                            eos_token_id=151645, pad_token_id=0)
        assert out.outputs[0].token_ids == twin[0, ids.shape[1]:].tolist()
        return out.outputs[0].text

    async def burst(names):
        "The prompt's completion under each model name, all requests at once."
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", timeout=60) as client:
            replies = await asyncio.gather(*[
                client.completions.create(model=name, prompt=prompt, max_tokens=6, temperature=0)
                for name in names])
        return [reply.choices[0].text for reply in replies]

    names = ["tiny", "qv", "all"]
    assert asyncio.run(burst(names)) == [expected(r) for r in (none, qv, all_)]
    listed = httpx.get(f"{url}/v1/models").json()["data"]
    assert [(m["id"], m.get("parent")) for m in listed] == [
        ("tiny", None), ("qv", "tiny"), ("all", "tiny")]
    load = lambda name, path: httpx.post(f"{url}/v1/load_lora_adapter",            # noqa: E731
                                         json={"lora_name": name, "lora_path": path})
    assert load("mlp", mlp.lora_path).status_code == 200
    assert asyncio.run(burst(["mlp"])) == [expected(mlp)]
    over = load("ko", ko.lora_path)                                # rank 64 > --max-lora-rank 16
    assert over.status_code == 400 and "max_lora_rank" in over.json()["error"]["message"]
    assert load("qv", mlp.lora_path).status_code == 400           # the name is taken
    import dataclasses
    from petite_llm.bench.lora import random_peft_adapter
    other = dataclasses.replace(ModelConfig.from_pretrained(base), intermediate_size=40)
    wide = random_peft_adapter(base.parent / "other_base", other, rank=4)
    mismatch = load("other", str(wide))
    assert mismatch.status_code == 400
    assert "another base model" in mismatch.json()["error"]["message"]
    unload = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "mlp"})
    assert unload.status_code == 200
    with pytest.raises(openai.NotFoundError):
        asyncio.run(burst(["mlp"]))
    metrics = httpx.get(f"{url}/metrics").text
    assert 'petite_llm:lora_requests_total{lora_name="qv"} 1.0' in metrics


def test_lora_batch_groups_any_layout_by_slot():
    "Random slot layouts (interleaved, side by side, none): the torch path == the definition."
    from petite_llm.engine.lora import LoRABatch, LoRAKernels
    g = torch.Generator().manual_seed(0)
    layer = LoRALinear(torch.nn.Identity(), 8, [6, 2], 3, 4, torch.float64, 'cpu')
    layer.lora_a.normal_(generator=g)
    layer.lora_b.normal_(generator=g)
    layouts = [[0, 0, 1], [1, 0, 1], [-1, 2, 2, -1], [-1, -1], [2], [0, 1, 2, 1, 0, -1]]
    for seq_slots in layouts:
        num_new = torch.randint(1, 4, (len(seq_slots),), generator=g).tolist()
        batch = LoRABatch.build(seq_slots, num_new, 'cpu')
        x = torch.randn(sum(num_new), 8, generator=g, dtype=torch.float64)
        got = LoRAKernels().add_lora(torch.zeros(len(x), 8, dtype=torch.float64), x, layer,
                                     batch)
        for t, slot in enumerate(batch.token_slots.tolist()):
            a, b = layer.lora_a[slot], layer.lora_b[slot]                   # [2 R, in], [8, R]
            want = (torch.cat([b[:6] @ (a[:4] @ x[t]), b[6:] @ (a[4:] @ x[t])]) if slot >= 0
                    else torch.zeros(8, dtype=torch.float64))
            torch.testing.assert_close(got[t], want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("method", ['ngram', 'draft_model'])
def test_speculation_verifies_with_the_adapter(qwen3_loras, method):
    "n-gram drafts, or the base model drafting without any adapter: each request's PEFT tokens."
    path, models = qwen3_loras
    spec = ({'method': 'ngram', 'num_speculative_tokens': 3, 'prompt_lookup_min': 1}
            if method == 'ngram' else {'model': str(path), 'num_speculative_tokens': 3})
    llm = LLM(path, dtype=torch.float64, enable_lora=True, max_loras=4, max_lora_rank=64,
              block_size=4, speculative_config=spec)
    requests = list(models)
    prompts = [prompt * 3 for prompt in _prompts(len(requests), length=3, seed=4)]  # n-gram hits
    _check(llm, models, prompts, requests, max_tokens=8)
    assert llm.stats.num_drafts > 0


def _int8_twin(model):
    "A copy of a transformers (+ PEFT) model whose base linears hold their dequantized int8 values."
    from petite_llm.model.quantization import quantize_int8
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for name, module in twin.named_modules():
            if isinstance(module, torch.nn.Linear) and 'lora_' not in name:
                q, scale = quantize_int8(module.weight)
                module.weight.copy_(q.double() * scale[:, None])
    return twin


def test_int8_base_with_adapters(qwen3_loras):
    "int8 base weights, float adapters: PEFT's tokens on the same (dequantized) int8 base."
    path, models = qwen3_loras
    llm = LLM(path, dtype=torch.float64, quantization='int8', enable_lora=True, max_loras=4,
              max_lora_rank=64)
    assert isinstance(llm.engine.model.model.layers[0].mlp.down_proj.base_layer, Int8Linear)
    twins = {request: _int8_twin(model) for request, model in models.items()}
    _check(llm, twins, _prompts(len(twins), seed=5), list(twins))


def test_batch_invariant_with_adapters(qwen3_loras, record_logits):
    "batch_invariant=True, float32: a request's logits are the same bits alone and in a mix."
    path, models = qwen3_loras
    none, qv, all_, mlp, ko = list(models)

    def logits(prompts, requests):
        llm = LLM(path, dtype=torch.float32, enable_lora=True, max_loras=4, max_lora_rank=64,
                  batch_invariant=True, block_size=4)
        assert llm.engine.lora.kernels.name == 'one_token_at_a_time'
        rows = record_logits(llm)
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4), lora_request=requests,
                     use_tqdm=False)
        return rows[tuple(prompts[0])]

    target, *others = _prompts(6, seed=7)
    alone = logits([target], [qv])
    mixed = logits([target, *others], [qv, qv, none, all_, qv, mlp])
    assert len(alone) == len(mixed) == 4
    assert all(torch.equal(a, b) for a, b in zip(alone, mixed))


def test_bench_lora_from_the_command_line(tmp_path, capsys):
    "`petite-llm bench lora` on the micro shape: JSON with tok/s per run and its ratio to the base."
    import json
    from petite_llm.cli.main import main
    assert main(['bench', 'lora', '--shape', 'micro', '--layers', '1', '--batch', '4',
                 '--adapters', '0,2', '--rank', '4', '--steps', '1', '--rounds', '1',
                 '--dtype', 'float32', '--checkpoint', str(tmp_path / 'micro')]) == 0
    res = json.loads(capsys.readouterr().out)
    assert set(res['tok_s']) == {'base', '0', '2'} and set(res['ratio']) == {'0', '2'}
    assert all(tok_s > 0 for tok_s in res['tok_s'].values())
    assert len(list((tmp_path / 'micro').glob('lora-r4-*/adapter_model.safetensors'))) == 2


def _replay_eagerly(fn, pool=None):
    "Stand-in for capture_cuda_graph on a CPU: replay re-runs fn into the output it first returned."
    output = fn()
    return (lambda: output.copy_(fn())), output, object() if pool is None else pool


def _graph_parity(llm, models, requests, record_logits):
    "Each request's logits at every step, with its adapter, against PEFT's (float32 tolerance)."
    rows = record_logits(llm)
    prompts = _prompts(len(requests), length=4, seed=9)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3),
                           lora_request=requests, use_tqdm=False)
    for prompt, request, out in zip(prompts, requests, outputs):
        ids = prompt + out.outputs[0].token_ids
        model = models[request]
        with torch.no_grad():
            want = model(torch.tensor([ids], device=model.device)).logits[0, len(prompt) - 1:-1]
        got = torch.stack(rows[tuple(prompt)]).double()
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * want.abs().max().item())


def test_decode_graphs_take_the_slots_as_inputs(qwen3_loras, record_logits):
    "The triton backend (interpreted), stand-in graphs: 3 adapters through 2 slots, PEFT's logits."
    path, models = qwen3_loras
    none, qv, all_, mlp, ko = list(models)
    llm = LLM(path, dtype=torch.float32, enable_lora=True, max_loras=2, max_lora_rank=64,
              attention_backend='triton', block_size=16, max_num_seqs=2, enforce_eager=True)
    runner = llm.engine.runner
    assert llm.engine.lora.kernels.name == 'triton'
    runner.capture_cuda_graphs(2, llm.engine.max_model_len, capture=_replay_eagerly)
    replays = []
    runner.cuda_graphs.graphs = {
        size: ((lambda r=replay, s=size: (replays.append(s), r())), out)
        for size, (replay, out) in runner.cuda_graphs.graphs.items()}
    # a third adapter waits for a slot, then takes one: recorded once, replayed with new slots
    _graph_parity(llm, models, [qv, all_, ko], record_logits)
    assert replays and len(llm.engine.lora.slots) == 2


@pytest.mark.gpu
def test_cuda_graphs_with_adapters_match_peft(qwen3_loras, record_logits):
    "Real CUDA graphs on the triton backend: recorded with LoRA on, PEFT's logits per request."
    path, models = qwen3_loras
    none, qv, all_, mlp, ko = list(models)
    llm = LLM(path, dtype=torch.float32, enable_lora=True, max_loras=2, max_lora_rank=64,
              attention_backend='triton', block_size=16, max_num_seqs=4, device='cuda')
    graphs = llm.engine.runner.cuda_graphs
    assert graphs is not None
    seconds = graphs.capture_seconds
    on_gpu = {request: copy.deepcopy(model).cuda() for request, model in models.items()}
    _graph_parity(llm, on_gpu, [none, qv, all_, ko], record_logits)
    assert llm.engine.runner.cuda_graphs is graphs and graphs.capture_seconds == seconds


def test_a_mixture_of_experts_model_is_refused():
    "Experts have no per-adapter slices: enable_lora on a MoE model is a ValueError naming it."
    from petite_llm.model.qwen3 import Qwen3ForCausalLM
    config = ModelConfig(model_type='qwen3_moe', vocab_size=64, hidden_size=16,
                         intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=8, num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=8, eos_token_id=[1])
    with pytest.raises(ValueError, match='mixture-of-experts'):
        LLMEngine(Qwen3ForCausalLM(config), enable_lora=True, kv_cache_memory=2**16)
