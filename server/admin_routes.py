"""Operator routes: /health, /props, the live request table (list, cancel) and /metrics.

The request table shows every client's requests and cancels any of them, so it is the operator's:
with `server.admin_key` set it takes that key, without one it answers only this machine (loopback).
Statistics are taken by the engine thread between two steps, so they are awaited on a worker thread."""
from __future__ import annotations

import asyncio
import dataclasses

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from server.engine_host import host_of
from server.errors import APIError, given_key, key_matches
from server.metrics import CONTENT_TYPE

router = APIRouter()
LOOPBACK = ("127.0.0.1", "::1", "localhost")


def require_operator(request: Request) -> None:
    """403 unless the caller holds the admin key, or (no admin key set) calls from this machine."""
    key = host_of(request).server_cfg.admin_key
    if key:
        if not key_matches(given_key(dict(request.scope["headers"])), key):
            raise APIError(403, "the request table is the operator's: send the admin key as "
                                "`Authorization: Bearer <admin_key>` (server.admin_key)", code="admin_only")
    elif request.client is None or request.client.host not in LOOPBACK:
        raise APIError(403, "the request table answers only this machine (loopback) while no admin key "
                            "is set; set server.admin_key to open it to other hosts", code="admin_only")


@router.get("/health")
async def health(request: Request):
    host = host_of(request)
    if host.ready:
        return {"status": "ok"}
    status = ("draining" if host.draining else "failed" if host.load_error else "loading")
    return JSONResponse({"status": status, "error": host.load_error}, status_code=503)


@router.get("/props")
async def props(request: Request):
    host = host_of(request)
    client = host.require_client(admitting=False)
    s = await asyncio.to_thread(client.stats)
    prefix_cache = {"enabled": host.engine_cfg.prefix_cache, "hit_rate": s.prefix_cache_hit_rate,
                    "cached_blocks": s.cached_blocks, "evictions": s.cache_evictions_total,
                    "checkpoints": s.checkpoints, "checkpoint_hits": s.checkpoint_hits_total}
    cfg, info = host.engine_cfg, client.info()
    speculative = {"method": info.speculative, "draft_model": cfg.draft_model,
                   "num_speculative_tokens": cfg.num_speculative_tokens,
                   "proposed_tokens": s.spec_proposed_tokens_total, "accepted_tokens": s.spec_accepted_tokens_total,
                   "verify_rows": s.spec_verify_rows_total, "acceptance_rate": s.spec_acceptance_rate,
                   "mean_acceptance_length": s.spec_mean_acceptance_length}
    return (dataclasses.asdict(info) | {"config": dataclasses.asdict(cfg)}
            | {"prefix_cache": prefix_cache, "speculative": speculative})


@router.get("/v1/requests")
async def list_requests(request: Request):
    require_operator(request)
    host = host_of(request)
    s = await asyncio.to_thread(host.require_client(admitting=False).stats)
    rows = [{"id": r.id, "client": r.client, "state": r.state, "prompt_tokens": r.prompt_tokens,
             "generated_tokens": r.generated_tokens, "blocks": r.blocks, "slot": r.slot,
             "tokens_per_s": r.tokens_per_s, "age_s": r.age_s} for r in s.requests]
    stats = {"running": s.running, "waiting": s.waiting, "paused": s.paused,
             "blocks_used": s.blocks_used, "blocks_total": s.blocks_total,
             "slots_used": s.slots_used, "slots_total": s.slots_total,
             "prompt_tokens_per_s": s.prompt_tokens_per_s,
             "generation_tokens_per_s": s.generation_tokens_per_s,
             "ttft_p50_s": s.ttft_p50_s, "itl_p50_s": s.itl_p50_s, "itl_p99_s": s.itl_p99_s,
             "preemptions_total": s.preemptions_total,
             "prefix_cache_query_tokens": s.prefix_cache_query_tokens,
             "prefix_cache_hit_tokens": s.prefix_cache_hit_tokens,
             "prefix_cache_hit_rate": s.prefix_cache_hit_rate, "cached_blocks": s.cached_blocks,
             "cache_evictions_total": s.cache_evictions_total, "checkpoints": s.checkpoints,
             "checkpoint_hits_total": s.checkpoint_hits_total, "steps_total": s.steps_total,
             "spec_proposed_tokens_total": s.spec_proposed_tokens_total,
             "spec_accepted_tokens_total": s.spec_accepted_tokens_total,
             "spec_verify_rows_total": s.spec_verify_rows_total, "spec_acceptance_rate": s.spec_acceptance_rate,
             "spec_mean_acceptance_length": s.spec_mean_acceptance_length}
    return {"object": "list", "data": rows, "stats": stats}


@router.delete("/v1/requests/{request_id}")
async def cancel_request(request_id: str, request: Request):
    require_operator(request)
    host = host_of(request)
    if not await asyncio.to_thread(host.cancel, request_id):
        raise APIError(404, f"no live request {request_id!r} (GET /v1/requests lists them)",
                       param="request_id", code="request_not_found")
    return {"id": request_id, "object": "request.cancelled"}


@router.get("/metrics")
async def metrics(request: Request):
    return Response(await asyncio.to_thread(host_of(request).metrics.render), media_type=CONTENT_TYPE)
