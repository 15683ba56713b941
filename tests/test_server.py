"""The OpenAI-compatible server as a client sees it: one real `pagedserve serve` process on a tiny fp32
model, driven by the official `openai` client, raw httpx and schemathesis. Answers are checked against
transformers (greedy tokens and logprobs) and the checkpoint's own tokenizer."""
from __future__ import annotations

import contextlib
import json

import httpx
import openai
import pytest
import schemathesis
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from tokenizers import Tokenizer

from server_process import ServerProcess
from tiny_models import hf_model

API_KEY = "sk-test"
MAX_MODEL_LEN = 256
MAX_BODY_BYTES = 65536
TINY = dict(tied=False, heads=8, kv_heads=2, head_dim=32, max_pos=2048)


def metric(text: str, name: str) -> float:
    """A sample's value from Prometheus text (`name` includes any labels)."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(f"{name} not in metrics")


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint):
    return tiny_checkpoint("qwen3", **TINY)


@pytest.fixture(scope="module")
def server(model_dir):
    # the body limit comes from the environment: precedence flag > env > file works through click
    # keep-alive comments every 50 ms: a queued request sees several long before its first token
    # fp32 K/V: the completions are compared with transformers' logprobs (the default stores bf16 on CPUs)
    with ServerProcess(model_dir, "--api-key", API_KEY, "--max-concurrency", "4", "--sse-keepalive-s", "0.05",
                       "--kv-cache-dtype", "fp32", max_model_len=MAX_MODEL_LEN,
                       env={"PAGEDSERVE_MAX_BODY_BYTES": str(MAX_BODY_BYTES)}) as srv:
        yield srv


@pytest.fixture(scope="module")
def auth():
    return {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def test_health_answers_503_while_loading_then_200(server):
    first_ok = server.health.index(200)
    assert first_ok > 0 and set(server.health[:first_ok]) == {503}


def test_greedy_completion_matches_transformers(server, oai, model_dir):
    prompt = [17, 250, 3, 99, 140, 41, 7, 300]
    out = oai.completions.create(model=model_dir.name, prompt=prompt, max_tokens=8, temperature=0,
                                 logprobs=0, extra_body={"ignore_eos": True})
    model = hf_model(model_dir)
    with torch.no_grad():
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(prompt):]
        logits = model(torch.tensor([prompt + ids.tolist()[:-1]])).logits[0, len(prompt) - 1:]
    expected_lp = torch.log_softmax(logits, -1).gather(1, ids[:, None])[:, 0]
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    choice = out.choices[0]
    assert out.id.startswith("cmpl-") and choice.finish_reason == "length"
    assert choice.text == tok.decode(ids.tolist())
    assert choice.logprobs.token_logprobs == pytest.approx(expected_lp.tolist(), abs=1e-3)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (8, 8)


def test_chat_stream_equals_whole_answer(oai):
    messages = [{"role": "user", "content": "Der schnelle braune Fuchs"}]
    kw = dict(model=oai.models.list().data[0].id, messages=messages, temperature=0, max_tokens=20)
    whole = oai.chat.completions.create(**kw)
    chunks = list(oai.chat.completions.create(**kw, stream=True,
                                              stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and text
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].id.startswith("chatcmpl-")
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == whole.choices[0].finish_reason and set(finals[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_usage_counts_the_prompt_tokens_the_prefix_cache_held(server, oai, auth):
    block = httpx.get(server.url + "/props", headers=auth).json()["block_size"]
    name = oai.models.list().data[0].id
    chat = dict(model=name, messages=[{"role": "user", "content": "Caches keep what was read. " * 5}],
                temperature=0, max_tokens=2)
    first, again = oai.chat.completions.create(**chat), oai.chat.completions.create(**chat)
    streamed = list(oai.chat.completions.create(**chat, stream=True, stream_options={"include_usage": True}))
    prompt = first.usage.prompt_tokens
    # a repeated prompt reads every block but the one holding its last token, which is computed to sample
    full = (prompt - 1) // block * block
    assert first.usage.prompt_tokens_details.cached_tokens < full
    assert again.usage.prompt_tokens_details.cached_tokens == full > 0
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == full
    text = dict(model=name, prompt=list(range(5, 5 + 2 * block + 3)), max_tokens=1)
    cached = [oai.completions.create(**text).usage.prompt_tokens_details.cached_tokens for _ in range(2)]
    assert cached == [0, 2 * block]


def test_raw_sse_lines_end_with_done(server, auth):
    body = {"prompt": "The quick", "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=auth) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    data = [e for e in events if not e.startswith(":")]
    assert all(e.startswith("data: ") for e in data) and data[-1] == "data: [DONE]"
    parsed = [json.loads(e[6:]) for e in data[:-1]]
    assert sum(p["choices"][0]["finish_reason"] == "length" for p in parsed) == 1


LONG_PROMPT = "fox " * 300
BAD_INPUTS = [
    # (path, body or raw bytes, headers override, status, words the message must hold, param)
    ("/v1/chat/completions", b'{"messages": [', None, 400, "not valid JSON", None),
    ("/v1/chat/completions", {"model": "x"}, None, 400, "messages", "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": -1},
     None, 400, "temperature", "temperature"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 0},
     None, 400, "greater than or equal to 1", "n"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, None, 400, "top_p", "top_p"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}]},
     None, 400, "chat template does not show tools", "tools"),
    ("/v1/completions", {"prompt": "hi", "stop": ""}, None, 400, "stop", "stop"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}', None, 400, "temperature",
     "temperature"),
    ("/v1/completions", {"prompt": "hi", "model": "../../etc/passwd"}, None, 404, "not served",
     "model"),
    ("/v1/completions", {"prompt": LONG_PROMPT}, None, 400, f"max_model_len is {MAX_MODEL_LEN}",
     "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 10**6]}, None, 400, "out of range", "prompt"),
    ("/v1/completions", {"prompt": "hi"}, {"Authorization": "Bearer wrong"}, 401, "API key", None),
    ("/v1/models", None, {}, 401, "API key", None),
    ("/v1/completions", {"prompt": "x" * MAX_BODY_BYTES}, None, 413, f"{MAX_BODY_BYTES:,}", None),
    ("/detokenize", {"tokens": [-1]}, None, 400, "out of range", "tokens"),
    ("/v1/nowhere", {}, None, 404, "Not Found", None),
]


@pytest.mark.parametrize("path,body,headers,status,words,param", BAD_INPUTS,
                         ids=[f"{b[3]}-{i}" for i, b in enumerate(BAD_INPUTS)])
def test_client_mistakes_get_openai_errors(server, auth, model_dir, path, body, headers, status,
                                           words, param):
    hdrs = auth if headers is None else headers
    if isinstance(body, bytes):
        r = httpx.post(server.url + path, content=body,
                       headers={**hdrs, "content-type": "application/json"})
    elif body is None:
        r = httpx.get(server.url + path, headers=hdrs)
    else:
        r = httpx.post(server.url + path, json=body, headers=hdrs)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert words in error["message"] and error["param"] == param
    if body == {"prompt": LONG_PROMPT}:     # both numbers: the prompt's length and the limit
        n = len(Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(LONG_PROMPT).ids)
        assert f"prompt has {n:,} tokens" in error["message"]
    assert httpx.get(server.url + "/health").status_code == 200


def test_models_props_and_tokenize(server, auth, model_dir, oai):
    models = httpx.get(server.url + "/v1/models", headers=auth).json()
    assert [m["id"] for m in models["data"]] == [model_dir.name]     # a name, never the path
    card = oai.models.retrieve(model_dir.name)
    assert (card.id, card.object, card.model_extra["max_model_len"]) == (model_dir.name, "model", 256)
    with pytest.raises(openai.NotFoundError) as refused:
        oai.models.retrieve("gpt-4o")
    assert refused.value.code == "model_not_found" and repr(model_dir.name) in refused.value.message
    props = httpx.get(server.url + "/props", headers=auth).json()
    assert props["architecture"] == "Qwen3ForCausalLM" and props["dtype"] == "float32"
    assert (props["max_model_len"], props["kv_pool_tokens"], props["block_size"]) == (256, 4096, 16)
    assert props["num_blocks"] == 4096 // 16 and props["max_concurrency"] == 4
    assert props["config"]["max_concurrency"] == 4 and "api_key" not in json.dumps(props)
    text = "Schöne Grüße 敏捷的 fox"
    ids = httpx.post(server.url + "/tokenize", json={"prompt": text}, headers=auth).json()["tokens"]
    assert ids == Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text).ids
    back = httpx.post(server.url + "/detokenize", json={"tokens": ids}, headers=auth).json()
    assert back["prompt"] == text


def test_request_table_cancel_and_metrics(server, auth):
    body = {"prompt": "The quick", "max_tokens": 240, "temperature": 0, "stream": True,
            "ignore_eos": True, "user": "alice"}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=auth,
                      timeout=60) as r:
        lines = r.iter_lines()
        first = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
        table = httpx.get(server.url + "/v1/requests", headers=auth).json()
        row = next(row for row in table["data"] if row["id"] == first["id"])
        assert row["client"] == "alice" and row["state"] in ("prefill", "decode", "paused")
        assert row["blocks"] >= 1 and table["stats"]["blocks_used"] >= row["blocks"]
        cancelled = httpx.delete(server.url + f"/v1/requests/{first['id']}", headers=auth)
        assert cancelled.json() == {"id": first["id"], "object": "request.cancelled"}
        rest = [json.loads(line[6:]) for line in lines
                if line.startswith("data: {")]
    # an operator's cancel is an error the SDKs know, not a finish_reason OpenAI never sends
    assert rest[-1]["error"]["code"] == "cancelled" and "cancelled on the server" in rest[-1]["error"]["message"]
    gone = httpx.delete(server.url + f"/v1/requests/{first['id']}", headers=auth)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "request_not_found"
    text = httpx.get(server.url + "/metrics", headers=auth).text
    assert metric(text, 'pagedserve:request_finished_total{finished_reason="cancelled"}') >= 1
    assert metric(text, "pagedserve:kv_cache_usage_perc") == 0
    assert metric(text, "pagedserve:generation_tokens_total") > 0
    assert metric(text, "pagedserve:engine_steps_total") >= metric(text, "pagedserve:generation_tokens_total") / 4
    assert metric(text, "pagedserve:time_to_first_token_seconds_count") >= 1
    assert metric(text, "pagedserve:inter_token_latency_seconds_count") >= 1


def test_a_repeated_prompt_hits_the_prefix_cache_in_metrics_props_and_the_table(server, auth):
    prompt = torch.randint(3, 400, (40,), generator=torch.Generator().manual_seed(7)).tolist()
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    names = ("prefix_cache_queries_total", "prefix_cache_hits_total", "prefix_cache_evictions_total",
             "state_checkpoint_hits_total")

    def scrape() -> dict[str, float]:
        text = httpx.get(server.url + "/metrics", headers=auth).text
        return {name: metric(text, "pagedserve:" + name)
                for name in names + ("prefix_cache_hit_rate", "cached_blocks")}

    first = httpx.post(server.url + "/v1/completions", json=body, headers=auth, timeout=60).json()
    before = scrape()
    again = httpx.post(server.url + "/v1/completions", json=body, headers=auth, timeout=60).json()
    after = scrape()
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    # all 40 tokens are looked up; the 2 full blocks before the last token come from the cache
    assert after["prefix_cache_queries_total"] - before["prefix_cache_queries_total"] == 40
    assert after["prefix_cache_hits_total"] - before["prefix_cache_hits_total"] == 32
    assert after["state_checkpoint_hits_total"] == 0                    # a dense model has no state
    assert after["prefix_cache_hit_rate"] == pytest.approx(
        after["prefix_cache_hits_total"] / after["prefix_cache_queries_total"])
    assert after["cached_blocks"] >= 2
    props = httpx.get(server.url + "/props", headers=auth).json()["prefix_cache"]
    assert props == {"enabled": True, "hit_rate": pytest.approx(after["prefix_cache_hit_rate"]),
                     "cached_blocks": after["cached_blocks"],
                     "evictions": after["prefix_cache_evictions_total"],
                     "checkpoints": 0, "checkpoint_hits": 0}
    stats = httpx.get(server.url + "/v1/requests", headers=auth).json()["stats"]
    assert (stats["prefix_cache_query_tokens"], stats["prefix_cache_hit_tokens"], stats["cached_blocks"],
            stats["checkpoints"]) == (after["prefix_cache_queries_total"],
                                      after["prefix_cache_hits_total"], after["cached_blocks"], 0)


def test_keep_alive_comments_while_queued(server, auth):
    long = {"prompt": "fox", "max_tokens": 250, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with contextlib.ExitStack() as busy, httpx.Client(headers=auth, timeout=60) as client:
        readers = []                        # kept: a closed line iterator hangs up
        for _ in range(4):                  # every row busy
            r = busy.enter_context(client.stream("POST", server.url + "/v1/completions", json=long))
            readers.append(r.iter_lines())
            next(line for line in readers[-1] if line.startswith("data: "))
        for _ in range(8):                  # and a queue ahead: the next request waits well over 1 s
            busy.enter_context(client.stream("POST", server.url + "/v1/completions", json=long))
        with httpx.stream("POST", server.url + "/v1/completions", headers=auth, timeout=60,
                          json=long | {"max_tokens": 2}) as queued:
            lines = queued.iter_lines()
            first = next(line for line in lines if line)
            busy.close()                    # hang up: frees the rows
            rest = [line for line in lines if line]
    assert first == ": keep-alive" and rest[-1] == "data: [DONE]"


@pytest.mark.parametrize("mode", [schemathesis.GenerationMode.POSITIVE,
                                  schemathesis.GenerationMode.NEGATIVE])
def test_generated_requests_never_get_a_5xx(server, auth, mode):
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json", headers=auth)
    for operation in (result.ok() for result in schema.get_all_operations()):
        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=8, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        def never_5xx(case):
            if isinstance(case.body, dict):     # keep generations short; the rest as drawn
                case.body["max_tokens"] = 2
                case.body.pop("max_completion_tokens", None)
            response = case.call(headers=auth, timeout=60)
            assert response.status_code < 500, (operation.label, case.body, response.text)
        try:
            never_5xx()
        except Unsatisfiable:
            assert mode is schemathesis.GenerationMode.NEGATIVE    # no inputs, so none invalid
    assert httpx.get(server.url + "/health").status_code == 200
