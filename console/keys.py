"""The console's key bindings: one table of binding id -> default key, action and footer text.

Every binding has an id so `[console.keys]` in config.toml can remap it (Textual keymaps, applied
with `App.set_keymap`). Unknown ids and empty keys are config errors with a did-you-mean.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass

from textual.binding import Binding

from engine.config import ConfigError


@dataclass(frozen=True)
class KeySpec:
    id: str
    key: str          # Textual key names; a comma separates alternatives
    action: str
    description: str
    show: bool = True


# where each binding lives: the app (works on every screen), the prompt box, the monitor screen
APP_KEYS = (
    KeySpec("new_session", "ctrl+n", "new_session", "New"),
    KeySpec("close_session", "ctrl+w", "close_session", "Close"),
    # ctrl+page keys too: many terminals (and tmux) never send ctrl+tab
    KeySpec("next_session", "ctrl+tab,ctrl+pagedown", "switch_session(1)", "Next", show=False),
    KeySpec("previous_session", "ctrl+shift+tab,ctrl+pageup", "switch_session(-1)", "Previous", show=False),
    KeySpec("stop", "escape", "stop_reply", "Stop"),
    KeySpec("regenerate", "ctrl+r", "regenerate", "Regenerate"),
    KeySpec("monitor", "f2,ctrl+o", "toggle_monitor", "Monitor"),
    KeySpec("rename_session", "f3", "session_settings('title')", "Rename"),
    KeySpec("session_settings", "f4", "session_settings('system_prompt')", "Settings"),
    KeySpec("copy_reply", "f6", "copy_reply", "Copy"),
    KeySpec("export_session", "f7", "export_session", "Export"),
    KeySpec("quit", "ctrl+q", "quit", "Quit"),
)
PROMPT_KEYS = (
    KeySpec("send", "enter", "send", "Send"),
    KeySpec("newline", "shift+enter,ctrl+j", "newline", "Newline", show=False),
)
MONITOR_KEYS = (
    KeySpec("cancel_request", "c", "cancel_request", "Cancel request"),
)
ALL_KEYS = APP_KEYS + PROMPT_KEYS + MONITOR_KEYS
BINDING_IDS = tuple(spec.id for spec in ALL_KEYS)


def bindings(specs: tuple[KeySpec, ...], priority: bool = False) -> list[Binding]:
    """Textual bindings for `specs`; priority ones win over keys a focused widget would consume
    (the prompt's TextArea takes ctrl+w, for one)."""
    return [Binding(s.key, s.action, s.description, show=s.show, id=s.id, priority=priority)
            for s in specs]


def keymap(overrides: dict[str, str]) -> dict[str, str]:
    """The `[console.keys]` table checked against the binding ids, as a Textual keymap."""
    problems = []
    for binding_id, key in overrides.items():
        if binding_id not in BINDING_IDS:
            close = difflib.get_close_matches(binding_id, BINDING_IDS, n=1)
            hint = f"did you mean '{close[0]}'?" if close else "the ids are: " + ", ".join(BINDING_IDS)
            problems.append(f"console.keys.{binding_id}: unknown binding id; {hint}")
        elif not isinstance(key, str) or not key.strip():
            problems.append(f'console.keys.{binding_id} = {key!r}: must be a key string such as "ctrl+q"')
    if problems:
        raise ConfigError(problems)
    return {binding_id: key.replace(" ", "") for binding_id, key in overrides.items()}
