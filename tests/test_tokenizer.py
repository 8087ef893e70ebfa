"""Tokenizer (chapter 07): byte-level BPE from folders, GGUFs and tiktoken ranks; chat templates
rendered exactly like `apply_chat_template` of transformers (5.23.0, the version settings.ini
pins); the streaming detokenizer.

Tests that need the Qwen2.5-Coder GGUF (installed by `make setup-slow`) are marked slow."""
import json
import shutil
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))
from qwen3_tokenizer import (QWEN3_ADDED_IDS, QWEN3_ADDED_TOKENS,  # noqa: E402
                             QWEN3_CHAT_TEMPLATE, QWEN3_GENERATION_CONFIG, qwen3_tokenizer_dir,
                             qwen_tiktoken_path, write_qwen3_tokenizer)

from petite_llm.model.tokenizer import (IncrementalDetokenizer, ThinkSplitter,  # noqa: E402
                                        Tokenizer, bytes_to_unicode, load_tiktoken_ranks,
                                        merges_from_ranks, spell_bytes, split_reasoning,
                                        think_and_answer)

# ---------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def qwen3():
    return Tokenizer.from_pretrained(qwen3_tokenizer_dir())


@pytest.fixture(scope="module")
def smol_path():
    weights = pytest.importorskip("petite_llm.model.weights")
    return weights.smollm2_gguf_path()


@pytest.fixture(scope="module")
def smol(smol_path):
    return Tokenizer.from_pretrained(smol_path)


@pytest.fixture(scope="module")
def qwen25_path():
    weights = pytest.importorskip("petite_llm.model.weights")
    return weights.qwen25_coder_gguf_path()


@pytest.fixture(scope="module")
def qwen25_meta(qwen25_path):
    from petite_llm.model.config import read_gguf_metadata
    return read_gguf_metadata(qwen25_path)


@pytest.fixture(scope="module")
def qwen25(qwen25_meta):
    return Tokenizer.from_gguf_metadata(qwen25_meta)


def hf_tokenizer(tok: Tokenizer, template: str):
    "The transformers oracle: a fast tokenizer on the same backend, template and special tokens."
    from transformers import PreTrainedTokenizerFast
    hf = PreTrainedTokenizerFast(tokenizer_object=tok.backend, **tok.special_tokens)
    hf.chat_template = template
    return hf


TEXTS = ["The capital of France is Paris.", "Hello, world! 2025 🙂",
         "  leading spaces\n\n\ttabs\r\nand CRLF", "naïve café, Ünïcödé — “quotes” …",
         "中文分词测试：你好，世界！", "日本語のテキスト、カタカナ",
         "🙂🙃👍🏽👨‍👩‍👧",
         "def f(x):\n    return x**2  # comment\n", "I'm, you're, they'll, it's, we'd've",
         "1234567890 3.14159 -42",
         "<|im_start|>user\nhi<|im_end|>\n", "a <think>reason</think> b", "", " ", "\n"]

# ---------------------------------------------------------------- BPE pieces

def test_byte_alphabet_matches_transformers():
    from transformers.convert_slow_tokenizer import bytes_to_unicode as hf_bytes_to_unicode
    assert bytes_to_unicode() == hf_bytes_to_unicode()
    assert spell_bytes(" Paris".encode()) == "ĠParis"


def test_merges_from_ranks_runs_bpe():
    ranks = {b: i for i, b in enumerate([b"a", b"b", b"c", b"ab", b"bc", b"abc"])}
    assert merges_from_ranks(ranks) == [(b"a", b"b"), (b"b", b"c"), (b"ab", b"c")]
    ranks = {b: i for i, b in enumerate([b"a", b"b", b"c", b"bc", b"ab", b"abc"])}
    assert merges_from_ranks(ranks)[-1] == (b"a", b"bc")
    with pytest.raises(ValueError, match="cannot be built"):
        merges_from_ranks({b"a": 0, b"abc": 1})


@pytest.mark.slow  # needs the Qwen2.5-Coder GGUF chunks (make setup-slow)
def test_merges_from_qwen_ranks_equal_qwen_merges(qwen25_meta):
    "Merges derived from qwen.tiktoken are, in order, those Qwen2.5 ships (stored in its GGUF)."
    ranks = load_tiktoken_ranks(qwen_tiktoken_path())
    derived = [f"{spell_bytes(a)} {spell_bytes(b)}" for a, b in merges_from_ranks(ranks)]
    assert derived == list(qwen25_meta["tokenizer.ggml.merges"])

# ---------------------------------------------------------------- the Qwen3 fixture

def test_qwen3_fixture_known_ids(qwen3):
    assert qwen3.encode("The capital of France is") == [785, 6722, 315, 9625, 374]
    assert qwen3.encode(" Paris") == [12095]
    assert len(QWEN3_ADDED_TOKENS) == 26 and QWEN3_ADDED_IDS["</think>"] == 151668
    for tok, id_ in QWEN3_ADDED_IDS.items():
        assert qwen3.token_to_id(tok) == id_ and qwen3.id_to_token(id_) == tok
        assert qwen3.encode(tok) == [id_]
    assert qwen3.encode("<|im_start|>user\nhi<|im_end|>") == [151644, 872, 198, 6023, 151645]
    assert qwen3.decode([151644, 872, 151645]) == "user"  # special: skipped
    # added but not special: kept
    assert qwen3.decode([151667, 6023, 151668]) == "<think>hi</think>"
    assert qwen3.decode([151644, 872], skip_special_tokens=False) == "<|im_start|>user"
    assert len(qwen3) == 151669


def test_qwen3_fixture_special_config(qwen3):
    assert qwen3.eos_token_ids == [151645, 151643]
    assert qwen3.bos_token_id is None
    assert qwen3.special_tokens == {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    assert qwen3.generation_config == QWEN3_GENERATION_CONFIG


def test_qwen3_fixture_nfc(qwen3):
    assert qwen3.encode("cafe\u0301") == qwen3.encode("café")  # Qwen normalizes to NFC first


@pytest.mark.slow  # needs the Qwen2.5-Coder GGUF chunks (make setup-slow)
def test_qwen3_fixture_matches_qwen25_gguf_tokenizer(qwen3, qwen25):
    "Same 151643 ranks: the Qwen3 tokenizer built from tiktoken and Qwen2.5's GGUF one agree."
    for text in [t for t in TEXTS if "think>" not in t]:  # Qwen2.5 has no <think> token
        assert qwen3.encode(text) == qwen25.encode(text), text


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(max_size=60))
def test_qwen3_fixture_roundtrip(qwen3, text):
    import unicodedata
    roundtrip = qwen3.decode(qwen3.encode(text), skip_special_tokens=False)
    assert roundtrip == unicodedata.normalize("NFC", text)


def test_write_qwen3_tokenizer_keeps_generation_config(tmp_path):
    gen_config = {"eos_token_id": 151645, "temperature": 0.7}
    (tmp_path / "generation_config.json").write_text(json.dumps(gen_config))
    write_qwen3_tokenizer(tmp_path)
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.generation_config == gen_config and tok.eos_token_ids == [151645]

# ------------------------------------------------------- folders: eos ids, templates, errors

def _folder(tmp_path, **files):
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(qwen3_tokenizer_dir() / f, tmp_path / f)
    for name, content in files.items():
        text = content if isinstance(content, str) else json.dumps(content)
        (tmp_path / name.replace("__", ".")).write_text(text)
    return tmp_path


def test_reads_a_folder_transformers_saved(tmp_path, qwen3):
    "transformers 5 writes chat_template.jinja beside tokenizer_config.json: we read what it wrote."
    hf = hf_tokenizer(qwen3, QWEN3_CHAT_TEMPLATE)
    hf.save_pretrained(tmp_path)
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.chat_template == QWEN3_CHAT_TEMPLATE and tok.eos_token_ids == [151645]
    assert tok.special_tokens == {k: v for k, v in hf.special_tokens_map.items()}
    msgs = CONVERSATIONS["multi_turn"]
    assert tok.apply_chat_template(msgs, enable_thinking=False) == hf.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert tok.encode(TEXTS[4]) == hf.encode(TEXTS[4], add_special_tokens=False)


def test_eos_ids_are_the_union_of_three_files(tmp_path):
    folder = _folder(tmp_path, config__json={"eos_token_id": 151643},
                     generation_config__json={"eos_token_id": [151645, 151662]})
    tok = Tokenizer.from_pretrained(folder)
    assert tok.eos_token_ids == [151645, 151643, 151662]
    assert tok.generation_config == {"eos_token_id": [151645, 151662]}


def test_chat_template_jinja_file_wins(tmp_path):
    folder = _folder(tmp_path, chat_template__jinja="{{ messages[0].content }}!")
    tok = Tokenizer.from_pretrained(folder)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi!"


def test_named_templates_pick_tool_use(tmp_path):
    cfg = json.loads((qwen3_tokenizer_dir() / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "default", "template": "plain"},
                            {"name": "tool_use", "template": "tools"}]
    shutil.copy(qwen3_tokenizer_dir() / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer.from_pretrained(tmp_path)
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs) == "plain"
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert tok.apply_chat_template(msgs, tools=tools) == "tools"


def test_errors_name_the_problem(tmp_path, qwen3):
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_pretrained(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(qwen3.backend).apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="at least one message"):
        qwen3.apply_chat_template([])
    with pytest.raises(TypeError, match="JSON-schema"):
        qwen3.apply_chat_template([{"role": "user", "content": "hi"}], tools=[print])
    import jinja2
    with pytest.raises(jinja2.exceptions.TemplateError, match="boom"):
        refusing = Tokenizer(qwen3.backend, chat_template="{{ raise_exception('boom') }}")
        refusing.apply_chat_template([{"role": "user"}])


def _tiny_gguf(path, pre="qwen2", model="gpt2"):
    import gguf
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_tokenizer_model(model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(["a", "b", "ab", "<|end|>"])
    w.add_token_types([1, 1, 1, 3])
    w.add_token_merges(["a b"])
    w.add_eos_token_id(3)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_tiny_and_unknown_pre(tmp_path):
    tok = Tokenizer.from_pretrained(_tiny_gguf(tmp_path / "ok.gguf"))
    assert tok.encode("abab<|end|>") == [2, 2, 3]
    assert tok.eos_token_ids == [3] and tok.chat_template is None
    with pytest.raises(ValueError, match=r"tokenizer.ggml.pre='mystery' is not supported"):
        Tokenizer.from_pretrained(_tiny_gguf(tmp_path / "pre.gguf", pre="mystery"))
    with pytest.raises(ValueError, match=r"tokenizer.ggml.model='llama' is not supported"):
        Tokenizer.from_pretrained(_tiny_gguf(tmp_path / "spm.gguf", model="llama"))
    (tmp_path / "bad.gguf").write_bytes(b"GGUF\x03\x00")
    with pytest.raises(ValueError, match="not a valid GGUF"):
        Tokenizer.from_pretrained(tmp_path / "bad.gguf")

# ---------------------------------------------- GGUF tokenizers vs transformers' GGUF loader

def _hf_from_gguf(path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(Path(path).parent), gguf_file=Path(path).name)


def test_smollm2_gguf_tokenizer_matches_transformers(smol, smol_path):
    hf = _hf_from_gguf(smol_path)
    assert smol.bos_token_id == hf.bos_token_id == 1
    assert smol.eos_token_ids == [hf.eos_token_id] == [2]
    assert smol.chat_template == hf.chat_template
    for text in TEXTS:
        ids = smol.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False), text
        assert smol.decode(ids) == hf.decode(ids, skip_special_tokens=True)
        assert (smol.decode(ids, skip_special_tokens=False)
                == hf.decode(ids, skip_special_tokens=False))


@pytest.mark.slow  # needs the Qwen2.5-Coder GGUF chunks (make setup-slow)
def test_qwen25_gguf_tokenizer_matches_transformers(qwen25, qwen25_path):
    hf = _hf_from_gguf(qwen25_path)
    assert qwen25.eos_token_ids == [hf.eos_token_id] == [151645]
    assert qwen25.chat_template == hf.chat_template
    for text in TEXTS + ["<tool_call>\n{}\n</tool_call>", "<|fim_prefix|>x<|fim_suffix|>"]:
        ids = qwen25.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False), text
        assert qwen25.decode(ids) == hf.decode(ids, skip_special_tokens=True)

# ---------------------------------------------------------------- chat templates vs transformers

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city, in <units> (°C or °F) & more",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "description": "e.g. Zürich"},
                                  "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city"]}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "now", "description": "The time",
    "parameters": {"type": "object", "properties": {}}}}

CONVERSATIONS = {
    "single": [{"role": "user", "content": "What is 2+2?"}],
    "system": [{"role": "system", "content": "You are terse."},
               {"role": "user", "content": "Hi there"}],
    "multi_turn": [{"role": "system", "content": "Be kind."},
                   {"role": "user", "content": "Hello"},
                   {"role": "assistant", "content": "Hi! How can I help?"},
                   {"role": "user", "content": "Tell me a joke 🙂"},
                   {"role": "assistant", "content": "Why did the GPU cross the road?"},
                   {"role": "user", "content": "Why?"}],
    "unicode": [{"role": "user", "content": "中文？ <b>html</b> & \"quotes\"\n\nnewlines"}],
    "tool_use": [{"role": "user", "content": "Weather in Paris?"},
                 {"role": "assistant", "content": None, "tool_calls": [
                     {"type": "function", "function": {
                         "name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}},
                     {"type": "function", "function": {"name": "now", "arguments": {}}}]},
                 {"role": "tool", "content": "{\"temp\": 21}"},
                 {"role": "tool", "content": "12:00"},
                 {"role": "assistant", "content": "It is 21 °C at noon."},
                 {"role": "user", "content": "Thanks"}],
}
TOOL_CONVERSATIONS = {"tool_use"}


def _cases(tools_ok=True):
    for name, msgs in CONVERSATIONS.items():
        if name in TOOL_CONVERSATIONS and not tools_ok:
            continue
        tools = [WEATHER_TOOL, TIME_TOOL] if name in TOOL_CONVERSATIONS else None
        for agp in (True, False):
            yield name, msgs, agp, tools
    yield "tools_no_calls", CONVERSATIONS["system"], True, [WEATHER_TOOL]


def _check_parity(tok, template, tools_ok=True, **extra):
    hf = hf_tokenizer(tok, template)
    tok = Tokenizer(tok.backend, chat_template=template, special_tokens=tok.special_tokens)
    for name, msgs, agp, tools in _cases(tools_ok):
        kw = dict(add_generation_prompt=agp, tools=tools, **extra)
        ours = tok.apply_chat_template(msgs, **kw)
        theirs = hf.apply_chat_template(msgs, tokenize=False, **kw)
        assert ours == theirs, name
        assert (tok.apply_chat_template(msgs, tokenize=True, **kw)
                == hf.apply_chat_template(msgs, tokenize=True, return_dict=False, **kw))


def test_smollm2_template_matches_transformers(smol):
    _check_parity(smol, smol.chat_template, tools_ok=False)  # its template knows no tool calls
    text = smol.apply_chat_template(CONVERSATIONS["single"])
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, "
                    "trained by Hugging Face<|im_end|>\n"
                    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow  # needs the Qwen2.5-Coder GGUF chunks (make setup-slow)
def test_qwen25_tool_template_matches_transformers(qwen25):
    assert "tool_call" in qwen25.chat_template
    _check_parity(qwen25, qwen25.chat_template)
    text = qwen25.apply_chat_template(CONVERSATIONS["tool_use"], tools=[WEATHER_TOOL])
    # tojson: no HTML escaping, no \\u
    assert '"description": "Weather in a city, in <units> (°C or °F) & more"' in text
    call = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
    assert f'<tool_call>\n{call}\n</tool_call>' in text


@pytest.mark.parametrize("enable_thinking", [None, True, False])
def test_qwen3_template_matches_transformers(qwen3, enable_thinking):
    assert qwen3.chat_template == QWEN3_CHAT_TEMPLATE
    _check_parity(qwen3, QWEN3_CHAT_TEMPLATE, enable_thinking=enable_thinking)


THINKING_CHAT = [
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4", "reasoning_content": "Two plus two is four."},
    {"role": "user", "content": "3+3?"},
    {"role": "assistant", "content": "<think>\nThree and three.\n</think>\n\n6"},
]


def test_qwen3_thinking_switch(qwen3):
    msgs = [{"role": "user", "content": "Hi"}]
    on = qwen3.apply_chat_template(msgs)
    assert on == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert on == qwen3.apply_chat_template(msgs, enable_thinking=True)
    off = qwen3.apply_chat_template(msgs, enable_thinking=False)
    assert off == on + "<think>\n\n</think>\n\n"
    ids = qwen3.apply_chat_template(msgs, enable_thinking=False, tokenize=True)
    nn = qwen3.token_to_id("ĊĊ")  # "\n\n" is one token, never merged across an added token
    assert ids[-4:] == [151667, nn, 151668, nn]
    assert qwen3.decode(ids).endswith("assistant\n<think>\n\n</think>\n\n")


def test_qwen3_reasoning_of_old_turns_is_dropped(qwen3):
    text = qwen3.apply_chat_template(THINKING_CHAT, add_generation_prompt=False)
    # before the last query: dropped
    assert "Two plus two" not in text and "<|im_start|>assistant\n4<|im_end|>" in text
    # after it: kept
    assert "<|im_start|>assistant\n<think>\nThree and three.\n</think>\n\n6<|im_end|>\n" in text
    # `thinking` / `reasoning` are accepted as other names for reasoning_content, as in transformers
    last = dict(THINKING_CHAT[-1], content="6", thinking="Three and three.")
    renamed = THINKING_CHAT[:-1] + [last]
    assert qwen3.apply_chat_template(renamed, add_generation_prompt=False) == text


def test_qwen3_thinking_chat_matches_transformers(qwen3):
    hf = hf_tokenizer(qwen3, QWEN3_CHAT_TEMPLATE)
    for agp in (True, False):
        for thinking in (None, False):
            kw = dict(add_generation_prompt=agp, enable_thinking=thinking)
            assert (qwen3.apply_chat_template(THINKING_CHAT, **kw)
                    == hf.apply_chat_template(THINKING_CHAT, tokenize=False, **kw))


def test_template_extras(qwen3):
    template = ("{{ bos_token }}{{ custom }}|{{ strftime_now('%Y') | length }}"
                "|{{ {'k': '<é>'} | tojson }}"
                "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
                "{{ m.role }}{% endfor %}")
    tok = Tokenizer(qwen3.backend, chat_template=template,
                    special_tokens={"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"})
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert tok.apply_chat_template(msgs, custom="X") == '<|endoftext|>X|4|{"k": "<é>"}user'

# ---------------------------------------------------------------- streaming detokenizer

def _stream(tok, ids, **kw):
    d = IncrementalDetokenizer(tok, **kw)
    deltas = [d.add(i) for i in ids] + [d.finish()]
    return deltas, d


def _truncate_at_stop(text, stops):
    hits = [(i, s) for s in stops if s and (i := text.find(s)) >= 0]
    return (text, None) if not hits else (text[:min(hits)[0]], min(hits)[1])


def test_detokenizer_holds_split_characters(qwen3):
    # the last four characters are cut into byte pieces
    text = "你好，世界！ 龘𠀋 🦜🫠 ok"
    ids = qwen3.encode(text)
    # the naive way prints replacement characters
    assert "\ufffd" in "".join(qwen3.decode([i]) for i in ids)
    deltas, d = _stream(qwen3, ids)
    assert "".join(deltas) == text == d.text and not any("\ufffd" in x for x in deltas)
    assert d.stopped is None


def test_detokenizer_stop_string_across_tokens(qwen3):
    text = "Thought: easy.\nObservation: 42"
    deltas, d = _stream(qwen3, qwen3.encode(text), stop=["\nObservation:"])
    assert "".join(deltas) == "Thought: easy." and d.stopped == "\nObservation:"
    assert d.add(12) == "" and d.finish() == ""  # stopped: nothing more
    deltas, d = _stream(qwen3, qwen3.encode("a\nObjection: b"), stop=["\nObservation:"])
    assert "".join(deltas) == "a\nObjection: b" and d.stopped is None


def test_detokenizer_skip_special_tokens(qwen3):
    ids = qwen3.encode("<|im_start|>assistant\n<think>\nhm\n</think>\n\nYes<|im_end|>")
    assert "".join(_stream(qwen3, ids)[0]) == "assistant\n<think>\nhm\n</think>\n\nYes"
    deltas, _ = _stream(qwen3, ids, skip_special_tokens=False)
    assert "".join(deltas) == qwen3.decode(ids, skip_special_tokens=False)
    deltas, d = _stream(qwen3, ids, skip_special_tokens=False, stop=["<|im_end|>"])
    assert "".join(deltas).endswith("Yes") and d.stopped == "<|im_end|>"


ALPHABET = st.sampled_from(list("ab \n.,:!?") + list("éüß中文字你好世界")
                           + list("龘𠀋🦜🫠ქ")
                           + ["🙂", "👍🏽", "👨‍👩‍👧", "€", "\u0301"])
texts = st.lists(ALPHABET, max_size=40).map("".join)


@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=texts, data=st.data())
def test_detokenizer_property(qwen3, text, data):
    "Deltas add up to decode(all ids) cut at the first stop string; no delta ever has a U+FFFD."
    ids = qwen3.encode(text)
    full = qwen3.decode(ids)
    # a stop string: any text, or a piece of 1 to 4 characters of the decoded text
    pieces = st.integers(0, max(len(full) - 1, 0)).flatmap(
        lambda i: st.integers(i + 1, i + 4).map(lambda j: full[i:j]))
    stops = data.draw(st.lists(st.one_of(texts.filter(bool), pieces).filter(bool), max_size=3))
    # then the first stop string to finish is the first to start
    stops = [s for s in stops if not any(s != o and s in o for o in stops)]
    deltas, d = _stream(qwen3, ids, stop=stops)
    expected, stopped = _truncate_at_stop(full, stops)
    assert "".join(deltas) == expected and d.stopped == stopped
    assert not any("\ufffd" in x for x in deltas)


@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(st.integers(0, 151668), max_size=30))
def test_detokenizer_arbitrary_ids(qwen3, ids):
    "Any ids (even invalid UTF-8): the stream adds up to decode(ids), U+FFFD only where it has one."
    deltas, _ = _stream(qwen3, ids)
    assert "".join(deltas) == qwen3.decode(ids)
    deltas, _ = _stream(qwen3, ids, skip_special_tokens=False)
    assert "".join(deltas) == qwen3.decode(ids, skip_special_tokens=False)


# ---------------------------------------------------------------- reasoning apart from the answer

REPLIES = ["<think>\nhmm, Paris\n</think>\n\nParis.", "Paris.", "<think>cut off",
           "a < b </thin no tag", "<thi", "no open tag</think>answer", "a <b> <think>x</think>y"]


def _streamed(reply: str, size: int) -> tuple[str, str]:
    "The reply fed to a ThinkSplitter in pieces of `size` characters, joined by kind."
    splitter = ThinkSplitter()
    pieces = [p for i in range(0, len(reply), size) for p in splitter.feed(reply[i:i + size])]
    return think_and_answer(pieces + splitter.finish())


def test_split_reasoning_whole():
    assert split_reasoning(REPLIES[0]) == ("\nhmm, Paris\n", "\n\nParis.")
    assert split_reasoning("Paris.") == (None, "Paris.")
    assert split_reasoning("<think>cut off") == ("cut off", "")          # stopped while thinking
    assert split_reasoning("no open tag</think>answer") == (None, "no open tag</think>answer")
    assert split_reasoning("a <b> <think>x</think>y") == ("x", "a <b> y")


@pytest.mark.parametrize("reply", REPLIES)
def test_streamed_in_any_pieces_adds_up_to_the_whole_split(reply):
    reasoning, answer = split_reasoning(reply)
    for size in (1, 2, 3, 5, len(reply) or 1):
        assert _streamed(reply, size) == (reasoning or "", answer), (reply, size)


def test_splitter_holds_back_only_what_may_become_a_tag():
    splitter = ThinkSplitter()
    assert splitter.feed("a <") == [("answer", "a ")]            # '<' may start <think>
    assert splitter.feed("b> <th") == [("answer", "<b> ")]
    assert splitter.feed("in") == []                             # '<thin' still may
    assert splitter.feed("k>x</thi") == [("think", "x")]
    assert splitter.feed("nk>y") == [("answer", "y")]
    assert splitter.finish() == []

