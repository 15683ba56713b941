"""Tool calls from real weights through the `openai` SDK: a get_weather-style tool and a few prompts
in auto mode (the model decides), then each prompt with tool_choice "required" and a second turn
that feeds a tool result back. Prints what came back; exit status 1 if a required call failed.

    .venv/bin/python bench/tool_calls.py                       # starts `pagedserve serve` on the default model
    .venv/bin/python bench/tool_calls.py --url http://127.0.0.1:8000 --model qwen2.5-coder-1.5b
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from server_process import ServerProcess  # noqa: E402

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City name, e.g. Paris"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file from the user's project",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
]
PROMPTS = [
    "What's the weather like in Paris right now?",
    "Is it raining in Tokyo? Answer in fahrenheit.",
    "Show me what is in src/main.py",
    "What is the weather in Berlin and in Madrid?",
    "Write a Python function that reverses a string.",
]


def show(label: str, message, finish: str, seconds: float) -> None:
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or ()]
    print(f"  {label}: finish={finish} {seconds:.1f}s")
    for name, arguments in calls:
        print(f"    call {name}({arguments})")
    if message.content:
        print(f"    content: {message.content[:200]!r}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running server (default: start one on --model)")
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        url = args.url
        if url is None:
            server = ServerProcess(args.model, "--max-concurrency", "4", dtype="auto", max_model_len=4096,
                                   kv_pool_tokens=16384, workdir=Path.cwd())
            stack.callback(server.stop)
            server.wait_ready(timeout=900)
            url = server.url
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        failed = 0
        for prompt in PROMPTS:
            print(f"{prompt!r}")
            for choice in ("auto", "required"):
                t0 = time.monotonic()
                out = client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": prompt}], tools=TOOLS,
                    tool_choice=choice, temperature=0, max_tokens=256)
                show(choice, out.choices[0].message, out.choices[0].finish_reason, time.monotonic() - t0)
                if choice == "required":
                    failed += not out.choices[0].message.tool_calls
        first = client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPTS[0]}],
                                               tools=TOOLS, tool_choice="required", temperature=0, max_tokens=128,
                                               parallel_tool_calls=False)
        call = first.choices[0].message.tool_calls[0]
        turn = [{"role": "user", "content": PROMPTS[0]}, first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id,
                 "content": json.dumps({"city": "Paris", "temperature_c": 18, "sky": "light rain"})}]
        t0 = time.monotonic()
        second = client.chat.completions.create(model=model, messages=turn, tools=TOOLS, temperature=0, max_tokens=128)
        print("second turn with the tool result:")
        show("auto", second.choices[0].message, second.choices[0].finish_reason, time.monotonic() - t0)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
