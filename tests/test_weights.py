"""Loading safetensors checkpoints (single, sharded): name map, errors, dtypes, hub resolution."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen2Config, Qwen3Config
from transformers import Qwen2ForCausalLM as HFQwen2, Qwen3ForCausalLM as HFQwen3

from petite_llm.model.weights import (checkpoint_files, load_model, map_gguf_name, map_hf_name,
                                permute_qk, resolve_model_path, smollm2_gguf_path, unpermute_qk,
                                weights_nbytes)


def tiny_qwen3(**kw):
    "A random-weight transformers Qwen3 (float32) small enough to build in milliseconds."
    cfg = dict(vocab_size=200, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    return HFQwen3(Qwen3Config(**{**cfg, **kw})).eval()


@pytest.fixture(scope='module')
def ckpt(tmp_path_factory):
    "A saved tiny untied Qwen3 and the transformers model it came from."
    hf, path = tiny_qwen3(), tmp_path_factory.mktemp('tiny')
    hf.save_pretrained(path)
    return path, hf


def logits_close(ours, hf, ids):
    with torch.no_grad():
        a = ours(ids, torch.arange(len(ids)))
        b = hf(ids[None]).logits[0].to(a.dtype)
    assert a.shape == b.shape
    assert (a - b).abs().max() <= 1e-4 * b.abs().max(), (a - b).abs().max()


IDS = torch.tensor([5, 17, 101, 3, 3, 199, 42, 7, 64])


@pytest.mark.parametrize('tied', [False, True])
def test_single_file_matches_transformers(tmp_path, tied):
    hf = tiny_qwen3(tie_word_embeddings=tied)
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path, progress=False)
    assert model.config.tie_word_embeddings == tied
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    logits_close(model, hf, IDS)


def test_qwen2_biases_and_no_qk_norm(tmp_path):
    torch.manual_seed(0)
    hf = HFQwen2(Qwen2Config(vocab_size=200, hidden_size=48, intermediate_size=80,
                             num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                             max_position_embeddings=64, tie_word_embeddings=True)).eval()
    # transformers initialises biases to zero: make them matter
    with torch.no_grad():
        for layer in hf.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_()
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path, progress=False)
    torch.testing.assert_close(model.model.layers[1].self_attn.qkv_proj.bias[-16:],
                               hf.model.layers[1].self_attn.v_proj.bias[-16:])
    logits_close(model, hf, IDS)


def test_sharded_equals_single(tmp_path, ckpt):
    path, hf = ckpt
    hf.save_pretrained(tmp_path, max_shard_size='20KB')
    assert (tmp_path/'model.safetensors.index.json').is_file()
    assert len(checkpoint_files(tmp_path)) > 3
    single, sharded = load_model(path, progress=False), load_model(tmp_path, progress=False)
    a, b = dict(single.named_parameters()), dict(sharded.named_parameters())
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_fused_shards_land_in_their_rows(ckpt):
    path, hf = ckpt
    model, c = load_model(path, progress=False), hf.config
    attn, hattn = model.model.layers[1].self_attn, hf.model.layers[1].self_attn
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    qkv = torch.cat([hattn.q_proj.weight, hattn.k_proj.weight, hattn.v_proj.weight])
    torch.testing.assert_close(attn.qkv_proj.weight, qkv, rtol=0, atol=0)
    assert q + 2 * kv == attn.qkv_proj.weight.shape[0]
    mlp, hmlp = model.model.layers[0].mlp, hf.model.layers[0].mlp
    gate_up = torch.cat([hmlp.gate_proj.weight, hmlp.up_proj.weight])
    torch.testing.assert_close(mlp.gate_up_proj.weight, gate_up, rtol=0, atol=0)


def rewrite(src, dst, edit):
    "Copy the checkpoint folder `src` to `dst`, passing its tensors through `edit(dict)`."
    dst.mkdir(exist_ok=True)
    (dst/'config.json').write_text((src/'config.json').read_text())
    sd = load_file(src/'model.safetensors')
    edit(sd)
    save_file(sd, dst/'model.safetensors', metadata={'format': 'pt'})
    return dst


def test_missing_unexpected_and_misshapen_are_listed(tmp_path, ckpt):
    path, _ = ckpt
    def edit(sd):
        del sd['model.layers.1.mlp.up_proj.weight'], sd['model.norm.weight']
        sd['model.layers.0.self_attn.k_proj.weight'] = torch.zeros(5, 48)
        sd['model.layers.0.self_attn.extra.weight'] = torch.zeros(2)
    bad = rewrite(path, tmp_path/'bad', edit)
    with pytest.raises(ValueError) as e:
        load_model(bad, progress=False)
    msg = str(e.value)
    for name in ('model.layers.1.mlp.up_proj.weight', 'model.norm.weight',
                 'model.layers.0.self_attn.extra.weight', 'model.layers.0.self_attn.k_proj.weight'):
        assert name in msg, (name, msg)
    assert 'missing' in msg and 'unexpected' in msg and 'shape' in msg and '(5, 48)' in msg


def test_tied_checkpoint_with_or_without_lm_head(tmp_path):
    hf = tiny_qwen3(tie_word_embeddings=True)
    hf.save_pretrained(tmp_path/'a')
    def add_head(sd):
        sd.setdefault('lm_head.weight', sd['model.embed_tokens.weight'].clone())
    with_head = rewrite(tmp_path/'a', tmp_path/'b', add_head)
    without = rewrite(tmp_path/'a', tmp_path/'c', lambda sd: sd.pop('lm_head.weight', None))
    for p in (with_head, without):
        logits_close(load_model(p, progress=False), hf, IDS)


def test_untied_checkpoint_without_lm_head_is_missing(tmp_path, ckpt):
    bad = rewrite(ckpt[0], tmp_path/'nohead', lambda sd: sd.pop('lm_head.weight'))
    with pytest.raises(ValueError, match=r'missing.*lm_head\.weight'):
        load_model(bad, progress=False)


def test_dtype_default_and_override(tmp_path, ckpt):
    hf = tiny_qwen3().to(torch.bfloat16)
    hf.save_pretrained(tmp_path/'bf16')
    cfg = json.loads((tmp_path/'bf16'/'config.json').read_text())
    assert cfg.get('dtype', cfg.get('torch_dtype')) == 'bfloat16'
    m = load_model(tmp_path/'bf16', progress=False)
    assert {p.dtype for p in m.parameters()} == {torch.bfloat16}
    assert m.config.torch_dtype == torch.bfloat16
    m32 = load_model(tmp_path/'bf16', dtype=torch.float32, progress=False)
    assert {p.dtype for p in m32.parameters()} == {torch.float32}
    torch.testing.assert_close(m32.lm_head.weight, hf.lm_head.weight.float(), rtol=0, atol=0)
    # no dtype in config.json: the tensors' own dtype (float16 here)
    (tmp_path/'f16').mkdir()
    no_dtype = {k: v for k, v in cfg.items() if k not in ('dtype', 'torch_dtype')}
    (tmp_path/'f16'/'config.json').write_text(json.dumps(no_dtype))
    bf16_tensors = load_file(tmp_path/'bf16'/'model.safetensors')
    save_file({k: v.half() for k, v in bf16_tensors.items()}, tmp_path/'f16'/'model.safetensors')
    assert load_model(tmp_path/'f16', progress=False).lm_head.weight.dtype == torch.float16
    m64 = load_model(ckpt[0], dtype=torch.float64, progress=False)
    assert weights_nbytes(m64) == 2 * weights_nbytes(load_model(ckpt[0], progress=False))


def test_pickle_checkpoints_are_refused(tmp_path, ckpt):
    (tmp_path/'config.json').write_text((ckpt[0]/'config.json').read_text())
    (tmp_path/'pytorch_model.bin').write_bytes(b'\x80\x04 never unpickled')
    with pytest.raises(ValueError, match='pickle'):
        load_model(tmp_path, progress=False)


def test_resolve_local_paths(tmp_path, ckpt):
    assert resolve_model_path(ckpt[0]) == ckpt[0]
    assert resolve_model_path(smollm2_gguf_path()) == smollm2_gguf_path()
    with pytest.raises(FileNotFoundError, match='does not exist'):
        resolve_model_path(tmp_path/'missing.gguf')
    with pytest.raises(FileNotFoundError, match='does not exist'):
        resolve_model_path('./not/here')


def test_resolve_hub_id_offline_fails_fast_and_clearly(monkeypatch, tmp_path):
    import huggingface_hub.constants as hc
    monkeypatch.setenv('HF_HUB_OFFLINE', '1')
    # read at import time: the module attribute is what counts
    monkeypatch.setattr(hc, 'HF_HUB_OFFLINE', True)
    monkeypatch.setattr(hc, 'HF_HUB_ETAG_TIMEOUT', 1)
    monkeypatch.setattr(hc, 'HF_HUB_DOWNLOAD_TIMEOUT', 1)
    with pytest.raises(FileNotFoundError) as e:
        resolve_model_path('petite-llm-test/no-such-model')
    msg = str(e.value)
    assert 'could not be reached' in msg and 'local folder' in msg
    assert 'petite-llm-test/no-such-model' in msg


def test_name_maps():
    assert (map_hf_name('model.layers.7.self_attn.v_proj.weight')
            == ('model.layers.7.self_attn.qkv_proj.weight', 2))
    assert (map_hf_name('model.layers.7.mlp.gate_proj.weight')
            == ('model.layers.7.mlp.gate_up_proj.weight', 0))
    assert map_hf_name('lm_head.weight') == ('lm_head.weight', None)
    assert map_gguf_name('blk.7.ffn_down.weight') == 'model.layers.7.mlp.down_proj.weight'
    assert map_gguf_name('blk.7.attn_q_norm.weight') == 'model.layers.7.self_attn.q_norm.weight'
    assert map_gguf_name('token_embd.weight') == 'model.embed_tokens.weight'
    assert map_gguf_name('output_norm.weight') == 'model.norm.weight'


@pytest.mark.parametrize('n_heads,head_dim', [(1, 2), (3, 8), (4, 64)])
def test_unpermute_inverts_llama_cpp_permutation(n_heads, head_dim):
    w = torch.randn(n_heads * head_dim, 5)
    p = permute_qk(w, n_heads)
    assert torch.equal(unpermute_qk(p, n_heads), w)
    # within a head, row 2i of the permuted weight is row i of the original, row 2i+1 is row i + D/2
    assert torch.equal(p[:head_dim][0::2], w[:head_dim // 2])
    assert torch.equal(p[:head_dim][1::2], w[head_dim // 2:head_dim])
