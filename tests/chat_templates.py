"""Chat templates that render tools the way the Qwen families do, for tiny test checkpoints:

- HERMES: Qwen2.5 / Qwen3 style: tools as JSON in the system prompt, calls as
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, results in `<tool_response>`.
- XML_THINKING: Qwen3-Coder / Qwen3.5 style calls (`<function=NAME><parameter=P>...`) and a reply
  that opens in a `<think>` block unless `enable_thinking` is false.

`chat_checkpoint` copies a tiny checkpoint with one of them, its tags added to the tokenizer as
single tokens (as in Qwen's vocabulary), so the server's grammar and parsers meet them as such.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

TAGS = ("<tool_call>", "</tool_call>", "<think>", "</think>")

def _template(call_format: str, assistant: str, generation_prompt: str) -> str:
    """A ChatML template that shows tools, plugged with one family's call format: the sentence
    telling the model how to call, the assistant turn (content and calls), the generation prompt."""
    return """
{%- if messages[0].role == 'system' %}{%- set system = messages[0].content %}
{%- else %}{%- set system = 'You are a helpful assistant.' %}{%- endif %}
{{- '<|im_start|>system\\n' + system }}
{%- if tools %}
{{- '\\n\\n# Tools\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\nTo call a tool write """ + call_format + """' }}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- for m in messages %}
{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}
{%- elif m.role == 'assistant' %}""" + assistant + """
{{- '<|im_end|>\\n' }}
{%- elif m.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}""" + generation_prompt + """{%- endif %}
"""


HERMES = _template(
    '<tool_call>\\n{\\"name\\": <name>, \\"arguments\\": <object>}\\n</tool_call>',
    """
{{- '<|im_start|>assistant' }}
{%- if m.content %}{{- '\\n' + m.content }}{%- endif %}
{%- for call in m.tool_calls or [] %}
{{- '\\n<tool_call>\\n{"name": "' + call.function.name + '", "arguments": ' + (call.function.arguments | tojson) + '}\\n</tool_call>' }}
{%- endfor %}""",
    "{{- '<|im_start|>assistant\\n' }}")

XML_THINKING = _template(
    '<tool_call>\\n<function=NAME>\\n<parameter=P>\\nvalue\\n</parameter>\\n</function>\\n</tool_call>',
    """
{{- '<|im_start|>assistant\\n' }}
{%- if m.reasoning_content %}{{- '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}
{{- m.content }}
{%- for call in m.tool_calls or [] %}
{{- '\\n<tool_call>\\n<function=' + call.function.name + '>\\n' }}
{%- for name, value in call.function.arguments.items() %}
{{- '<parameter=' + name + '>\\n' + (value if value is string else value | tojson) + '\\n</parameter>\\n' }}
{%- endfor %}
{{- '</function>\\n</tool_call>' }}
{%- endfor %}""",
    """
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\\n\\n</think>\\n\\n' }}
{%- else %}{{- '<think>\\n' }}{%- endif %}
""")


def chat_checkpoint(source: Path, destination: Path, template: str) -> Path:
    """A copy of the tiny checkpoint `source` with `template` and the TAGS as single tokens."""
    from tokenizers import AddedToken, Tokenizer

    shutil.copytree(source, destination)
    tokenizer = Tokenizer.from_file(str(destination / "tokenizer.json"))
    tokenizer.add_tokens([AddedToken(tag, normalized=False, special=False) for tag in TAGS])
    tokenizer.save(str(destination / "tokenizer.json"))
    config_file = destination / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = template
    config_file.write_text(json.dumps(config, indent=2))
    return destination


def tag_id(checkpoint: Path, tag: str) -> int:
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(checkpoint / "tokenizer.json")).token_to_id(tag)


def chat_model(tmp_path_factory, tiny_checkpoint, name: str, template: str, generation: dict | None = None) -> Path:
    """The tests' tiny qwen3 model as `name`, with `template` and its tags as tokens, and `generation`
    merged into its generation_config.json (the model's sampling defaults)."""
    base = tiny_checkpoint("qwen3", tied=False, heads=8, kv_heads=2, head_dim=32, max_pos=2048)
    model = chat_checkpoint(base, tmp_path_factory.mktemp("models") / name, template)
    file = model / "generation_config.json"
    file.write_text(json.dumps(json.loads(file.read_text()) | (generation or {})))
    return model


def chat_server(tmp_path_factory, tiny_checkpoint, name: str, template: str, *flags: str,
                generation: dict | None = None):
    """`pagedserve serve` on chat_model(...) (use it as a context manager)."""
    from server_process import ServerProcess
    return ServerProcess(chat_model(tmp_path_factory, tiny_checkpoint, name, template, generation),
                         "--max-concurrency", "4", *flags, max_model_len=1024, kv_pool_tokens=16384)


def assert_refused(server, route: str, body: dict, param: str, words: str) -> None:
    """`body` on `route` is a 400 whose error names `param` and says `words`; the server still serves."""
    import httpx
    r = httpx.post(server.url + route, json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
