"""Fill-in-the-middle: the prompt layout of Qwen2.5-Coder (file- and repo-level) against hand-written
token sequences and Qwen's documented text, then real `pagedserve serve` processes on tiny random
models that have (or lack) Qwen's FIM tokens: POST /infill in llama.cpp's shape, streamed and whole,
`suffix` on /v1/completions through the `openai` SDK, the 400s, and the prefix cache."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import openai
import pytest

from server_process import ServerProcess

from engine.loading.tokenizer import load_tokenizer
from server.fim import FileChunk, fim_prompt, find_fim_tokens

FIM = ("<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")
TINY = dict(tied=False, heads=8, kv_heads=2, head_dim=32, max_pos=2048)
BLOCK = 16                                  # the server's default K/V block size
PREFIX = "def mean(xs):\n    total = 0\n    for x in xs:\n"
LINE = "        total += "                  # /infill's `prompt`: the cursor's line so far
SUFFIX = "\n    return total / len(xs)\n"
LIBRARY = "class Book:\n    def __init__(self, title):\n        self.title = title\n"
STUDENT = "class Student:\n    def borrow(self, book):\n        return book.title\n"
EXTRA = [{"filename": "library.py", "text": LIBRARY}, {"filename": "student.py", "text": STUDENT}]
# Qwen2.5-Coder's README, "Repository Level Code Infilling", with these files
REPO_TEXT = ("<|repo_name|>library-system\n<|file_sep|>library.py\n" + LIBRARY + "\n<|file_sep|>student.py\n"
             + STUDENT + "\n<|file_sep|>main.py\n<|fim_prefix|>" + PREFIX + LINE + "<|fim_suffix|>" + SUFFIX
             + "<|fim_middle|>")


def fim_checkpoint(source: Path, destination: Path) -> Path:
    """A copy of the tiny checkpoint `source` with Qwen2.5-Coder's FIM tokens as special tokens."""
    from tokenizers import AddedToken, Tokenizer

    shutil.copytree(source, destination)
    tokenizer = Tokenizer.from_file(str(destination / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in FIM])
    tokenizer.save(str(destination / "tokenizer.json"))
    return destination


@pytest.fixture(scope="module")
def fim_dir(tiny_checkpoint, tmp_path_factory):
    return fim_checkpoint(tiny_checkpoint("qwen3", **TINY), tmp_path_factory.mktemp("models") / "tiny-coder")


@pytest.fixture(scope="module")
def tok(fim_dir):
    return load_tokenizer(fim_dir)


@pytest.fixture(scope="module")
def coder(fim_dir):
    with ServerProcess(fim_dir, "--served-model-name", "tiny-coder", max_model_len=1024,
                       kv_pool_tokens=16384) as srv:
        yield srv


@pytest.fixture(scope="module")
def plain(tiny_checkpoint):
    with ServerProcess(tiny_checkpoint("qwen3", **TINY), "--served-model-name", "tiny-plain") as srv:
        yield srv


def metric(text: str, name: str) -> float:
    """A sample's value from Prometheus text."""
    return next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " "))


def ids(tok, name: str) -> int:
    return tok.token_to_id(name)


def no_stops(tok) -> dict[str, float]:
    """logit_bias that keeps a random model from ending early: every FIM token and the EOS ids."""
    banned = find_fim_tokens(tok).stop_ids + (ids(tok, "<|im_end|>"), ids(tok, "<|endoftext|>"))
    return {str(t): -100 for t in banned}


def infill_body(tok, **extra) -> dict:
    return {"input_extra": EXTRA, "input_prefix": PREFIX, "prompt": LINE, "input_suffix": SUFFIX,
            "filename": "main.py", "repo_name": "library-system", "n_predict": 12, "temperature": 0,
            "logit_bias": no_stops(tok)} | extra


def sse(response: httpx.Response) -> list[dict]:
    lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines), lines
    return [json.loads(line.removeprefix("data: ")) for line in lines]


# -- the prompt


def test_qwen_fim_tokens_are_found_and_written_as_text_they_encode_as_the_special_ids(tok):
    fim = find_fim_tokens(tok)
    assert (fim.family, fim.prefix, fim.suffix, fim.middle, fim.repo, fim.file_sep) == (
        "qwen", ids(tok, "<|fim_prefix|>"), ids(tok, "<|fim_suffix|>"), ids(tok, "<|fim_middle|>"),
        ids(tok, "<|repo_name|>"), ids(tok, "<|file_sep|>"))
    assert set(fim.stop_ids) == {ids(tok, t) for t in FIM} | {ids(tok, "<|endoftext|>")}
    for name in FIM:
        assert tok.encode(name) == [ids(tok, name)] and ids(tok, name) in tok.special_token_ids


def test_file_level_prompt_is_qwens_layout(tok):
    p, s, m = ids(tok, "<|fim_prefix|>"), ids(tok, "<|fim_suffix|>"), ids(tok, "<|fim_middle|>")
    built = fim_prompt(tok, find_fim_tokens(tok), PREFIX, SUFFIX)
    assert built == [p, *tok.encode(PREFIX), s, *tok.encode(SUFFIX), m]
    assert built == tok.encode("<|fim_prefix|>" + PREFIX + "<|fim_suffix|>" + SUFFIX + "<|fim_middle|>")


def test_repo_level_prompt_is_qwens_layout_and_drops_the_oldest_file_to_fit(tok):
    fim = find_fim_tokens(tok)
    repo, sep = ids(tok, "<|repo_name|>"), ids(tok, "<|file_sep|>")
    head = [repo, *tok.encode("library-system\n")]
    library = [sep, *tok.encode("library.py\n" + LIBRARY + "\n")]
    student = [sep, *tok.encode("student.py\n" + STUDENT + "\n")]
    tail = [sep, *tok.encode("main.py\n"), *fim_prompt(tok, fim, PREFIX + LINE, SUFFIX)]
    extra = [FileChunk(**c) for c in EXTRA]
    built = fim_prompt(tok, fim, PREFIX + LINE, SUFFIX, extra=extra, filename="main.py",
                       repo_name="library-system")
    assert built == head + library + student + tail == tok.encode(REPO_TEXT)
    fitted = fim_prompt(tok, fim, PREFIX + LINE, SUFFIX, extra=extra, filename="main.py",
                        repo_name="library-system", budget=len(built) - 1)
    assert fitted == head + student + tail


class _Vocab:
    def __init__(self, *names: str):
        self.ids = {name: i for i, name in enumerate(names)}

    def token_to_id(self, name: str) -> int | None:
        return self.ids.get(name)


@pytest.mark.parametrize("names, family, repo_level", [
    (("<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<repo_name>", "<file_sep>"), "starcoder", True),
    (("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"), "deepseek", False),
    (("▁<PRE>", "▁<SUF>", "▁<MID>", "▁<EOT>"), "codellama", False),
])
def test_other_families_are_found_by_their_token_strings(names, family, repo_level):
    fim = find_fim_tokens(_Vocab(*names))
    assert (fim.family, fim.prefix, fim.suffix, fim.middle, fim.file_sep is not None) == (family, 0, 1, 2, repo_level)
    assert set(fim.stop_ids) == set(range(len(names)))
    assert find_fim_tokens(_Vocab("<|im_start|>", "<|fim_prefix|>", "<|fim_suffix|>")) is None


# -- the server


def test_infill_streamed_equals_whole_in_llama_cpp_shape(coder, tok):
    whole = httpx.post(coder.url + "/infill", json=infill_body(tok), timeout=60).json()
    assert whole["content"] and whole["stop"] is True and whole["model"] == "tiny-coder"
    assert (whole["tokens_predicted"], whole["stop_type"], whole["stopping_word"]) == (12, "limit", "")
    assert whole["tokens_evaluated"] == len(tok.encode(REPO_TEXT))
    with httpx.stream("POST", coder.url + "/infill", json=infill_body(tok, stream=True), timeout=60) as r:
        events = sse(r)
    *chunks, last = events
    assert all(c["stop"] is False and c["tokens"] for c in chunks) and last["stop"] is True
    assert "".join(c["content"] for c in chunks) == whole["content"]
    assert sum(len(c["tokens"]) for c in chunks) == 12
    assert {k: last[k] for k in ("tokens_predicted", "tokens_evaluated", "stop_type")} == {
        k: whole[k] for k in ("tokens_predicted", "tokens_evaluated", "stop_type")}


def test_greedy_infill_equals_completions_on_the_prompt_written_out(coder, tok):
    client = openai.OpenAI(base_url=coder.url + "/v1", api_key="none", max_retries=0, timeout=60)
    greedy = {"model": "tiny-coder", "max_tokens": 12, "temperature": 0, "logit_bias": no_stops(tok)}
    infill = httpx.post(coder.url + "/infill", json=infill_body(tok), timeout=60).json()
    by_hand = client.completions.create(prompt=REPO_TEXT, **greedy)
    assert by_hand.choices[0].text == infill["content"]
    assert by_hand.usage.prompt_tokens == infill["tokens_evaluated"]
    file_level = "<|fim_prefix|>" + PREFIX + "<|fim_suffix|>" + SUFFIX + "<|fim_middle|>"
    with_suffix = client.completions.create(prompt=PREFIX, suffix=SUFFIX, **greedy)
    assert with_suffix.choices[0].text == client.completions.create(prompt=file_level, **greedy).choices[0].text
    assert with_suffix.usage.prompt_tokens == len(tok.encode(file_level))


def test_a_fim_token_ends_the_middle_on_both_routes(coder, tok):
    written = {str(ids(tok, "<|file_sep|>")): 100}      # the model "writes" a file separator first
    answer = httpx.post(coder.url + "/infill", json=infill_body(tok, logit_bias=written), timeout=60).json()
    assert (answer["content"], answer["tokens_predicted"], answer["stop_type"]) == ("", 1, "eos")
    r = httpx.post(coder.url + "/v1/completions", timeout=60, json={
        "prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 8, "logit_bias": written})
    assert r.json()["choices"][0]["finish_reason"] == "stop" and r.json()["usage"]["completion_tokens"] == 1


def test_llama_cpp_sampling_names_and_stop_words(coder, tok):
    body = infill_body(tok, n_predict=5, max_tokens=50, seed=-1, repeat_penalty=1.0, top_k=1, top_p=1.0,
                       min_p=0.0, cache_prompt=True, input_extra=[])
    first = httpx.post(coder.url + "/infill", json=body, timeout=60).json()
    assert (first["tokens_predicted"], first["stop_type"]) == (5, "limit")
    word = next(ch for ch in first["content"][1:] if ch.isprintable() and ch != "\ufffd")
    stopped = httpx.post(coder.url + "/infill", json=body | {"stop": [word]}, timeout=60).json()
    assert (stopped["stop_type"], stopped["stopping_word"]) == ("word", word)
    assert stopped["content"] == first["content"][:first["content"].index(word)]
    constrained = httpx.post(coder.url + "/infill", json=body | {"grammar": 'root ::= "yes" | "no"'},
                             timeout=60).json()
    assert constrained["content"] in ("yes", "no") and constrained["stop_type"] == "eos"


def test_token_ids_with_suffix_are_refused(coder):
    r = httpx.post(coder.url + "/v1/completions", json={"prompt": [1, 2, 3], "suffix": "x"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"
    assert "string" in r.json()["error"]["message"]


def test_a_repeated_infill_hits_the_prefix_cache_and_an_edit_after_the_cursor_keeps_it(coder, tok):
    files = [{"filename": f"mod{i}.py", "text": LIBRARY.replace("Book", f"Book{i}")} for i in range(6)]
    body = infill_body(tok, input_extra=files, n_predict=2)
    edited = body | {"input_suffix": SUFFIX.replace("total", "sum_")}

    def hits() -> float:
        return metric(httpx.get(coder.url + "/metrics").text, "pagedserve:prefix_cache_hits_total")

    def prompt(b: dict) -> list[int]:
        return fim_prompt(tok, find_fim_tokens(tok), b["input_prefix"] + b["prompt"], b["input_suffix"],
                          extra=[FileChunk(**c) for c in files], filename="main.py", repo_name="library-system")

    first = httpx.post(coder.url + "/infill", json=body, timeout=60).json()
    n = first["tokens_evaluated"]
    assert n == len(prompt(body)) > 8 * BLOCK
    before = hits()
    again = httpx.post(coder.url + "/infill", json=body, timeout=60).json()
    assert again["content"] == first["content"]
    assert hits() - before == (n - 1) // BLOCK * BLOCK == again["tokens_cached"]   # all blocks but the last token's
    shared = next(i for i, (a, b) in enumerate(zip(prompt(body), prompt(edited))) if a != b)
    assert shared >= n - len(tok.encode(SUFFIX)) - 1        # the edit is in the suffix
    before = hits()
    after_edit = httpx.post(coder.url + "/infill", json=edited, timeout=60).json()
    assert hits() - before == shared // BLOCK * BLOCK == after_edit["tokens_cached"]


def test_a_model_without_fim_tokens_gets_a_400_on_both_routes_and_keeps_serving(plain):
    r = httpx.post(plain.url + "/infill", json={"input_prefix": "def f(", "input_suffix": ")"}, timeout=60)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "input_suffix"
    assert "tiny-plain" in error["message"] and "fill-in-the-middle" in error["message"]
    client = openai.OpenAI(base_url=plain.url + "/v1", api_key="none", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="tiny-plain", prompt="def f(", suffix=")", max_tokens=2)
    assert refused.value.body["param"] == "suffix" and "tiny-plain" in refused.value.body["message"]
    assert client.completions.create(model="tiny-plain", prompt="def f(", max_tokens=2).choices[0].text is not None
    assert httpx.get(plain.url + "/health").status_code == 200
