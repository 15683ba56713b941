"""POST /infill as llama.cpp's server has it (what llama.vscode and other editor plugins call): the
request with llama.cpp's field names, its answer and stream format; the prompt comes from
server/fim.py and runs through the engine like any completion, prefix cache included."""
from __future__ import annotations

import asyncio
import uuid
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field, model_validator

from engine.output import Delta
from engine.request import FinishReason
from server.chat import compile_grammar
from server.engine_host import EngineHost, client_label, host_of
from server.errors import APIError
from server.fim import (CURRENT_FILE, REPO_NAME, FileChunk, FimTokens, fim_prompt, find_fim_tokens,
                               with_fim_stops)
from server.generation import answer
from server.schemas import Finite, SamplingBody, unsupported
from server.sse import sse_event
from server.wire_format import WireFormat

router = APIRouter()


def require_fim(host: EngineHost, param: str) -> FimTokens:
    """The served model's FIM tokens, or a 400 naming `param` when it has none."""
    fim = find_fim_tokens(host.require_client().tokenizer)
    if fim is None:
        raise APIError(400, f"{param} needs a model with fill-in-the-middle tokens (such as <|fim_prefix|>, "
                            f"<|fim_suffix|>, <|fim_middle|>); model {host.names[0]} has none. Serve a coder "
                            f"model trained for FIM (e.g. qwen2.5-coder-1.5b), or send the text before the "
                            f"cursor as a plain prompt to /v1/completions",
                       param=param, code="unsupported_value")
    return fim


class InfillChunk(BaseModel):
    filename: str = "tmp"       # llama.cpp's default
    text: str = ""


class InfillRequest(SamplingBody):
    """llama.cpp's /infill body; its sampling names map onto the OpenAI ones (max_tokens also works)."""
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[InfillChunk] = []
    prompt: str = ""            # the cursor's line so far: it goes after input_prefix
    filename: str = CURRENT_FILE    # pagedserve's additions: the names in the repo-level layout
    repo_name: str = REPO_NAME
    n_predict: int | None = Field(None, ge=-1)
    repeat_penalty: Finite | None = None
    seed: int | None = Field(None, ge=-1, le=2**63 - 1)
    json_schema: dict | bool | None = None
    grammar: str | None = None      # GBNF (or Lark)

    @model_validator(mode="after")
    def _llama_cpp_names(self) -> InfillRequest:
        # llama.cpp: seed -1 = random, temperature <= 0 = greedy
        if self.seed == -1:
            self.seed = None
        if self.temperature is not None and self.temperature < 0:
            self.temperature = 0.0
        if self.repetition_penalty is None:
            self.repetition_penalty = self.repeat_penalty
        return self

    def _constraints(self) -> list[tuple[str, Any, str]]:
        return super()._constraints() + [("json_schema", self.json_schema, "json_schema"),
                                         ("grammar", self.grammar or None, "lark")]

    def check_fields(self) -> None:
        super().check_fields()
        if self.choices != 1:
            raise unsupported("n", "/infill answers one completion; send n to /v1/completions with a suffix")

    def _limit(self) -> int | None:
        if self.n_predict is None:
            return self.max_tokens
        # -1: until the model stops; 0 (llama.vscode's cache warm-up) still has to sample one token
        return None if self.n_predict == -1 else max(1, self.n_predict)


_STOP_TYPES = {FinishReason.STOP: "eos", FinishReason.LENGTH: "limit", FinishReason.TIMEOUT: "limit"}


class InfillFormat(WireFormat):
    """llama.cpp's /completion answer: `content`, `stop` (done or not), the token counts; a stream
    sends one `data:` event per delta and a last one with `stop: true` and the stats, no [DONE]."""

    def __init__(self, request_id: str, model: str, tokenizer):
        super().__init__(request_id, model, tokenizer)
        self._failed = False

    def events(self, index: int, delta: Delta) -> list[bytes]:
        if not delta.text and not delta.token_ids:
            return []
        return [sse_event({"index": index, "content": delta.text, "tokens": delta.token_ids, "stop": False,
                           "tokens_predicted": delta.completion_tokens,
                           "tokens_evaluated": delta.prompt_tokens})]

    def closing(self, last: list[Delta], include_usage: bool) -> list[bytes]:
        return [] if self._failed else [sse_event(self._final(last[0], ""))]

    def error_event(self, error) -> bytes:
        self._failed = True
        return sse_event(error.body())

    def whole(self, totals: list[Delta]) -> dict:
        return self._final(totals[0], totals[0].text)

    def _final(self, delta: Delta, content: str) -> dict:
        stop_type = "word" if delta.stop_sequence else _STOP_TYPES.get(delta.finish_reason, "none")
        return {"index": 0, "content": content, "stop": True, "model": self.model,
                "tokens_predicted": delta.completion_tokens, "tokens_evaluated": delta.prompt_tokens,
                "tokens_cached": delta.cached_tokens, "stop_type": stop_type,
                "stopping_word": delta.stop_sequence or ""}


@router.post("/infill")
async def infill(body: InfillRequest, request: Request):
    host = host_of(request)
    client = host.accept(body)
    fim = require_fim(host, "input_suffix")
    extra = [FileChunk(c.filename, c.text) for c in body.input_extra]
    ids = await asyncio.to_thread(fim_prompt, client.tokenizer, fim, body.input_prefix + body.prompt,
                                  body.input_suffix, extra=extra, filename=body.filename,
                                  repo_name=body.repo_name, budget=host.info.max_model_len - (body._limit() or 1))
    requested = body.output_grammar()
    if requested:
        await compile_grammar(host, *requested)
    params = with_fim_stops(host.choices(body, len(ids), requested[0] if requested else None), fim)
    rid = f"infill-{uuid.uuid4().hex}"
    handles = host.submit(rid, ids, params, client=client_label(request, body.user), param="input_prefix")
    return await answer(request, host, InfillFormat(rid, body.model or host.names[0], client.tokenizer),
                        rid, handles, stream=body.stream)
