"""Chat sessions: what a session holds, saving/restoring them as JSON, exporting one to Markdown.

Sessions live in the user's data dir (platformdirs), one JSON file per session, so closing a tab
deletes one file and a crash mid-write loses at most that session's latest change (every write
replaces the whole file in one rename, engine/atomic_file.py).
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import platformdirs

from engine.atomic_file import write_atomic


@dataclass
class ReplyStats:
    tokens: int = 0
    tokens_per_s: float = 0.0
    ttft_s: float | None = None
    finish_reason: str = ""
    cached: int = 0                   # prompt tokens the prefix cache held (earlier turns, mostly)

    def line(self) -> str:
        ttft = "-" if self.ttft_s is None else f"{self.ttft_s * 1000:.0f} ms"
        cached = f" · {self.cached:,} prompt tokens cached" if self.cached else ""
        return (f"{self.tokens} tokens · {self.tokens_per_s:.1f} tok/s · first token {ttft}{cached}"
                f" · {self.finish_reason}")


@dataclass
class Turn:
    role: str                         # "user" or "assistant"
    content: str
    stats: ReplyStats | None = None   # assistant turns, once the reply finished


@dataclass
class Session:
    id: str
    title: str
    system_prompt: str = ""
    temperature: float = 0.7
    max_tokens: int = 512
    turns: list[Turn] = field(default_factory=list)

    def messages(self) -> list[dict[str, str]]:
        """The chat request for the next reply: system prompt, then every turn."""
        head = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return head + [{"role": t.role, "content": t.content} for t in self.turns]

    def last_reply(self) -> Turn | None:
        return self.turns[-1] if self.turns and self.turns[-1].role == "assistant" else None

    def to_markdown(self) -> str:
        lines = [f"# {self.title}", ""]
        if self.system_prompt:
            lines += [f"*System:* {self.system_prompt}", ""]
        for turn in self.turns:
            lines += [f"## {'You' if turn.role == 'user' else 'Assistant'}", "", turn.content, ""]
            if turn.stats is not None:
                lines += [f"*{turn.stats.line()}*", ""]
        return "\n".join(lines)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Session:
        turns = [Turn(t["role"], t["content"], ReplyStats(**t["stats"]) if t.get("stats") else None)
                 for t in data.get("turns", [])]
        return cls(id=data["id"], title=data["title"], system_prompt=data.get("system_prompt", ""),
                   temperature=float(data.get("temperature", 0.7)),
                   max_tokens=int(data.get("max_tokens", 512)), turns=turns)


def default_data_dir() -> Path:
    return Path(platformdirs.user_data_dir("pagedserve"))


class SessionStore:
    """`<data dir>/sessions/<id>.json` per session; exports go to `<data dir>/exports/`."""

    def __init__(self, data_dir: Path | None = None):
        root = data_dir or default_data_dir()
        self.sessions_dir = root / "sessions"
        self.exports_dir = root / "exports"
        self.errors: list[str] = []

    def load_all(self) -> list[Session]:
        """Saved sessions, oldest first; an unreadable file is skipped (and reported in `errors`)."""
        self.errors = []
        sessions = []
        paths = sorted(self.sessions_dir.glob("*.json"), key=lambda p: p.stat().st_mtime)
        for path in paths:
            try:
                sessions.append(Session.from_json(json.loads(path.read_text(encoding="utf-8"))))
            except (OSError, ValueError, KeyError, TypeError) as e:
                self.errors.append(f"{path}: not a saved session ({e}); move it away to silence this")
        return sessions

    def save(self, session: Session) -> None:
        self.sessions_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(self.sessions_dir / f"{session.id}.json", json.dumps(session.to_json(), indent=1))

    def delete(self, session_id: str) -> None:
        (self.sessions_dir / f"{session_id}.json").unlink(missing_ok=True)

    def export_markdown(self, session: Session) -> Path:
        self.exports_dir.mkdir(parents=True, exist_ok=True)
        stem = re.sub(r"[^\w.-]+", "-", session.title).strip("-") or session.id
        path = self.exports_dir / f"{stem}.md"
        write_atomic(path, session.to_markdown())
        return path
