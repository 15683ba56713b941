"""The tool-call parsers by name (`--tool-call-parser`), and the one a chat template needs.
The streaming machinery they share is server/tool_call_parser.py."""
from __future__ import annotations

from server.hermes_parser import HermesParser
from server.qwen3_coder_parser import Qwen3CoderParser
from server.tool_call_parser import CALL_START, FUNCTION, ToolCallParser


PARSERS: dict[str, type[ToolCallParser]] = {"hermes": HermesParser, "qwen3_coder": Qwen3CoderParser}


def parser_for_template(chat_template: str | None) -> str | None:
    """The parser name a chat template's tool-call format needs: "qwen3_coder" if the template
    contains "<function=", else "hermes" if it contains "<tool_call>", else None."""
    if not chat_template:
        return None
    if FUNCTION in chat_template:
        return "qwen3_coder"
    return "hermes" if CALL_START in chat_template else None
