"""One turn of a chat as shown: who spoke, the Markdown text, and a reply's stats line.

A streaming reply is appended through `Markdown.get_stream` (which merges fragments when the widget
lags) and ends with one full `update`, so a code block cut mid-stream is never left half-drawn."""
from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Label, Markdown, Static
from textual.widgets.markdown import MarkdownStream

from console.sessions import Turn


class TurnView(Vertical):
    DEFAULT_CSS = """
    TurnView { height: auto; margin: 0 0 1 0; }
    TurnView .role { color: $text-muted; text-style: bold; }
    TurnView.user .role { color: $accent; }
    TurnView Markdown { margin: 0; padding: 0 1; }
    TurnView .stats { color: $text-muted; padding: 0 1; }
    """

    def __init__(self, turn: Turn):
        super().__init__(classes=turn.role)
        self.role = turn.role
        self._shown = 0                      # characters of the text already in the Markdown widget
        self._stream: MarkdownStream | None = None
        self._final = False

    def compose(self) -> ComposeResult:
        yield Label("You" if self.role == "user" else "Assistant", classes="role")
        yield Markdown("")
        yield Label("", classes="stats")

    async def show(self, turn: Turn) -> None:
        """Bring the widget up to `turn`: append new text while it streams, redraw once at the end."""
        if self._final:
            return
        markdown = self.query_one(Markdown)
        if turn.stats is not None or self.role == "user":
            if self._stream is not None:
                await self._stream.stop()
                self._stream = None
            await markdown.update(turn.content)
            self._shown, self._final = len(turn.content), True
            self.query_one(".stats", Label).update(turn.stats.line() if turn.stats else "")
            return
        if len(turn.content) > self._shown:
            if self._stream is None:
                self._stream = Markdown.get_stream(markdown)
            await self._stream.write(turn.content[self._shown:])
            self._shown = len(turn.content)
            self.query_one(".stats", Label).update("…")


class QueuedView(Vertical):
    """A message that waits to be sent (its session is still replying, or the model still loading):
    dimmed, under the transcript, with a note saying when it goes and how to take it back."""

    DEFAULT_CSS = """
    QueuedView { height: auto; margin: 0 0 1 0; }
    QueuedView .role { color: $text-muted; text-style: bold italic; }
    QueuedView .queued { color: $text-muted; padding: 0 1; }
    """

    def compose(self) -> ComposeResult:
        yield Label("", classes="role")
        yield Static("", classes="queued", markup=False)

    def show(self, text: str, note: str) -> None:
        self.query_one(".role", Label).update(f"You · {note}" if note else "You · queued")
        self.query_one(".queued", Static).update(text)
