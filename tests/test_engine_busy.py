"""A step that outlasts a caller's wait for statistics (read between two steps): EngineLoop.stats
raises EngineBusy with the reason, the HTTP routes answer it 503 `engine_busy` instead of a 500, and
the loop goes on."""
from __future__ import annotations

import threading

import httpx
import pytest
from fastapi import FastAPI

from engine.errors import EngineBusy
from engine.loop import EngineLoop
from engine.scheduler import Scheduler
from fake_engine import prompt
from server.errors import install_error_handlers
from test_loop_admission import SteppedEngine, Spelling, params


def test_statistics_during_a_long_step_raise_engine_busy_and_come_after_it():
    held, release = threading.Event(), threading.Event()

    def hold(plan) -> None:
        held.set()
        release.wait(30)
    engine = SteppedEngine(max_rows=4, num_blocks=64, mixed_prefill_tokens_total=4, on_step=hold)
    loop = EngineLoop(Scheduler(engine, prefix_cache=False), Spelling(), eos_token_ids=())
    loop.start()
    try:
        handle = loop.submit(list(prompt(8)), params(2), bounded=False)
        assert held.wait(30)
        with pytest.raises(EngineBusy, match="step that has run for over 0.1 s"):
            loop.stats(timeout_s=0.1)
        engine.on_step = None
        release.set()
        assert len(handle.result().token_ids) == 2
        assert loop.stats(timeout_s=30).running == 0
    finally:
        release.set()
        loop.stop()


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.mark.anyio
async def test_the_server_answers_engine_busy_503():
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/props")
    async def props():
        raise EngineBusy("the engine is in a step that has run for over 10 s")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        response = await client.get("/props")
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "engine_busy"
    assert "over 10 s" in response.json()["error"]["message"]
