"""The console driven through Textual's Pilot against a scripted client (tests/test_console_support)."""
from __future__ import annotations

import dataclasses
import threading

import pytest
from textual import events
from textual.keys import _character_to_key
from textual.widgets import DataTable, Label, Markdown, Static, TabbedContent

from console.app import ConsoleApp
from console.sessions import SessionStore
from console.widgets.prompt import PromptInput
from console.widgets.turn import QueuedView, TurnView
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


FIB = "Write a Python function that returns the n-th Fibonacci number, iteratively."


def burst(app, *keys: str | events.Paste) -> None:
    """Keys (names, or characters of text) as a terminal delivers a fast typist's or tmux's input:
    all at once, none handled before the next arrives (Pilot.press waits for idle after each)."""
    for key in keys:
        if isinstance(key, events.Paste):
            app.post_message(key)
        elif len(key) == 1:
            app.post_message(events.Key(key if key.isalnum() else _character_to_key(key), key))
        else:
            app.post_message(events.Key(key, "\r" if key == "enter" else None))


def prompt_of(app, index: int) -> PromptInput:
    return list(app.panes.values())[index].prompt


def queued_view(app, index: int) -> tuple[str, str] | None:
    """(note, text) of the index-th session's queued message as shown, or None."""
    views = list(app.panes.values())[index].query(QueuedView)
    if not views:
        return None
    return (str(views.first().query_one(".role", Label).render()),
            str(views.first().query_one(".queued", Static).render()))


def drawn(app, index: int) -> bool:
    """The index-th session's last reply has ended and is drawn to its stats line (the last thing
    drawn): leaving `run_test` while `_drain` still draws would tear the widgets down under it."""
    turn = reply(app, index)
    pane = list(app.panes.values())[index]
    stats = pane.query(TurnView).last().query_one(".stats", Label)
    return turn.stats is not None and str(stats.render()) == turn.stats.line()


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
        assert [[str(c) for c in table.get_row_at(i)[:3]] for i in range(2)] == [
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


async def test_a_message_sent_before_the_model_is_ready_waits_for_it(tmp_path):
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
        await until(pilot, lambda: queued_view(app, 0) is not None)
        assert client.requests == [] and not app.sessions[app.active_id()].turns
        assert queued_view(app, 0) == ("You · queued, sent when fake-model is ready · esc takes it back",
                                       "too early")
        assert prompt_of(app, 0).text == ""
        client.gate.set()
        await until(pilot, lambda: app.ready)
        assert not app.loading.display and app.sub_title == "fake"
        await until(pilot, lambda: len(client.requests) == 1)
        assert client.requests[0]["messages"] == [{"role": "user", "content": "too early"}]
        assert queued_view(app, 0) is None
        await until(pilot, lambda: drawn(app, 0))


async def test_keys_typed_in_a_burst_are_sent_whole_and_in_order(tmp_path):
    client = FakeClient()
    app = make_app(tmp_path, client)
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: app.ready)
        sent = lambda: [r["messages"][-1]["content"] for r in client.requests]   # noqa: E731
        await pilot.press(*list(FIB), "enter")
        await until(pilot, lambda: len(client.requests) == 1 and reply(app, 0).stats is not None)
        burst(app, *FIB, "enter")                            # what `tmux send-keys "..." Enter` delivers
        await until(pilot, lambda: len(client.requests) == 2 and reply(app, 0).stats is not None)
        burst(app, events.Paste(FIB), "enter")
        await until(pilot, lambda: len(client.requests) == 3 and reply(app, 0).stats is not None)
        burst(app, "a", "ctrl+j", "b", "shift+enter", "c", "enter", *"rest")   # newlines in place too
        await until(pilot, lambda: len(client.requests) == 4 and prompt_of(app, 0).text == "rest")
        assert sent() == [FIB, FIB, FIB, "a\nb\nc"]
        await until(pilot, lambda: reply(app, 0).stats is not None)
        prompt_of(app, 0).clear()
        burst(app, *"for the first tab", "enter", "ctrl+n")  # the new tab opens before the text lands
        await until(pilot, lambda: len(client.requests) == 5)
        assert sent()[-1] == "for the first tab" and client.requests[-1]["client"] == "Session 1"
        assert len(app.sessions) == 2 and not list(app.sessions.values())[1].turns
        await pilot.press("ctrl+shift+tab")
        await until(pilot, lambda: drawn(app, 0))


async def test_a_message_sent_while_the_session_replies_is_queued_and_sent_when_it_ends(tmp_path):
    client = FakeClient(hold_after=2)
    app = make_app(tmp_path, client)
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: app.ready)
        await send(pilot, "first")
        await until(pilot, lambda: "req-0" in client.live and client.live["req-0"].sent == 2)
        await pilot.press(*"second", "enter")
        await until(pilot, lambda: queued_view(app, 0) is not None)
        assert queued_view(app, 0) == ("You · queued, sent when the reply ends · esc takes it back", "second")
        assert prompt_of(app, 0).text == "" and len(client.requests) == 1 and app.queued
        burst(app, *"third", "enter")                        # joins the queued message
        await until(pilot, lambda: queued_view(app, 0)[1] == "second\n\nthird")
        assert [t.content for t in app.sessions[app.active_id()].turns] == ["first", "w0.0 w0.1 "]
        await pilot.press("ctrl+n")                          # the first session is hidden when it ends
        client.release("req-0")
        await until(pilot, lambda: len(client.requests) == 2)
        assert client.requests[1]["messages"] == [
            {"role": "user", "content": "first"}, {"role": "assistant", "content": FakeClient.reply(0)},
            {"role": "user", "content": "second\n\nthird"}]
        assert not app.queued and queued_view(app, 0) is None
        client.release("req-1")
        await until(pilot, lambda: reply(app, 0).stats is not None)
        await pilot.press("ctrl+tab")
        await until(pilot, lambda: drawn(app, 0))
        views = list(app.panes.values())[0].query(TurnView)
        assert [v.query_one(Markdown).source for v in views] == [
            "first", FakeClient.reply(0), "second\n\nthird", FakeClient.reply(1)]


async def test_esc_takes_a_queued_message_back_into_the_box_before_it_stops_the_reply(tmp_path):
    client = FakeClient(hold_after=1)
    app = make_app(tmp_path, client)
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: app.ready)
        await send(pilot, "first")
        await until(pilot, lambda: "req-0" in client.live)
        await pilot.press(*"second", "enter")
        await until(pilot, lambda: queued_view(app, 0) is not None)
        await pilot.press(*"draft")
        await pilot.press("escape")                          # back into the box, ahead of the draft
        await until(pilot, lambda: prompt_of(app, 0).text == "second\ndraft")
        assert queued_view(app, 0) is None and not app.queued
        assert client.cancelled == [] and "req-0" in client.live
        prompt_of(app, 0).clear()
        burst(app, *"later", "enter", "escape")              # Esc in order: it takes back what Enter queued
        await until(pilot, lambda: prompt_of(app, 0).text == "later")
        assert not app.queued and client.cancelled == []
        await pilot.press("escape")                          # nothing queued: Esc stops the reply
        await until(pilot, lambda: reply(app, 0).stats is not None)
        assert client.cancelled == ["req-0"] and reply(app, 0).stats.finish_reason == "cancelled"
        await pilot.pause(0.1)
        assert len(client.requests) == 1 and prompt_of(app, 0).text == "later"
        await pilot.press("enter")
        await until(pilot, lambda: len(client.requests) == 2)
        assert client.requests[1]["messages"][-1] == {"role": "user", "content": "later"}


async def test_the_monitor_shows_client_names_as_text_not_markup(tmp_path):
    """HTTP clients name themselves (the `user` field): markup in a name must neither crash the
    table nor turn into styles or links."""
    from console.client import EngineSnapshot
    from engine.stats import RequestRow
    names = ["[/]", "[link=https://example.com]click[/link]", "[bold]loud[/bold]"]
    rows = tuple(RequestRow(f"req-{i}", "decode", 5, 1, 1, None, 1.0, name, 2.0) for i, name in enumerate(names))
    client = FakeClient()
    client.snapshot = lambda: EngineSnapshot(running=3, blocks_used=3, blocks_total=64, requests=rows)
    app = make_app(tmp_path, client)
    async with app.run_test(size=(120, 30)) as pilot:
        await until(pilot, lambda: app.ready)
        await pilot.press("f2")
        table = app.monitor.query_one(DataTable)
        await until(pilot, lambda: table.row_count == 3)
        shown = [table.get_row_at(i)[1] for i in range(3)]
        assert [cell.plain for cell in shown] == names and not any(cell.spans for cell in shown)


async def test_a_snapshot_that_arrives_before_the_monitor_is_mounted_is_drawn_on_mount(tmp_path):
    """The app shows the monitor's snapshots once it has pushed the screen, which may be before the
    screen's widgets exist: that snapshot is drawn when they do, and the app keeps running."""
    from console.client import EngineSnapshot
    from textual.widgets import Label
    client = FakeClient()
    app = make_app(tmp_path, client)
    async with app.run_test(size=(120, 30)) as pilot:
        await until(pilot, lambda: app.ready)
        app._polling.set()              # no polls: this test hands the monitor its snapshot itself
        app.monitor.show(EngineSnapshot(running=7, waiting=2, blocks_used=3, blocks_total=64))
        await pilot.press("f2")
        await pilot.pause()
        assert app.screen is app.monitor
        assert "running 7 · waiting 2" in str(app.monitor.query_one("#counts", Label).render())


@pytest.mark.parametrize("attempt", range(4))
async def test_a_snapshot_that_lands_while_the_app_shuts_down_is_dropped(tmp_path, attempt):
    """The monitor's poll runs in a thread: a snapshot landing while the app prunes its screens is
    dropped (drawing it raised NoMatches or ScreenStackError). Each attempt hits the race about half the time."""
    import time
    from console.client import EngineSnapshot
    client = FakeClient()
    app = make_app(tmp_path, client)

    def snapshot_after_shutdown_began() -> EngineSnapshot:
        while app.is_running:
            time.sleep(0.001)
        return EngineSnapshot(running=1)
    client.snapshot = snapshot_after_shutdown_began
    async with app.run_test(size=(120, 30)) as pilot:
        await until(pilot, lambda: app.ready)
        await pilot.press("f2")
        await pilot.pause(0.1)
