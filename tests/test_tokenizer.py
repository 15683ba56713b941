"""Our tokenizer and chat template against transformers' AutoTokenizer on the tiny tokenizer dir."""
from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from engine.loading.tokenizer import TokenizerError, load_tokenizer
from tiny_models import SPECIAL_TOKENS, build_tokenizer, special_token_id

MULTILINGUAL = ("Hello, wörld! Grüße aus München — 你好，世界。 def f(x): return x**2  # 🙂🚀\n"
                "\tTabs,  double  spaces, <|im_start|> inside text, and ünïcödé.")

CONVERSATIONS = {
    "user-only": [{"role": "user", "content": "Wie geht's? 你好"}],
    "with-system": [{"role": "system", "content": "Answer in one word."},
                    {"role": "user", "content": "Capital of France?"}],
    "multi-turn": [{"role": "system", "content": "Be brief."},
                   {"role": "user", "content": "2+2?"},
                   {"role": "assistant", "content": "4"},
                   {"role": "user", "content": "And 3+3?"}],
    "ends-with-assistant": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello 🙂"}],
}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def ours(tokenizer_dir):
    return load_tokenizer(tokenizer_dir)


@pytest.fixture(scope="module")
def theirs(tokenizer_dir):
    return AutoTokenizer.from_pretrained(tokenizer_dir)


def test_encode_decode_match_transformers(ours, theirs):
    ids = ours.encode(MULTILINGUAL)
    assert ids == theirs.encode(MULTILINGUAL, add_special_tokens=False)
    assert special_token_id("<|im_start|>") in ids  # special tokens in text become their ids
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    assert ours.decode(ids, skip_special_tokens=False) == MULTILINGUAL


def test_special_tokens_and_vocab(ours, theirs):
    assert ours.vocab_size == len(theirs)
    assert ours.eos_token == "<|im_end|>" and ours.bos_token is None
    assert ours.eos_token_id == theirs.eos_token_id == special_token_id("<|im_end|>")
    assert ours.special_token_ids == frozenset(special_token_id(t) for t in SPECIAL_TOKENS)
    assert ours.id_to_token(special_token_id("<|im_end|>")) == "<|im_end|>"


@pytest.mark.parametrize("generation_prompt", [True, False])
@pytest.mark.parametrize("name", CONVERSATIONS)
def test_chat_template_matches_transformers(ours, theirs, name, generation_prompt):
    messages = CONVERSATIONS[name]
    expected = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    assert ours.apply_chat_template(messages, add_generation_prompt=generation_prompt) == expected
    assert ours.chat_ids(messages, add_generation_prompt=generation_prompt) == theirs.encode(
        expected, add_special_tokens=False)


def test_default_system_message_and_generation_prompt(ours):
    text = ours.apply_chat_template(CONVERSATIONS["user-only"])
    assert text == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                    "<|im_start|>user\nWie geht's? 你好<|im_end|>\n<|im_start|>assistant\n")


# A template exercising the features transformers adds: tojson without ASCII escapes, extras, specials.
FEATURE_TEMPLATE = ("{{ messages | tojson }}|{{ eos_token }}|{{ bos_token }}|{{ tools is none }}|"
                    "{{ enable_thinking }}|{% for m in messages %}{% if loop.index > 1 %}{% break %}"
                    "{% endif %}{{ m.role }}{% endfor %}")


def test_template_features_match_transformers(tokenizer_dir, tmp_path):
    directory = build_tokenizer(tmp_path / "tok")
    (directory / "chat_template.jinja").write_text(FEATURE_TEMPLATE)
    messages = CONVERSATIONS["with-system"] + [{"role": "user", "content": "<b>ünï</b>"}]
    expected = AutoTokenizer.from_pretrained(directory).apply_chat_template(
        messages, tokenize=False, enable_thinking=False)
    assert load_tokenizer(directory).apply_chat_template(messages, enable_thinking=False) == expected
    assert '"<b>ünï</b>"' in expected


def test_chat_template_jinja_file_takes_precedence(tmp_path):
    directory = build_tokenizer(tmp_path / "tok")
    (directory / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")
    text = load_tokenizer(directory).apply_chat_template(CONVERSATIONS["multi-turn"])
    assert text == "[system] Be brief.\n[user] 2+2?\n[assistant] 4\n[user] And 3+3?\n"


def test_special_tokens_given_as_dicts(tmp_path):
    directory = build_tokenizer(tmp_path / "tok")
    config_file = directory / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["eos_token"] = {"content": "<|endoftext|>", "special": True}
    config_file.write_text(json.dumps(config))
    assert load_tokenizer(directory).eos_token_id == special_token_id("<|endoftext|>")


def test_raise_exception_becomes_tokenizer_error(tmp_path):
    directory = build_tokenizer(tmp_path / "tok")
    (directory / "chat_template.jinja").write_text(
        "{% if messages[0].role != 'user' %}{{ raise_exception('Conversations must start with a user') }}"
        "{% endif %}ok")
    tok = load_tokenizer(directory)
    assert tok.apply_chat_template(CONVERSATIONS["user-only"]) == "ok"
    with pytest.raises(TokenizerError, match=r"chat_template\.jinja: chat template error: Conversations must"):
        tok.apply_chat_template(CONVERSATIONS["with-system"])


def test_template_syntax_error_names_the_line(tmp_path):
    directory = build_tokenizer(tmp_path / "tok")
    (directory / "chat_template.jinja").write_text("line one\n{% if messages %}unclosed")
    with pytest.raises(TokenizerError, match=r"chat_template\.jinja: chat template syntax error at line 2"):
        load_tokenizer(directory).apply_chat_template(CONVERSATIONS["user-only"])


def test_missing_tokenizer_json(tmp_path):
    directory = build_tokenizer(tmp_path / "tok")
    (directory / "tokenizer.json").unlink()
    with pytest.raises(TokenizerError, match=r"tokenizer\.json: missing"):
        load_tokenizer(directory)


def test_no_chat_template(tmp_path):
    directory = build_tokenizer(tmp_path / "tok")
    config_file = directory / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    del config["chat_template"]
    config_file.write_text(json.dumps(config))
    with pytest.raises(TokenizerError, match=r"no chat template"):
        load_tokenizer(directory).apply_chat_template(CONVERSATIONS["user-only"])
