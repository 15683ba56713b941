"""Ollama's API, for the clients, editors and tools written against it: /api/chat and /api/generate
through the same chat core, grammars and fill-in-the-middle prompts as the OpenAI routes (only the wire
format differs), and what they ask about the model (/api/tags, /api/show, /api/ps, /api/version).
This server serves the one model it was started with, so the routes that pull, create, copy or delete
models, and the embedding routes, answer 501 saying what to do instead. Errors take Ollama's shape,
`{"error": message}` (server/errors.py)."""
from __future__ import annotations

import asyncio
import os
import uuid
from datetime import datetime, timezone

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from server.chat import compile_grammar, prepare_chat
from server.engine_host import EngineHost, client_label, host_of
from server.errors import APIError
from server.fim import find_fim_tokens, fim_prompt, with_fim_stops
from server.fim_routes import require_fim
from server.generation import answer
from server.ollama_format import ChatFormat, GenerateFormat, created_at
from server.ollama_schemas import OllamaChatRequest, OllamaGenerateRequest, ShowRequest
from server.tools import renders_tools, tool_request

router = APIRouter()
API_VERSION = "0.12.0"      # the Ollama API this door follows, for clients that check it
_sizes: dict[str, int] = {}


@router.post("/api/chat")
async def chat(body: OllamaChatRequest, request: Request):
    host = host_of(request)
    client = host.accept(body)
    tools = tool_request([t.as_dict() for t in body.tools or ()], None, True)
    chat = await prepare_chat(host, body.chat(), tools, body.output_grammar(), body.template_kwargs())
    rid = f"ollama-{uuid.uuid4().hex}"
    handles = host.submit(rid, chat.prompt_ids, host.choices(body, len(chat.prompt_ids), chat.grammar),
                          client=client_label(request, None), param="messages")
    return await answer(request, host, ChatFormat(rid, body.model, client.tokenizer, chat.output()), rid, handles,
                        stream=body.stream)


@router.post("/api/generate")
async def generate(body: OllamaGenerateRequest, request: Request):
    """`suffix`: the model's fill-in-the-middle prompt; `raw`: the prompt as it is; else the chat
    template's, `system` and `prompt` as its turns. No prompt at all is Ollama's way to load a model:
    it is loaded, and the answer says so."""
    host = host_of(request)
    client = host.accept(body)
    if body.is_load():
        return JSONResponse({"model": body.model, "created_at": created_at(), "response": "", "done": True,
                             "done_reason": "load"})
    requested, output, fim = body.output_grammar(), None, None
    if body.suffix is not None or body.raw:
        if body.suffix is not None:
            fim = require_fim(host, "suffix")
            ids = await asyncio.to_thread(fim_prompt, client.tokenizer, fim, body.prompt, body.suffix)
        else:
            ids = await asyncio.to_thread(client.tokenizer.encode, body.prompt)
        if requested:
            await compile_grammar(host, *requested)
        grammar = requested[0] if requested else None
    else:
        chat = await prepare_chat(host, body.chat(), None, requested, body.template_kwargs())
        ids, grammar, output = chat.prompt_ids, chat.grammar, chat.output()
    params = host.choices(body, len(ids), grammar)
    rid = f"ollama-{uuid.uuid4().hex}"
    handles = host.submit(rid, ids, with_fim_stops(params, fim) if fim else params,
                          client=client_label(request, None), param="prompt")
    return await answer(request, host, GenerateFormat(rid, body.model, client.tokenizer, output), rid, handles,
                        stream=body.stream)


def _size(path: str) -> int:
    """Bytes of the model on disk (a file, or a checkpoint directory's files), once."""
    if path not in _sizes:
        if os.path.isdir(path):
            _sizes[path] = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)
        else:
            _sizes[path] = os.path.getsize(path) if os.path.exists(path) else 0
    return _sizes[path]


def _family(host: EngineHost) -> str:
    """llama.cpp's architecture name, as Ollama reports it: "qwen2" for Qwen2ForCausalLM."""
    return host.info.architecture.removesuffix("ForCausalLM").removesuffix("ForConditionalGeneration").lower()


def _model(host: EngineHost, name: str) -> dict:
    """The served model under `name`, as Ollama lists a model (its default tag when it has none)."""
    info = host.info
    tagged = name if ":" in name else f"{name}:latest"
    modified = os.path.getmtime(info.model_path) if os.path.exists(info.model_path) else 0.0
    family = _family(host)
    return {"name": tagged, "model": tagged,
            "modified_at": datetime.fromtimestamp(modified, timezone.utc).isoformat().replace("+00:00", "Z"),
            "size": _size(info.model_path),
            "details": {"parent_model": "", "family": family, "families": [family]}}


@router.get("/api/tags")
async def tags(request: Request):
    host = host_of(request)
    host.require_client(admitting=False)
    return {"models": [_model(host, name) for name in host.names]}


@router.get("/api/ps")
async def ps(request: Request):
    host = host_of(request)
    host.require_client(admitting=False)
    return {"models": [_model(host, name) | {"size_vram": 0 if host.info.device == "cpu" else _size(host.info.model_path),
                                               "context_length": host.info.max_model_len}
                       for name in host.names]}


@router.post("/api/show")
async def show(body: ShowRequest, request: Request):
    """The model's details and what it can do (`capabilities`: tools when its chat template shows
    them, insert when it has FIM tokens, thinking when its replies are split into reasoning)."""
    host = host_of(request)
    name = body.model or body.name
    if not name:
        raise APIError(400, "model is required", param="model", code="invalid_value")
    host.check_model(name.removesuffix(":latest"))
    client = host.require_client(admitting=False)
    entry, family = _model(host, name), _family(host)
    capabilities = ["completion"] + (["tools"] if renders_tools(client.tokenizer) else []) + (
        ["insert"] if find_fim_tokens(client.tokenizer) else []) + (["thinking"] if host.reasoning_parser else [])
    return {"modelfile": "", "parameters": "", "template": client.tokenizer.chat_template or "",
            "details": entry["details"], "modified_at": entry["modified_at"], "capabilities": capabilities,
            "model_info": {"general.architecture": family, f"{family}.context_length": host.info.max_model_len}}


@router.get("/api/version")
async def version():
    return {"version": API_VERSION}


@router.api_route("/api/{action}", methods=["POST", "DELETE"])
async def not_here(action: str):
    """Ollama's model management and embeddings: 501 with what to do instead; anything else 404."""
    if action in ("pull", "push", "create", "copy", "delete"):
        raise APIError(501, f"/api/{action} is not served: this server serves the one model it was started "
                            "with (`pagedserve serve --model NAME`); `pagedserve pull NAME` downloads a preset",
                       code="not_implemented")
    if action in ("embed", "embeddings"):
        raise APIError(501, f"/api/{action} is not served: this server generates text and has no embedding "
                            "model", code="not_implemented")
    raise APIError(404, f"/api/{action} is not a route of this server (Ollama's: /api/chat, /api/generate, "
                        "/api/tags, /api/show, /api/ps, /api/version)", code="not_found")
