"""The Textual console: chat sessions as tabs, a monitor screen, all through one ConsoleClient.

Threads never touch widgets: replies are read by ReplyBuffers on their own threads, and one timer
(~30 Hz) moves what arrived into the sessions and into the visible session's widgets only. It does so
on the app's own message queue, like every handler that sends, queues or takes back a message, so
none of them runs in the middle of another (each has awaits: mounting, Markdown updates). Engine
calls that may block (connect, HTTP snapshot and cancel) run on daemon threads and answer with
`post_message`, which is thread-safe (`call_from_thread` would block the caller).

A message sent while its session replies (or while the model loads) is queued, shown dimmed under the
transcript, and sent when the reply ends; more messages sent meanwhile join it as new paragraphs. Esc
first takes a queued message back into the prompt box, and only then stops the reply.
"""
from __future__ import annotations

import asyncio
import signal
import threading
import uuid
from collections.abc import Callable

from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.message import Message
from textual.widgets import Footer, Header, TabbedContent

from console.client import ConsoleClient, EngineSnapshot, ReplyBuffer
from console.keys import APP_KEYS, bindings
from console.sessions import ReplyStats, Session, SessionStore, Turn
from console.widgets.loading import LoadingBar
from console.widgets.monitor import MonitorScreen
from console.widgets.prompt import PromptInput
from console.widgets.session_pane import SessionPane, pane_id
from console.widgets.settings import SessionSettings

FRAME_S = 1 / 30       # replies reach widgets at most this often
POLL_S = 0.25          # monitor refresh while it is on screen


class Connected(Message):
    def __init__(self, description: str | None, error: str | None):
        super().__init__()
        self.description, self.error = description, error


class Downloading(Message):
    def __init__(self, done: int, total: int):
        super().__init__()
        self.done, self.total = done, total


class SnapshotArrived(Message):
    def __init__(self, snapshot: EngineSnapshot):
        super().__init__()
        self.snapshot = snapshot


class Notice(Message):
    def __init__(self, text: str, severity: str = "information"):
        super().__init__()
        self.text, self.severity = text, severity


class StopAsked(Message):
    """Esc, posted from the prompt box behind the keys still on their way to it (see `PromptInput`),
    so that "text, Enter, Esc" takes back what Enter queued rather than overtaking it."""

    def __init__(self, prompt: PromptInput):
        super().__init__()
        self.prompt = prompt


class ConsoleApp(App):
    TITLE = "pagedserve"
    BINDINGS = bindings(APP_KEYS, priority=True)
    CSS = "TabbedContent { height: 1fr; } TabbedContent > ContentSwitcher { height: 1fr; }"

    def __init__(self, client: ConsoleClient, store: SessionStore, *, what: str,
                 keymap: dict[str, str] | None = None, temperature: float = 0.7, max_tokens: int = 512):
        super().__init__()
        self.client = client
        self.store = store
        self.what = what
        self.key_overrides = keymap or {}
        self.new_session_params = {"temperature": temperature, "max_tokens": max_tokens}
        self.ready = False
        self.sessions: dict[str, Session] = {}
        self.panes: dict[str, SessionPane] = {}      # widgets by session id: no query_one on late messages
        self.replies: dict[str, ReplyBuffer] = {}    # live replies by session id
        self.queued: dict[str, str] = {}             # by session id: the message sent once it is free
        self._drain_pending = False
        self.monitor = MonitorScreen()
        self._polling = threading.Event()

    def compose(self) -> ComposeResult:
        yield Header()
        # kept as attributes: app.query_one searches the top screen, which may be the monitor
        self.loading = LoadingBar(self.what)
        self.tabs = TabbedContent(id="sessions")
        yield self.loading
        yield self.tabs
        yield Footer()

    async def on_mount(self) -> None:
        self.set_keymap(self.key_overrides)
        for session in self.store.load_all():
            await self._open(session)
        for error in self.store.errors:
            self.notify(error, severity="warning")
        if not self.sessions:
            await self.action_new_session()
        self.set_interval(FRAME_S, self._frame)
        self.set_interval(POLL_S, self._poll)
        self._in_thread(self._connect)
        if signal.getsignal(signal.SIGHUP) is signal.SIG_DFL:   # nohup's SIG_IGN stays
            # a closed terminal quits as ctrl+q does: sessions saved, the engine (and prefix cache) closed
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self.call_next, self.action_quit)

    # -- threads (never touch widgets; answer with post_message)
    def _in_thread(self, fn: Callable[[], None]) -> None:
        threading.Thread(target=fn, daemon=True, name="console-call").start()

    def _connect(self) -> None:
        try:
            description = self.client.connect(progress=lambda d, t: self.post_message(Downloading(d, t)))
        except Exception as e:   # noqa: BLE001 - any load failure is shown, not raised in a thread
            self.post_message(Connected(None, f"{type(e).__name__}: {e}"))
        else:
            self.post_message(Connected(description, None))

    def _snapshot(self) -> None:
        try:
            self.post_message(SnapshotArrived(self.client.snapshot()))
        except Exception as e:   # noqa: BLE001 - a failed poll is a notice; the next poll retries
            self.post_message(Notice(f"monitor: {e}", "warning"))
        finally:
            self._polling.clear()

    def _cancel_request(self, request_id: str) -> None:
        try:
            self.client.cancel(request_id)
        except Exception as e:   # noqa: BLE001
            self.post_message(Notice(f"could not cancel {request_id}: {e}", "error"))
        else:
            self.post_message(Notice(f"cancelled {request_id}"))

    # -- messages from threads and screens
    async def on_connected(self, message: Connected) -> None:
        if message.error is not None:
            self.loading.failed(message.error)
            self.notify(message.error, severity="error", timeout=30)
            return
        self.ready = True
        self.loading.display = False
        self.sub_title = message.description or ""
        for sid in list(self.queued):   # typed while the model loaded
            await self._send_queued(sid)

    def on_downloading(self, message: Downloading) -> None:
        self.loading.downloading(message.done, message.total)

    def on_snapshot_arrived(self, message: SnapshotArrived) -> None:
        # a poll can land while the app shuts down and prunes its screens (then no widget is left to draw)
        if self.is_running and self.screen is self.monitor:
            self.monitor.show(message.snapshot)

    def on_notice(self, message: Notice) -> None:
        self.notify(message.text, severity=message.severity)

    def on_monitor_screen_cancel_request(self, message: MonitorScreen.CancelRequest) -> None:
        self._in_thread(lambda: self._cancel_request(message.request_id))

    async def on_prompt_input_submitted(self, message: PromptInput.Submitted) -> None:
        sid = self._owner(message.prompt)
        if sid is None:                       # its session was closed meanwhile, text and all
            return
        if self._busy(sid) or sid in self.queued:
            before = self.queued.get(sid)
            self.queued[sid] = message.text if before is None else f"{before}\n\n{message.text}"
            await self._show_queued(sid)
        else:
            await self._send(sid, message.text)

    async def on_stop_asked(self, message: StopAsked) -> None:
        await self._stop(self._owner(message.prompt))

    async def on_tabbed_content_tab_activated(self, event: TabbedContent.TabActivated) -> None:
        await self._refresh_visible()

    # -- replies
    def _busy(self, sid: str) -> bool:
        return not self.ready or sid in self.replies

    def _can_start(self, sid: str) -> bool:
        if not self.ready:
            self.notify(f"{self.what} is still loading", severity="warning")
        elif self._busy(sid):
            self.notify("this session is still replying; Esc stops it", severity="warning")
        return not self._busy(sid)

    async def _send(self, sid: str, text: str) -> None:
        turn = Turn("user", text)
        self.sessions[sid].turns.append(turn)
        await self.panes[sid].add_turn(turn)
        await self._start_reply(sid)

    async def _send_queued(self, sid: str) -> None:
        if sid in self.queued and not self._busy(sid):
            text = self.queued.pop(sid)
            await self.panes[sid].show_queued(None)
            await self._send(sid, text)

    async def _show_queued(self, sid: str) -> None:
        if not self.ready:
            when = f"sent when {self.what} is ready"
        else:
            when = "sent when the reply ends"
        stop = self.key_overrides.get("stop", next(s.key for s in APP_KEYS if s.id == "stop"))
        key = self.get_key_display(Binding(stop.split(",")[0], ""))
        await self.panes[sid].show_queued(self.queued[sid], f"queued, {when} · {key} takes it back")

    async def _start_reply(self, sid: str) -> None:
        session = self.sessions[sid]
        messages = session.messages()
        reply = Turn("assistant", "")
        session.turns.append(reply)
        await self.panes[sid].add_turn(reply)
        buffer = ReplyBuffer(lambda: self.client.stream(
            messages, temperature=session.temperature, max_tokens=session.max_tokens, client=session.title))
        self.replies[sid] = buffer
        buffer.start()

    def _frame(self) -> None:
        # on the timer's own task: hand the drain to the app's queue (at most one waiting there)
        if not self._drain_pending:
            self._drain_pending = True
            self.call_later(self._drain)

    async def _drain(self) -> None:
        self._drain_pending = False
        if not self.is_running:   # shutting down: the screens are going (quitting saved the sessions)
            return
        visible = self.visible_id()
        for sid, buffer in list(self.replies.items()):
            text, final = buffer.take()
            reply = self.sessions[sid].turns[-1]
            reply.content += text
            if final is not None:
                del self.replies[sid]
                rate, ttft = buffer.rates()
                reason = final.finish_reason if final.error is None else f"error: {final.error}"
                reply.stats = ReplyStats(max(buffer.tokens, final.completion_tokens), rate, ttft, reason,
                                         final.cached_tokens)
                if final.error is not None:
                    self.notify(final.error, severity="error")
                self.store.save(self.sessions[sid])
            # a hidden session is drawn in full before its queued message buries this reply
            if (sid == visible and text) or (final is not None and (sid == visible or sid in self.queued)):
                await self.panes[sid].show_last(reply)
            if final is not None:
                await self._send_queued(sid)

    async def _refresh_visible(self) -> None:
        sid = self.visible_id()
        if sid is not None and self.sessions[sid].turns:
            await self.panes[sid].show_last(self.sessions[sid].turns[-1])

    def _poll(self) -> None:
        if self.ready and self.is_running and self.screen is self.monitor and not self._polling.is_set():
            self._polling.set()
            self._in_thread(self._snapshot)

    # -- sessions
    def active_id(self) -> str | None:
        active = self.tabs.active
        return next((sid for sid, pane in self.panes.items() if pane.id == active), None)

    def _owner(self, prompt: PromptInput) -> str | None:
        """The session whose box `prompt` is (the active tab may have changed since it posted)."""
        return next((sid for sid, pane in self.panes.items() if pane.prompt is prompt), None)

    def visible_id(self) -> str | None:
        """The session whose widgets are on screen (none while the monitor covers them)."""
        return None if self.monitor in self.screen_stack else self.active_id()

    async def _open(self, session: Session) -> None:
        self.sessions[session.id] = session
        pane = SessionPane(session)
        self.panes[session.id] = pane
        await self.tabs.add_pane(pane)
        self.tabs.active = pane.id
        pane.focus_prompt()

    async def action_new_session(self) -> None:
        number = len(self.sessions) + 1
        titles = {s.title for s in self.sessions.values()}
        while f"Session {number}" in titles:
            number += 1
        session = Session(uuid.uuid4().hex[:12], f"Session {number}", **self.new_session_params)
        await self._open(session)
        self.store.save(session)

    async def action_close_session(self) -> None:
        sid = self.active_id()
        if sid is None:
            return
        buffer = self.replies.pop(sid, None)   # its late output is dropped with it
        self.queued.pop(sid, None)
        if buffer is not None:
            buffer.cancel()
        del self.sessions[sid]
        pane = self.panes.pop(sid)
        await self.tabs.remove_pane(pane.id)
        self.store.delete(sid)
        if not self.sessions:
            await self.action_new_session()
        elif (active := self.active_id()) is not None:
            self.panes[active].focus_prompt()

    def action_switch_session(self, step: int) -> None:
        ids = list(self.panes)
        sid = self.active_id()
        if sid is not None and len(ids) > 1:
            target = ids[(ids.index(sid) + step) % len(ids)]
            self.tabs.active = self.panes[target].id
            self.panes[target].focus_prompt()

    async def action_stop_reply(self) -> None:
        if self.screen is self.monitor:   # Esc leaves the monitor
            await self.action_toggle_monitor()
            return
        if isinstance(self.focused, PromptInput):   # in order with what was typed into it
            self.focused.call_later(self.focused.post_message, StopAsked(self.focused))
        else:
            await self._stop(self.active_id())

    async def _stop(self, sid: str | None) -> None:
        if sid in self.queued:            # first takes the queued message back into the box
            text = self.queued.pop(sid)
            await self.panes[sid].show_queued(None)
            self.panes[sid].prompt.restore(text)
        elif sid in self.replies:
            self.replies[sid].cancel()

    async def action_regenerate(self) -> None:
        sid = self.active_id()
        if sid is None or self.sessions[sid].last_reply() is None or not self._can_start(sid):
            return
        self.sessions[sid].turns.pop()
        await self.panes[sid].remove_last()
        await self._start_reply(sid)

    def action_session_settings(self, focus: str) -> None:
        sid = self.active_id()
        if sid is None:
            return

        def apply(values: dict | None) -> None:
            if values is None or sid not in self.sessions:
                return
            session = self.sessions[sid]
            for name, value in values.items():
                setattr(session, name, value)
            self.tabs.get_tab(pane_id(sid)).label = session.title
            self.store.save(session)

        self.push_screen(SessionSettings(self.sessions[sid], focus), apply)

    def action_copy_reply(self) -> None:
        sid = self.active_id()
        reply = self.sessions[sid].last_reply() if sid else None
        if reply is None or not reply.content:
            self.notify("no reply to copy yet", severity="warning")
            return
        self.copy_to_clipboard(reply.content)
        self.notify("copied the last reply")

    def action_export_session(self) -> None:
        sid = self.active_id()
        if sid is not None:
            self.notify(f"exported to {self.store.export_markdown(self.sessions[sid])}")

    async def action_toggle_monitor(self) -> None:
        if self.screen is self.monitor:
            await self.pop_screen()
            await self._refresh_visible()   # it was not drawn while hidden
        else:
            self.push_screen(self.monitor)
            self._poll()

    async def action_quit(self) -> None:
        for buffer in self.replies.values():
            buffer.cancel()
        for session in self.sessions.values():
            self.store.save(session)
        self.exit()

    def on_unmount(self) -> None:
        self.client.close()   # stops the engine loop (or the HTTP connection pool)
