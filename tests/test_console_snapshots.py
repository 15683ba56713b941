"""SVG snapshots of fixed-size console layouts (no animation, no clock, fixed stats).

Update the baselines after an intended change with `pytest tests/test_console_snapshots.py --snapshot-update`
and look at the SVGs before committing them."""
from __future__ import annotations

import pytest

from console.app import ConsoleApp
from console.sessions import ReplyStats, Session, SessionStore, Turn
from test_console_support import FakeClient, until

SIZE = (100, 30)
REPLY = "Here is the loop:\n\n```python\nfor i in range(3):\n    print(i)\n```\n\nIt prints **0, 1, 2**."


@pytest.fixture(autouse=True)
def _no_animation(monkeypatch):
    monkeypatch.setenv("TEXTUAL_ANIMATIONS", "none")


async def settle(pilot) -> None:
    """A blinking cursor would make the picture depend on when it is taken."""
    for widget in pilot.app.screen.query("Input, TextArea"):
        widget.cursor_blink = False
    await pilot.pause()


def app_with_history(tmp_path, client) -> ConsoleApp:
    store = SessionStore(tmp_path)
    store.save(Session("s1", "Loops", "Answer with code.", 0.2, 128, [
        Turn("user", "Show me a loop in Python."),
        Turn("assistant", REPLY, ReplyStats(21, 14.2, 0.125, "stop"))]))
    return ConsoleApp(client, store, what="fake-model")


def test_chat_layout(snap_compare, tmp_path):
    app = app_with_history(tmp_path, FakeClient())

    async def ready(pilot):
        await until(pilot, lambda: app.ready)
        await settle(pilot)

    assert snap_compare(app, terminal_size=SIZE, run_before=ready)


def test_monitor_layout(snap_compare, tmp_path):
    client = FakeClient(hold_after=2)
    app = app_with_history(tmp_path, client)

    async def two_requests_on_the_monitor(pilot):
        await until(pilot, lambda: app.ready)
        await pilot.press("ctrl+r", "ctrl+n")
        prompt = app.panes[app.active_id()].query_one("PromptInput")
        prompt.insert("hello")
        await pilot.press("enter")
        await until(pilot, lambda: len(client.live) == 2 and all(r.sent == 2 for r in client.live.values()))
        await pilot.press("f2")
        await until(pilot, lambda: app.monitor.query_one("DataTable").row_count == 2)
        # No more polls, so the picture does not depend on timing: `_poll` starts none while the flag is
        # set, and once it is clear no poll is in flight; the last poll's snapshot is drawn before ours.
        await until(pilot, lambda: not app._polling.is_set())
        app._polling.set()
        await pilot.pause()
        app.monitor.rates.extend([float(i % 12) for i in range(60)])
        app.monitor.show(client.snapshot())
        await settle(pilot)

    assert snap_compare(app, terminal_size=SIZE, run_before=two_requests_on_the_monitor)
    for rid in list(client.live):
        client.release(rid)


def test_session_settings_dialog(snap_compare, tmp_path):
    app = app_with_history(tmp_path, FakeClient())

    async def open_settings(pilot):
        await until(pilot, lambda: app.ready)
        await pilot.press("f4")
        await settle(pilot)

    assert snap_compare(app, terminal_size=SIZE, run_before=open_settings)
