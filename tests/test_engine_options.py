"""Engine options the engine cannot run are refused in one place, before anything is built.

Each combination below goes through `LLM(path, **options)` on a folder that holds only a
`config.json`: no weight exists to load, and the loader and the tensor-parallel start are replaced
by functions that fail the test if they are called. So every refusal listed here comes from the
validator (`EngineConfig.check` / `resolve`), with the model's config and the device in hand.
"""
import sys
from unittest.mock import patch

import pytest
import torch
import transformers

from petite_llm.engine.config import EngineConfig
from petite_llm.engine.llm_engine import LLM, LLMEngine
from petite_llm.model.config import ModelConfig
from petite_llm.model.qwen3 import Qwen3ForCausalLM
from petite_llm.model.sampling_params import SamplingParams

# 4 query heads on 2 KV heads: tensor_parallel_size 1, 2 and 4 split it, 3 does not
SHAPE = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
NGRAM = {'method': 'ngram', 'num_speculative_tokens': 2}
DRAFT = {'model': 'a-draft', 'num_speculative_tokens': 2}

REFUSED = [   # options, a phrase the refusal must hold
    # counts
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be a positive int"),
    (dict(block_size=0), "block_size must be a positive int"),
    (dict(max_num_seqs=True), "max_num_seqs must be a positive int"),
    (dict(max_num_batched_tokens=2.5), "max_num_batched_tokens must be a positive int"),
    (dict(max_model_len=-1), "max_model_len must be a positive int"),
    (dict(kv_cache_memory=0), "kv_cache_memory must be a positive int"),
    (dict(gpu_memory_utilization=0), "gpu_memory_utilization=0 is the share"),
    (dict(gpu_memory_utilization=1.5), "give a number in (0, 1]"),
    # names
    (dict(attention_backend='flash'), "is not one of 'auto', 'torch', 'triton'"),
    (dict(quantization='int4'), "unknown quantization 'int4'"),
    (dict(speculative_config={'method': 'ngram', 'num_speculative_tokens': 0}),
     "num_speculative_tokens must be an int >= 1"),
    (dict(speculative_config={**NGRAM, 'lookup_max': 2}), "unknown key(s) 'lookup_max'"),
    (dict(speculative_config={**NGRAM, 'adaptive': 'yes'}), "adaptive must be True or False"),
    (dict(speculative_config={'method': 'medusa', 'num_speculative_tokens': 2}),
     "method must be one of 'ngram', 'draft_model'"),
    # options together
    (dict(async_scheduling=True, speculative_config=NGRAM),
     "async_scheduling=True cannot run with speculative_config"),
    (dict(batch_invariant=True, enable_torch_compile=True),
     "batch_invariant=True cannot run with enable_torch_compile=True"),
    (dict(tensor_parallel_size=2, async_scheduling=True),
     "tensor_parallel_size=2 does not run with async_scheduling=True"),
    (dict(tensor_parallel_size=2, enable_torch_compile=True),
     "tensor_parallel_size=2 does not run with enable_torch_compile"),
    (dict(tensor_parallel_size=2, speculative_config=DRAFT),
     "tensor_parallel_size=2 does not run with a draft model"),
    (dict(tensor_parallel_size=4, batch_invariant=True),
     "use tensor_parallel_size 1 or 2"),
    # options on this model
    (dict(tensor_parallel_size=3), "num_attention_heads=4 is not a multiple of 3"),
    (dict(max_model_len=1024),
     "max_model_len=1024 exceeds the model's max_position_embeddings=256"),
    (dict(max_num_seqs=64, max_num_batched_tokens=32),
     "max_num_seqs=64 is more than max_num_batched_tokens=32"),
    (dict(max_num_seqs=4096), "max_num_seqs=4096 is more than max_num_batched_tokens=2048"),
]


@pytest.fixture(scope="module")
def config_only(tmp_path_factory):
    "A model folder with its config.json and nothing else: no weights, no tokenizer."
    path = tmp_path_factory.mktemp("config_only")
    transformers.Qwen3Config(**SHAPE).save_pretrained(path)
    return path


@pytest.fixture
def nothing_built(monkeypatch):
    "The loader and the tensor-parallel start fail the test if the engine gets that far."
    def built(*args, **kwargs):
        raise AssertionError("the engine loaded weights or started processes before refusing")
    monkeypatch.setattr('petite_llm.engine.loading.load_model', built)
    monkeypatch.setattr('petite_llm.parallel.worker.start_tensor_parallel', built)


@pytest.mark.parametrize('options,phrase', REFUSED,
                         ids=[','.join(options) for options, _ in REFUSED])
def test_each_refusal_names_the_rule_before_anything_is_built(config_only, nothing_built,
                                                              options, phrase):
    with pytest.raises(ValueError) as refused:
        LLM(config_only, device='cpu', **options)
    assert phrase in str(refused.value)


def test_every_broken_rule_is_listed_at_once(config_only, nothing_built):
    with pytest.raises(ValueError) as refused:
        LLM(config_only, device='cpu', max_model_len=1024, max_num_seqs=4096,
            tensor_parallel_size=3)
    message = str(refused.value)
    assert "break 3 rules" in message
    for phrase in ("exceeds the model's", "is more than max_num_batched_tokens",
                   "cannot split this qwen3 model"):
        assert phrase in message


def test_the_environment_rules(config_only, nothing_built, monkeypatch):
    "Triton missing, Triton on a CPU, no C++ compiler for torch.compile: each with its way out."
    with patch.dict(sys.modules, {'triton': None}):      # a machine without Triton
        with pytest.raises(ValueError, match="needs Triton, which is not installed here"):
            LLM(config_only, device='cpu', attention_backend='triton')
    monkeypatch.delenv('TRITON_INTERPRET', raising=False)  # (tests/conftest.py sets it on a CPU)
    with pytest.raises(ValueError, match="runs on a CUDA GPU; on a CPU use 'torch'"):
        LLM(config_only, device='cpu', attention_backend='triton')
    monkeypatch.setenv('CXX', 'no-such-c++-compiler')
    with pytest.raises(ValueError, match="needs a C\\+\\+ compiler"):
        LLM(config_only, device='cpu', enable_torch_compile=True)


def test_torch_compile_is_refused_off_the_cpu():
    problems = EngineConfig(enable_torch_compile=True).check(ModelConfig('qwen3', **SHAPE),
                                                             torch.device('meta'))
    assert any("enable_torch_compile is for the CPU" in p for p in problems)


def test_options_alone_are_refused_when_the_config_is_made():
    "A config the CLI builds from flags is refused before it names a model."
    with pytest.raises(ValueError, match="attention_backend='flash'"):
        EngineConfig(attention_backend='flash')
    assert EngineConfig(max_model_len=10**6).check() == []   # the model's limit: not known yet


def test_resolve_returns_the_choices():
    choices = EngineConfig(max_num_batched_tokens=64).resolve(ModelConfig('qwen3', **SHAPE), 'cpu')
    assert (choices.attention_backend, choices.max_num_batched_tokens, choices.max_num_seqs,
            choices.async_scheduling, choices.structured_outputs) == ('torch', 64, 64, False, None)


def test_a_built_model_is_checked_before_its_kv_pool(monkeypatch):
    "LLMEngine on a model already built: the same rules, before the KV pool is sized."
    def sized(*args):
        raise AssertionError("the KV pool was sized before the options were checked")
    monkeypatch.setattr('petite_llm.engine.llm_engine.size_engine', sized)
    model = Qwen3ForCausalLM(ModelConfig('qwen3', **SHAPE))
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings=256"):
        LLMEngine(model, max_model_len=1024)


def test_structured_outputs_with_speculation_are_known_at_build_time():
    "An engine that speculates knows it refuses grammars; a request for one gets that reason."
    config = EngineConfig(speculative_config=NGRAM)
    reason = config.resolve(ModelConfig('qwen3', **SHAPE), 'cpu').structured_outputs
    assert "structured_outputs do not run with speculative decoding" in reason
    engine = LLMEngine(Qwen3ForCausalLM(ModelConfig('qwen3', **SHAPE)), config=config,
                       kv_cache_memory=1 << 20)
    assert engine.choices.structured_outputs == reason
    with pytest.raises(ValueError, match="do not run with speculative decoding"):
        engine.add_request([5, 6], SamplingParams(structured_outputs={'regex': 'a+'}))
