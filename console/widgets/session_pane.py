"""A session's tab: the transcript (one TurnView per turn, then the queued message if there is one)
above the prompt box."""
from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import TabPane

from console.sessions import Session, Turn
from console.widgets.prompt import PromptInput
from console.widgets.turn import QueuedView, TurnView


class SessionPane(TabPane):
    DEFAULT_CSS = """
    SessionPane { layout: vertical; padding: 0; }
    SessionPane VerticalScroll { height: 1fr; }
    SessionPane PromptInput { height: auto; max-height: 8; min-height: 3; border: tall $accent; }
    """

    def __init__(self, session: Session):
        super().__init__(session.title, id=pane_id(session.id))
        self.session_id = session.id
        self._initial = list(session.turns)

    def compose(self) -> ComposeResult:
        with VerticalScroll(classes="transcript"):
            yield from (TurnView(t) for t in self._initial)
        yield PromptInput()

    async def on_mount(self) -> None:
        self.query_one(VerticalScroll).anchor()
        for view, turn in zip(self.query(TurnView), self._initial):
            await view.show(turn)
        self._initial = []

    @property
    def prompt(self) -> PromptInput:
        return self.query_one(PromptInput)

    async def add_turn(self, turn: Turn) -> None:
        view = TurnView(turn)
        queued = self.query(QueuedView)
        await self.query_one(VerticalScroll).mount(view, before=queued.first() if queued else None)
        await view.show(turn)

    async def show_queued(self, text: str | None, note: str = "") -> None:
        """Show `text` as the message waiting to be sent (None: there is none)."""
        queued = self.query(QueuedView)
        if text is None:
            await queued.remove()
            return
        if queued:
            view = queued.first()
        else:
            view = QueuedView()
            await self.query_one(VerticalScroll).mount(view)
        view.show(text, note)

    async def show_last(self, turn: Turn) -> None:
        views = self.query(TurnView)
        if views:
            await views.last().show(turn)

    async def remove_last(self) -> None:
        views = self.query(TurnView)
        if views:
            await views.last().remove()

    def focus_prompt(self) -> None:
        self.query_one(PromptInput).focus()


def pane_id(session_id: str) -> str:
    return f"session-{session_id}"
