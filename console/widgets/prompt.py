"""The prompt box: Enter sends, Shift+Enter (or Ctrl+J, for terminals that cannot tell Shift+Enter
apart) inserts a newline."""
from __future__ import annotations

from textual.message import Message
from textual.widgets import TextArea

from console.keys import PROMPT_KEYS, bindings


class PromptInput(TextArea):
    # priority: TextArea would otherwise take Enter as a newline before any binding runs
    BINDINGS = bindings(PROMPT_KEYS, priority=True)

    class Submitted(Message):
        def __init__(self, prompt: PromptInput, text: str):
            super().__init__()
            self.prompt = prompt
            self.text = text

    def __init__(self, **kwargs):
        super().__init__(soft_wrap=True, show_line_numbers=False, compact=True, **kwargs)
        self.placeholder = "Message (Enter sends, Shift+Enter new line)"

    def action_send(self) -> None:
        text = self.text.strip()
        if text:
            self.post_message(self.Submitted(self, text))
            self.clear()

    def action_newline(self) -> None:
        self.insert("\n")
