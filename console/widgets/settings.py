"""A modal to rename a session and set its system prompt, temperature and max tokens."""
from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Grid
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label

from console.sessions import Session

FIELDS = (("title", "Title"), ("system_prompt", "System prompt"), ("temperature", "Temperature"),
          ("max_tokens", "Max tokens"))


class SessionSettings(ModalScreen[dict | None]):
    """Dismisses with the new values (checked) or None; Enter in a field saves, Escape cancels."""

    BINDINGS = [("escape", "cancel", "Cancel")]
    DEFAULT_CSS = """
    SessionSettings { align: center middle; }
    SessionSettings Grid { grid-size: 2; grid-columns: 16 50; grid-rows: auto; height: auto;
                           width: 70; padding: 1 2; border: thick $accent; background: $surface; }
    SessionSettings #error { column-span: 2; color: $error; }
    """

    def __init__(self, session: Session, focus: str):
        super().__init__()
        self.session = session
        self.focus_field = focus

    def compose(self) -> ComposeResult:
        with Grid():
            for name, label in FIELDS:
                yield Label(label)
                yield Input(str(getattr(self.session, name)), id=name)
            yield Label("", id="error")
            yield Button("Save", variant="primary", id="save")

    def on_mount(self) -> None:
        self.query_one(f"#{self.focus_field}", Input).focus()

    def values(self) -> dict:
        """The fields as typed values; ValueError names the field and what is allowed."""
        raw = {name: self.query_one(f"#{name}", Input).value for name, _ in FIELDS}
        try:
            temperature = float(raw["temperature"])
            assert temperature >= 0
        except (ValueError, AssertionError):
            raise ValueError("temperature must be a number >= 0 (0 = greedy)") from None
        try:
            max_tokens = int(raw["max_tokens"])
            assert max_tokens >= 1
        except (ValueError, AssertionError):
            raise ValueError("max tokens must be an integer >= 1") from None
        return {"title": raw["title"].strip() or self.session.title,
                "system_prompt": raw["system_prompt"], "temperature": temperature, "max_tokens": max_tokens}

    def _save(self) -> None:
        try:
            self.dismiss(self.values())
        except ValueError as e:
            self.query_one("#error", Label).update(str(e))

    def on_input_submitted(self) -> None:
        self._save()

    def on_button_pressed(self) -> None:
        self._save()

    def action_cancel(self) -> None:
        self.dismiss(None)
