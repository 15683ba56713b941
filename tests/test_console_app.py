"""The console driven through Textual's Pilot against a scripted client (tests/test_console_support)."""
from __future__ import annotations

import dataclasses
import threading

import pytest
from textual.widgets import DataTable, Label, Markdown, TabbedContent

from console.app import ConsoleApp
from console.sessions import SessionStore
from console.widgets.prompt import PromptInput
from console.widgets.turn import TurnView
from test_console_support import FakeClient, until


pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(autouse=True)
def _no_animation(monkeypatch):
    monkeypatch.setenv("TEXTUAL_ANIMATIONS", "none")


def make_app(tmp_path, client, **kwargs) -> ConsoleApp:
    return ConsoleApp(client, SessionStore(tmp_path), what="fake-model", **kwargs)


async def send(pilot, text: str) -> None:
    prompt = pilot.app.panes[pilot.app.active_id()].query_one(PromptInput)
    prompt.focus()
    prompt.insert(text)
    await pilot.press("enter")


def reply(app, index: int):
    """The last turn of the index-th open session."""
    return list(app.sessions.values())[index].turns[-1]


def shown(app, index: int) -> str:
    pane = list(app.panes.values())[index]
    return pane.query(TurnView).last().query_one(Markdown).source


async def test_two_sessions_stream_at_once_and_esc_stops_only_the_current_one(tmp_path):
    client = FakeClient(hold_after=2)
    app = make_app(tmp_path, client)
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: app.ready)
        await send(pilot, "first question")
        await pilot.press("ctrl+n")
        await send(pilot, "second question")
        await until(pilot, lambda: len(client.live) == 2 and all(r.sent == 2 for r in client.live.values()))
        await until(pilot, lambda: reply(app, 1).content == "w1.0 w1.1 ")
        assert len(app.replies) == 2                          # both stream at the same time
        await pilot.press("escape")                           # session 2 is the current one
        await until(pilot, lambda: reply(app, 1).stats is not None)
        assert client.cancelled == ["req-1"]
        assert reply(app, 1).stats.finish_reason == "cancelled"
        assert reply(app, 1).content == "w1.0 w1.1 "
        assert "req-0" in app.replies or "req-0" in client.live   # session 1 is still going
        client.release("req-0")
        await until(pilot, lambda: reply(app, 0).stats is not None)
        assert reply(app, 0).content == FakeClient.reply(0)
        assert reply(app, 0).stats.finish_reason == "stop" and reply(app, 0).stats.tokens == 6
        await pilot.press("ctrl+shift+tab")                   # back to session 1: drawn in full
        await until(pilot, lambda: shown(app, 0) == FakeClient.reply(0))
        assert client.requests[0]["messages"] == [{"role": "user", "content": "first question"}]
        assert client.requests[1]["client"] == "Session 2"


async def test_a_hidden_session_is_not_drawn_until_it_is_shown(tmp_path):
    client = FakeClient(hold_after=3)
    app = make_app(tmp_path, client)
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: app.ready)
        await send(pilot, "hello")
        await until(pilot, lambda: shown(app, 0) == "w0.0 w0.1 w0.2 ")  # visible: drawn while streaming
        await pilot.press("ctrl+n")
        client.release("req-0")
        await until(pilot, lambda: reply(app, 0).stats is not None)
        assert shown(app, 0) == "w0.0 w0.1 w0.2 "             # hidden: the model moved on, widgets did not
        await pilot.press("ctrl+tab")
        await until(pilot, lambda: shown(app, 0) == FakeClient.reply(0))


async def test_the_monitor_lists_every_request_and_c_cancels_the_selected_one(tmp_path):
    client = FakeClient(hold_after=1)
    client.snapshot = lambda: dataclasses.replace(FakeClient.snapshot(client), prefix_cache_hit_rate=0.375,
                                                  cached_blocks=12)
    app = make_app(tmp_path, client)
    async with app.run_test(size=(120, 30)) as pilot:
        await until(pilot, lambda: app.ready)
        await send(pilot, "one")
        await pilot.press("ctrl+n")
        await send(pilot, "two")
        await until(pilot, lambda: len(client.live) == 2)
        await pilot.press("f2")
        table = app.monitor.query_one(DataTable)
        await until(pilot, lambda: table.row_count == 2)
        assert [table.get_row_at(i)[:3] for i in range(2)] == [
            ["req-0", "Session 1", "decode"], ["req-1", "Session 2", "decode"]]
        cache = app.monitor.query_one("#cache", Label)
        assert str(cache.render()) == "prefix cache hit rate 37.5% · cached blocks 12"
        await pilot.press("down", "c")
        await until(pilot, lambda: reply(app, 1).stats is not None)
        assert client.cancelled == ["req-1"] and reply(app, 1).stats.finish_reason == "cancelled"
        await until(pilot, lambda: table.row_count == 1)
        await pilot.press("escape")                           # leaves the monitor, cancels nothing
        assert app.screen is not app.monitor and client.cancelled == ["req-1"]
        client.release("req-0")
        await until(pilot, lambda: reply(app, 0).stats is not None)
        assert reply(app, 0).stats.finish_reason == "stop"


async def test_sessions_are_saved_and_restored_with_settings_export_and_copy(tmp_path):
    client = FakeClient()
    app = make_app(tmp_path, client)
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: app.ready)
        await pilot.press("f4")                               # settings: system prompt focused
        await pilot.press(*"Be brief.")
        settings = app.screen
        settings.query_one("#temperature").value = "0"
        settings.query_one("#max_tokens").value = "32"
        settings.query_one("#title").value = "Notes"
        await pilot.press("enter")
        await send(pilot, "hello")
        await until(pilot, lambda: reply(app, 0).stats is not None)
        assert client.requests[0]["messages"][0] == {"role": "system", "content": "Be brief."}
        assert (client.requests[0]["temperature"], client.requests[0]["max_tokens"]) == (0.0, 32)
        await pilot.press("f6")
        assert app.clipboard == FakeClient.reply(0)
        await pilot.press("f7")
        exported = (tmp_path / "exports" / "Notes.md").read_text()
        assert "## You\n\nhello" in exported and FakeClient.reply(0) in exported
        await pilot.press("ctrl+q")
    assert client.closed

    again = FakeClient()
    app = make_app(tmp_path, again)
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: app.ready)
        (session,) = app.sessions.values()
        assert (session.title, session.system_prompt, session.temperature) == ("Notes", "Be brief.", 0.0)
        assert [t.content for t in session.turns] == ["hello", FakeClient.reply(0)]
        assert session.turns[1].stats.tokens == 6
        assert shown(app, 0) == FakeClient.reply(0)
        await pilot.press("ctrl+r")                           # regenerate: the last reply is replaced
        await until(pilot, lambda: reply(app, 0).stats is not None)
        assert [t.content for t in session.turns] == ["hello", FakeClient.reply(0)]
        assert again.requests[0]["messages"] == [{"role": "system", "content": "Be brief."},
                                                 {"role": "user", "content": "hello"}]
        assert len(app.query(TurnView)) == 2


async def test_closing_a_streaming_session_cancels_it_and_drops_its_output(tmp_path):
    client = FakeClient(hold_after=1)
    app = make_app(tmp_path, client)
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: app.ready)
        await send(pilot, "hello")
        await until(pilot, lambda: "req-0" in client.live and client.live["req-0"].sent == 1)
        first = app.active_id()
        await pilot.press("ctrl+w")
        assert client.cancelled == ["req-0"] and first not in app.sessions and app.replies == {}
        await until(pilot, lambda: not client.live)
        await pilot.pause(0.1)                                # its final delta arrives and is dropped
        assert len(app.sessions) == 1 and not (tmp_path / "sessions" / f"{first}.json").exists()


async def test_remapped_keys_replace_the_defaults(tmp_path):
    client = FakeClient(hold_after=1)
    app = make_app(tmp_path, client, keymap={"new_session": "ctrl+b", "stop": "ctrl+x"})
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: app.ready)
        await pilot.press("ctrl+n")
        assert len(app.sessions) == 1
        await pilot.press("ctrl+b")
        assert len(app.sessions) == 2
        assert app.query_one(TabbedContent).active == app.panes[app.active_id()].id
        await send(pilot, "hi")
        await until(pilot, lambda: "req-0" in client.live)
        await pilot.press("escape")
        await pilot.pause(0.1)
        assert client.cancelled == []
        await pilot.press("ctrl+x")
        await until(pilot, lambda: client.cancelled == ["req-0"])


async def test_sending_before_the_model_is_ready_is_refused(tmp_path):
    class SlowClient(FakeClient):
        def connect(self, progress):
            progress(3 * 2**20, 12 * 2**20)
            self.gate.wait(5)
            return "fake"

    client = SlowClient()
    client.gate = threading.Event()
    app = make_app(tmp_path, client)
    async with app.run_test(size=(100, 30)) as pilot:
        label = app.loading.query_one("Label")
        await until(pilot, lambda: "downloading fake-model: 3.0 / 12.0 MiB" in str(label.render()))
        await send(pilot, "too early")
        assert client.requests == [] and not app.sessions[app.active_id()].turns
        client.gate.set()
        await until(pilot, lambda: app.ready)
        assert not app.loading.display and app.sub_title == "fake"
