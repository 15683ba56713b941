"""The prompt box: Enter sends, Shift+Enter (or Ctrl+J, for terminals that cannot tell Shift+Enter
apart) inserts a newline.

Keys reach this widget through its own message queue, in the order they were typed, but a priority
binding's action runs on the app's task the moment its key arrives, before the keys typed just ahead
of it (a fast typist, a paste, `tmux send-keys "text" Enter`) have reached the box. So the actions
only queue their work behind those keys (`call_later`) and never read or edit the text themselves.
"""
from __future__ import annotations

from textual.message import Message
from textual.widgets import TextArea

from console.keys import PROMPT_KEYS, bindings


class PromptInput(TextArea):
    # priority: TextArea would otherwise take Enter as a newline before any binding runs
    BINDINGS = bindings(PROMPT_KEYS, priority=True)

    class Submitted(Message):
        """The box's text, which the box no longer holds: whoever handles this owns it (or hands it
        back with `restore`)."""

        def __init__(self, prompt: PromptInput, text: str):
            super().__init__()
            self.prompt = prompt
            self.text = text

    def __init__(self, **kwargs):
        super().__init__(soft_wrap=True, show_line_numbers=False, compact=True, **kwargs)
        self.placeholder = "Message (Enter sends, Shift+Enter new line)"

    def action_send(self) -> None:
        self.call_later(self._send)          # after the keys still queued for this box

    def action_newline(self) -> None:
        self.call_later(self.insert, "\n")   # in its place among the keys typed around it

    def restore(self, text: str) -> None:
        """Put `text` back at the start of the box, ahead of anything typed since it left."""
        self.call_later(self._restore, text)

    def _send(self) -> None:
        text = self.text.strip()
        if text:
            self.clear()
            self.post_message(self.Submitted(self, text))

    def _restore(self, text: str) -> None:
        if self.text.strip():
            self.insert(text + "\n", (0, 0))   # the cursor stays in what is being typed
        else:
            self.clear()
            self.insert(text)                  # the cursor at its end
