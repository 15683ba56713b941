"""Fill-in-the-middle prompts for coder models: which FIM tokens a vocabulary has (found by their
strings, per model family) and the prompt in the layout the model was trained on. No HTTP here.

Layout (Qwen2.5-Coder's README, the PSM order of Bavarian et al. 2022; llama.cpp's /infill renders
the same pattern):

    file-level:  <|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>
    repo-level:  <|repo_name|>{repo}\\n <|file_sep|>{path}\\n{text}\\n ... <|file_sep|>{path}\\n + file-level

The other files come first and the cursor area last, so the part an editor re-sends unchanged is
the front of the prompt: the prefix cache serves it, and an edit after the cursor only recomputes
the suffix. Each text between two FIM tokens is encoded on its own, which gives the same ids as
encoding the prompt written out with the tokens' strings (families without repo tokens get the
other files as plain text chunks before the prefix token, as llama.cpp does).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from engine.request import SamplingParams

REPO_NAME = "myproject"     # llama.cpp's placeholders when the client names neither
CURRENT_FILE = "filename"


@dataclass(frozen=True)
class Family:
    """One family's token strings; each role lists its spellings, the first one present wins."""
    name: str
    prefix: tuple[str, ...]
    suffix: tuple[str, ...]
    middle: tuple[str, ...]
    repo: tuple[str, ...] = ()
    file_sep: tuple[str, ...] = ()
    others: tuple[str, ...] = ()    # further tokens that end a middle (pad, end-of-text)


FAMILIES = (
    Family("qwen", ("<|fim_prefix|>",), ("<|fim_suffix|>",), ("<|fim_middle|>",),
           ("<|repo_name|>",), ("<|file_sep|>",), ("<|fim_pad|>", "<|endoftext|>")),
    Family("starcoder", ("<fim_prefix>",), ("<fim_suffix>",), ("<fim_middle>",),
           ("<repo_name>", "<reponame>"), ("<file_sep>",), ("<fim_pad>", "<|endoftext|>")),
    Family("deepseek", ("<｜fim▁begin｜>",), ("<｜fim▁hole｜>",), ("<｜fim▁end｜>",)),
    Family("codellama", ("▁<PRE>", "<PRE>"), ("▁<SUF>", "<SUF>"), ("▁<MID>", "<MID>"),
           others=("▁<EOT>", "<EOT>")),
)


@dataclass(frozen=True)
class FimTokens:
    family: str
    prefix: int
    suffix: int
    middle: int
    repo: int | None            # both None: no repo-level format, other files go in as text
    file_sep: int | None
    stop_ids: tuple[int, ...]   # every FIM token: the middle is over when the model writes one


@dataclass(frozen=True)
class FileChunk:
    filename: str
    text: str


def _first(tokenizer, names: tuple[str, ...]) -> int | None:
    return next((i for i in map(tokenizer.token_to_id, names) if i is not None), None)


def find_fim_tokens(tokenizer) -> FimTokens | None:
    """The FIM tokens of the first family whose prefix, suffix and middle tokens all exist."""
    for family in FAMILIES:
        prefix, suffix, middle = (_first(tokenizer, f) for f in (family.prefix, family.suffix, family.middle))
        if None in (prefix, suffix, middle):
            continue
        repo, file_sep = _first(tokenizer, family.repo), _first(tokenizer, family.file_sep)
        if repo is None or file_sep is None:
            repo = file_sep = None
        others = [tokenizer.token_to_id(name) for name in family.others]
        stops = [t for t in (prefix, suffix, middle, repo, file_sep, *others) if t is not None]
        return FimTokens(family.name, prefix, suffix, middle, repo, file_sep, tuple(dict.fromkeys(stops)))
    return None


def fim_prompt(tokenizer, fim: FimTokens, prefix: str, suffix: str, *, extra: Sequence[FileChunk] = (),
               filename: str = CURRENT_FILE, repo_name: str = REPO_NAME,
               budget: int | None = None) -> list[int]:
    """The prompt's token ids: file-level, or repo-level when `extra` (other files) is given.
    While the prompt is over `budget` tokens the earliest chunks are left out, as they are
    usually the least relevant (editors list the freshest context last)."""
    head, chunks, tail = _parts(tokenizer, fim, prefix, suffix, extra, filename, repo_name)
    size = len(head) + sum(map(len, chunks)) + len(tail)
    while chunks and budget is not None and size > budget:
        size -= len(chunks.pop(0))
    return head + [t for chunk in chunks for t in chunk] + tail


def _parts(tokenizer, fim: FimTokens, prefix: str, suffix: str, extra: Sequence[FileChunk],
           filename: str, repo_name: str) -> tuple[list[int], list[list[int]], list[int]]:
    encode = tokenizer.encode
    cursor = [fim.prefix, *encode(prefix), fim.suffix, *encode(suffix), fim.middle]
    if not extra:
        return [], [], cursor
    if fim.file_sep is None:    # a family without repo tokens: the other files as plain text before
        return [], [encode(f"--- {c.filename} ---\n{c.text}\n") for c in extra], cursor
    head = [fim.repo, *encode(repo_name + "\n")]
    chunks = [[fim.file_sep, *encode(f"{c.filename}\n{c.text}\n")] for c in extra]
    return head, chunks, [fim.file_sep, *encode(filename + "\n"), *cursor]


def with_fim_stops(params: list[SamplingParams], fim: FimTokens) -> list[SamplingParams]:
    """Each choice's params, also ending at the FIM tokens (a model that has written the middle
    goes on with another FIM token or a file separator, as Qwen's examples stop on)."""
    return [dataclasses.replace(p, stop_token_ids=tuple(dict.fromkeys(p.stop_token_ids + fim.stop_ids)))
            for p in params]
