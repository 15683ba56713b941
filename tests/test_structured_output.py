"""Constrained decoding (engine/grammar.py) on tiny random models, which write garbage unless the
grammar holds them: every sample validates, batched rows with different grammars and unconstrained
rows share steps without changing each other, preemption keeps the grammar in step, greedy output
equals transformers' logits under the same llguidance mask, and logit_bias reaches the draw."""
from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from engine import LLM, SamplingParams
from engine.grammar import Grammar, GrammarCompiler, GrammarError
from engine.loading.tokenizer import load_tokenizer
from engine.request import FinishReason
from tiny_models import hf_model

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                  "id": {"type": "integer", "minimum": 0, "maximum": 9999}},
                 "required": ["name", "id"], "additionalProperties": False},
        "ok": {"type": "boolean"}}, "required": ["user", "ok"], "additionalProperties": False},
    "enum_array": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 4}},
        "required": ["color", "tags"], "additionalProperties": False},
    "numbers": {"type": "object", "properties": {
        "x": {"type": "number", "minimum": -10, "maximum": 10},
        "n": {"type": "integer", "minimum": -5, "maximum": 5}},
        "required": ["x", "n"], "additionalProperties": False},
    # random text in strings: control characters and quotes must come out escaped
    "escaped_strings": {"type": "array", "items": {"type": "string", "minLength": 2, "maxLength": 6},
                        "minItems": 1, "maxItems": 3},
    "nullable": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {"k": {"const": "v"}},
                                              "required": ["k"], "additionalProperties": False}]},
}
SAMPLES = 100


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint):
    return tiny_checkpoint("qwen3", tied=False, heads=8, kv_heads=2, head_dim=32, max_pos=2048)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model=str(model_dir), dtype="float32", max_model_len=1024, kv_pool_tokens=16384,
               max_concurrency=16, max_waiting=1024)


def _schema_params(schema: dict, seed: int, **kw) -> SamplingParams:
    kw.setdefault("max_tokens", 600)
    return SamplingParams(temperature=1.0, seed=seed, grammar=Grammar.json_schema(schema), **kw)


def test_every_seeded_sample_of_every_schema_validates_in_shared_steps(llm):
    free = SamplingParams(temperature=1.0, seed=7, max_tokens=40, ignore_eos=True)
    alone = llm.generate(["free text"], free)[0]
    names = list(SCHEMAS)
    # one run: every schema's rows and an unconstrained row in the same steps
    prompts, params = ["free text"], [free]
    for i in range(SAMPLES):
        for name in names:
            prompts.append(f"give me {name} {i}")
            params.append(_schema_params(SCHEMAS[name], seed=i))
    outs = llm.generate(prompts, params)
    assert outs[0].token_ids == alone.token_ids         # a constrained neighbour changes nothing
    for k, out in enumerate(outs[1:]):
        schema = SCHEMAS[names[k % len(names)]]
        assert out.finish_reason is FinishReason.STOP, (out.text, out.error)
        jsonschema.validate(json.loads(out.text), schema)
    # the random model really is held: unconstrained, it does not write JSON
    loose = llm.generate(["give me nested 0"], SamplingParams(temperature=1.0, seed=0, max_tokens=40))[0]
    with pytest.raises(ValueError):
        json.loads(loose.text)


def test_regex_choice_and_lark_grammars(llm):
    grammars = {"regex": Grammar("regex", r"[a-c]{3}-[0-9]{2}"),
                "choice": Grammar.choice(["yes", "no", "maybe so"]),
                "lark": Grammar("lark", 'start: "(" num ("+" num)* ")"\nnum: /[0-9]{1,3}/')}
    for kind, grammar in grammars.items():
        outs = llm.generate([f"{kind} {i}" for i in range(20)],
                            [SamplingParams(temperature=1.0, seed=i, max_tokens=200, grammar=grammar)
                             for i in range(20)])
        for out in outs:
            assert out.finish_reason is FinishReason.STOP
            if kind == "regex":
                assert len(out.text) == 6 and out.text[3] == "-" and set(out.text[:3]) <= set("abc")
            elif kind == "choice":
                assert out.text in ("yes", "no", "maybe so")
            else:
                assert out.text.startswith("(") and out.text.endswith(")")
                assert all(p.isdigit() for p in out.text[1:-1].split("+"))


def test_greedy_equals_transformers_under_the_same_mask(llm, model_dir):
    schema = SCHEMAS["nested"]
    tokenizer = load_tokenizer(model_dir)
    prompt = tokenizer.encode("the user record:")
    ours = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=200,
                                                 grammar=Grammar.json_schema(schema)))[0]
    model = hf_model(model_dir)
    eos = llm.engine.loop.eos_token_ids
    matcher = GrammarCompiler(tokenizer.to_json(), model.config.vocab_size, eos).matcher(
        Grammar.json_schema(schema))
    ids, expected = list(prompt), []
    with torch.no_grad():
        while not matcher.done and len(expected) < 200:
            logits = model(torch.tensor([ids])).logits[0, -1]
            bits = torch.tensor(list(matcher.mask()), dtype=torch.uint8)
            allowed = ((bits[:, None] >> torch.arange(8)) & 1).flatten()[:logits.numel()].bool()
            token = int(logits.masked_fill(~allowed, float("-inf")).argmax())
            expected.append(token)
            assert matcher.accept(token)
            if token in eos:
                break
            ids.append(token)
    assert ours.token_ids == expected
    jsonschema.validate(json.loads(ours.text), schema)


def test_preemption_mid_grammar_keeps_outputs_identical(model_dir):
    prompts = [f"record number {i} please" for i in range(6)]
    params = [_schema_params(SCHEMAS["enum_array"], seed=i, max_tokens=100) for i in range(6)]
    roomy = LLM(model=str(model_dir), dtype="float32", max_model_len=128, kv_pool_tokens=8192)
    tight = LLM(model=str(model_dir), dtype="float32", max_model_len=128, kv_pool_tokens=160,
                max_concurrency=6)
    expected = roomy.generate(prompts, params)
    outs = tight.generate(prompts, params)
    assert tight.engine.scheduler.stats().preemptions_total > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    for out in outs:
        jsonschema.validate(json.loads(out.text), SCHEMAS["enum_array"])
    assert tight.engine.scheduler.stats().blocks_used == 0


def test_grammar_ends_the_reply_even_when_eos_is_ignored(llm):
    out = llm.generate(["x"], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True,
                                             grammar=Grammar.choice(["done"])))[0]
    assert (out.text, out.finish_reason) == ("done", FinishReason.STOP)


def test_a_bad_grammar_is_refused_at_submit_and_nothing_stays_queued(llm):
    for grammar, words in [(Grammar.json_schema({"type": "objekt"}), "objekt"),
                           (Grammar("regex", "(ab"), "unclosed group"),
                           (Grammar("lark", "start: missing_rule"), "missing_rule")]:
        with pytest.raises(GrammarError, match=words):
            llm.generate(["x"], SamplingParams(grammar=grammar))
    assert llm.engine.scheduler.stats().blocks_used == 0 and not llm.engine.scheduler.has_work
    assert llm.generate(["x"], SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids


def test_logit_bias_pushes_and_bans_tokens(llm):
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    plain = llm.generate(["bias me"], greedy)[0].token_ids
    pushed = llm.generate(["bias me"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                      logit_bias={42: 100}))[0].token_ids
    assert pushed == [42] * 8
    banned = llm.generate(["bias me"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                      logit_bias={plain[0]: -100}))[0].token_ids
    assert banned[0] != plain[0]
    # clamped to +-100, whatever is asked
    assert SamplingParams(logit_bias={5: 1e9, 6: -1e9}).logit_bias == ((5, 100.0), (6, -100.0))
    out = llm.generate(["bias me"], SamplingParams(max_tokens=2, logit_bias={10**6: 1.0}))[0]
    assert out.finish_reason is FinishReason.ERROR and "logit_bias names token id 1000000" in out.error


def test_a_lazy_grammar_holds_only_what_follows_each_trigger(model_dir):
    tokenizer = load_tokenizer(model_dir)
    compiler = GrammarCompiler(tokenizer.to_json(), hf_model(model_dir).config.vocab_size, (0,))
    (start,) = tokenizer.encode("<|im_start|>")
    matcher = compiler.matcher(Grammar("lark", 'start: " ab"', trigger="<|im_start|>"))
    free, held = tokenizer.encode("x y"), tokenizer.encode(" ab")
    for _ in range(2):                          # free, the trigger, the grammar's match, and free again
        assert all(matcher.accept(t) and matcher.mask() is None for t in free)
        assert matcher.accept(start) and not matcher.dormant
        bits = torch.tensor(list(matcher.mask()), dtype=torch.uint8)
        allowed = ((bits[:, None] >> torch.arange(8)) & 1).flatten().bool()
        assert allowed[held[0]] and not allowed[free[0]] and not allowed[start]
        assert all(matcher.accept(t) for t in held) and matcher.dormant and not matcher.done
    assert matcher.accept(start) and not matcher.accept(free[0]) and matcher.error
    with pytest.raises(GrammarError, match="special token"):
        compiler.compile(Grammar("lark", 'start: "a"', trigger="x y"))
    with pytest.raises(GrammarError, match="trigger"):
        Grammar("lark", 'start: "a"', trigger="<|im_start|>", reasoning="inside")
