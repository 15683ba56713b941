"""Streaming text equals the full decode, cut at stop strings, whatever the token boundaries."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.detokenize import IncrementalDetokenizer
from engine.loading.tokenizer import byte_alphabet, load_tokenizer
from tiny_models import build_tokenizer, special_token_id

MODEL_VOCAB = 512  # the tiny models' vocab: ids 500..511 have no token, as in real padded vocabs
TEXT = "Hello World! Grüße, 你好世界 🙂 def f(x): return x  # über"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer(build_tokenizer(tmp_path_factory.mktemp("tokenizer")))


@pytest.fixture(scope="module")
def byte_ids(tok):
    """byte value -> the id of the token made of exactly that byte."""
    ids = {b: tok.token_to_id(c) for b, c in byte_alphabet().items()}
    assert None not in ids.values()
    return ids


def expected_text(full: str, stop: tuple[str, ...]) -> str:
    cuts = [full.find(s) for s in stop if s and s in full]
    return full[:min(cuts)] if cuts else full


def stream(tok, ids: list[int], sizes: list[int], stop=(), skip=True):
    """Push `ids` in chunks of `sizes` (cycled); check the prefix and lag properties after each push."""
    det = IncrementalDetokenizer(tok, stop=stop, skip_special_tokens=skip)
    final = expected_text(tok.decode(ids, skip_special_tokens=skip), stop)
    longest_stop = max((len(s) for s in stop), default=1)
    emitted, pos, i = "", 0, 0
    while pos < len(ids):
        n = sizes[i % len(sizes)]
        emitted += det.push(ids[pos:pos + n])
        pos, i = pos + n, i + 1
        assert final.startswith(emitted)          # never a partial stop string, never a wrong U+FFFD
        assert det.text == emitted
        if not det.stopped:                       # held back: one unfinished char + a stop-string prefix
            so_far = tok.decode(ids[:pos], skip_special_tokens=skip)
            assert len(so_far) - len(emitted) <= longest_stop
    emitted += det.finish()
    assert emitted == final and det.text == final
    return det


# ids that build awkward byte streams: lone lead bytes, continuations, 0xFF, split multibyte chars
AWKWARD_BYTES = [0xE4, 0xBD, 0xA0, 0xF0, 0x9F, 0x99, 0x82, 0xFF, 0x80, 0xC3, 0xBC, 0xED, 0xA0, 0x41, 0x20]


@st.composite
def token_streams(draw, tok, byte_ids):
    pieces = st.one_of(
        st.integers(0, MODEL_VOCAB - 1).map(lambda i: [i]),
        st.sampled_from(AWKWARD_BYTES).map(lambda b: [byte_ids[b]]),
        st.text(alphabet="aZ 你好🙂ü!\n", min_size=1, max_size=4).map(
            lambda s: [byte_ids[b] for b in s.encode()]),        # multibyte chars split into bytes
        st.sampled_from(["Hello World", "你好世界", "über", " return x"]).map(tok.encode),
    )
    ids = [i for piece in draw(st.lists(pieces, max_size=25)) for i in piece]
    sizes = draw(st.lists(st.integers(1, 4), min_size=1, max_size=5))
    return ids, sizes


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_deltas_concatenate_to_the_full_decode(tok, byte_ids, data):
    ids, sizes = data.draw(token_streams(tok, byte_ids))
    skip = data.draw(st.booleans())
    stream(tok, ids, sizes, skip=skip)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_stop_strings_cut_exactly(tok, byte_ids, data):
    ids, sizes = data.draw(token_streams(tok, byte_ids))
    full = tok.decode(ids)
    # stops taken from the text itself span token boundaries; random ones mostly do not occur
    from_text = st.integers(0, max(len(full) - 1, 0)).flatmap(
        lambda a: st.integers(a + 1, a + 4).map(lambda b: full[a:b]))
    stop = tuple(data.draw(st.lists(st.one_of(from_text, st.text("lo W你\ufffd", min_size=1, max_size=3)),
                                    max_size=3)))
    det = stream(tok, ids, sizes, stop=stop)
    assert det.stopped == any(s and s in full for s in stop)


def test_multibyte_char_is_held_until_complete(tok, byte_ids):
    det = IncrementalDetokenizer(tok)
    assert [det.push([byte_ids[b]]) for b in "你".encode()] == ["", "", "你"]


def test_invalid_byte_is_released_by_the_next_token(tok, byte_ids):
    det = IncrementalDetokenizer(tok)
    assert det.push([byte_ids[0xE4]]) == ""          # could still start a character
    assert det.push([byte_ids[0x41]]) == "\ufffdA"   # 'A' proves it never will
    assert det.push([byte_ids[0xFF], byte_ids[0xFF]]) == "\ufffd"  # only the last one is undecided
    assert det.finish() == "\ufffd"


def test_stop_string_across_tokens_is_never_emitted(tok):
    ids = tok.encode("Hello World! again")
    det = IncrementalDetokenizer(tok, stop=("o W",))
    deltas = [det.push([i]) for i in ids]
    assert "".join(deltas) + det.finish() == "Hell"
    assert det.stopped and det.push(tok.encode("more")) == ""


def test_held_stop_prefix_is_released_when_it_diverges(tok):
    det = IncrementalDetokenizer(tok, stop=("World!?",))
    text = "".join(det.push([i]) for i in tok.encode("Hello World! x"))
    assert text + det.finish() == "Hello World! x" and not det.stopped


def test_special_tokens_skipped_or_kept(tok):
    ids = tok.encode("hi") + [special_token_id("<|im_end|>")]
    kept = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert "".join(kept.push([i]) for i in ids) + kept.finish() == "hi<|im_end|>"
    skipped = IncrementalDetokenizer(tok)
    assert "".join(skipped.push([i]) for i in ids) + skipped.finish() == "hi"


class CountingTokenizer:
    def __init__(self, tok):
        self.tok, self.longest = tok, 0

    def decode(self, ids, skip_special_tokens=True):
        self.longest = max(self.longest, len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_each_push_decodes_a_short_window(tok):
    counting = CountingTokenizer(tok)
    det = IncrementalDetokenizer(counting)
    ids = tok.encode(TEXT * 20)
    assert len(ids) > 400
    text = "".join(det.push([i]) for i in ids)
    assert text + det.finish() == TEXT * 20
    assert counting.longest <= 8  # a few tokens of context + the unfinished character, not the whole text


def test_longer_stop_starting_earlier_wins(tok):
    # "W" is seen first, but "o Wo" starts earlier in the text: the cut is before "o Wo"
    det = IncrementalDetokenizer(tok, stop=("W", "o Wo"))
    text = "".join(det.push([i]) for i in tok.encode("Hello World"))
    assert text + det.finish() == "Hell"
    det = IncrementalDetokenizer(tok, stop=("W", "o Wx"))
    text = "".join(det.push([i]) for i in tok.encode("Hello World"))
    assert text + det.finish() == "Hello "
