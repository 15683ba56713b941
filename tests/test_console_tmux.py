"""End to end: `pagedserve chat` with a tiny checkpoint in a real terminal (tmux), keys typed in,
the screen read back with capture-pane."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (apt-get install tmux)")


class Tmux:
    def __init__(self, socket: Path):
        self.socket = socket

    def __call__(self, *args: str) -> str:
        return subprocess.run(["tmux", "-S", str(self.socket), *args], check=True,
                              capture_output=True, text=True, timeout=10).stdout

    def screen(self) -> str:
        return self("capture-pane", "-p", "-t", "chat")

    def wait_for(self, condition, timeout: float, what: str) -> str:
        deadline = time.monotonic() + timeout
        while True:
            text = self.screen()
            if condition(text):
                return text
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; the screen was:\n{text}")
            time.sleep(0.2)


FIB = "Write a Python function that returns the n-th Fibonacci number, iteratively."
PLACEHOLDER = "Message (Enter"     # shown only while the prompt box is empty


def last_reply(screen: str) -> str | None:
    """The screen from the last 'Assistant' label down; None while no label is on screen."""
    lines = screen.splitlines()
    labels = [i for i, line in enumerate(lines) if line.strip() == "Assistant"]
    return "\n".join(lines[labels[-1]:]) if labels else None


def reply_lines(screen: str) -> list[str]:
    """The non-blank lines between the last 'Assistant' label and the prompt box."""
    lines = screen.splitlines()
    start = max(i for i, line in enumerate(lines) if line.strip() == "Assistant")
    end = next(i for i, line in enumerate(lines) if "Message (Enter" in line or i > start and "▔" in line)
    return [line for line in lines[start + 1:end] if line.strip()]


def process_report() -> str:
    """What a console that will not exit is doing: its threads' states and, if py-spy is there, stacks."""
    pids = subprocess.run(["pgrep", "-f", "pagedserve chat"], capture_output=True, text=True).stdout.split()
    report = ""
    for pid in pids:
        report += subprocess.run(["ps", "-L", "-o", "pid,ppid,tid,stat,wchan:32,comm", "-p", pid],
                                 capture_output=True, text=True).stdout
        if shutil.which("py-spy"):
            report += subprocess.run(["py-spy", "dump", "--pid", pid], capture_output=True, text=True).stdout
    return report or "no console process left"


def test_chat_streams_queues_and_esc_takes_back_then_stops(tiny_checkpoint, tmp_path):
    checkpoint = tiny_checkpoint(max_pos=4096)   # greedy output runs for thousands of tokens
    pagedserve = Path(sys.executable).parent / "pagedserve"
    # sessions and config go to tmp_path
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path / "data"),
           "XDG_CONFIG_HOME": str(tmp_path / "config"), "TEXTUAL_ANIMATIONS": "none",
           "TERM": "xterm-256color", "PAGEDSERVE_THREADS": "1",
           "PAGEDSERVE_CPU_KERNELS": "0"}   # the console is under test, not a cold C++ kernel build
    exit_file = tmp_path / "exit_status"
    # tmux 3.3a now and then leaves an exited pane process unreaped (a zombie, pane_dead_status empty),
    # so a shell around the console records its exit status instead
    chat = (f"{shlex.quote(str(pagedserve))} chat --model {shlex.quote(str(checkpoint))} "
            f"--dtype float32 --temperature 0 --max-tokens 4000")
    command = f"sh -c {shlex.quote(f'{chat}; echo $? > {shlex.quote(str(exit_file))}')}"
    tmux = Tmux(tmp_path / "tmux.sock")
    conf = tmp_path / "tmux.conf"   # Esc reaches the app at once, not after 500 ms; a crash stays readable
    conf.write_text("set -s escape-time 0\nset -g remain-on-exit on\n")
    subprocess.run(["tmux", "-S", str(tmux.socket), "-f", str(conf), "new-session", "-d", "-s", "chat",
                    "-x", "110", "-y", "36", "-c", str(tmp_path), command], check=True, env=env, timeout=10)
    try:
        tmux.wait_for(lambda s: PLACEHOLDER in s and "loading" not in s, 120, "the model to load")  # a busy machine: generous
        # text and Enter in one burst, as issue 20 typed it: it once sent "...the n-" and kept "th ..."
        tmux("send-keys", "-t", "chat", FIB, "Enter")
        streaming = tmux.wait_for(lambda s: "Assistant" in s and len(reply_lines(s)) >= 3, 60,
                                  "streamed reply text")
        assert FIB in map(str.strip, streaming.splitlines()) and PLACEHOLDER in streaming  # whole; box empty
        assert "tok/s" not in streaming                                   # still streaming: no stats yet
        # the reply runs for thousands of tokens: a message sent now waits for it
        tmux("send-keys", "-t", "chat", "hello there", "Enter")
        queued = tmux.wait_for(lambda s: "queued, sent when the reply ends" in s, 10, "the queued message")
        assert "hello there" in queued and PLACEHOLDER in queued and "tok/s" not in queued
        tmux("send-keys", "-t", "chat", "Escape")   # takes it back into the box; the reply goes on
        back = tmux.wait_for(lambda s: "queued," not in s and PLACEHOLDER not in s, 10, "the text back in the box")
        assert "hello there" in back and "tok/s" not in back
        tmux("send-keys", "-t", "chat", "Escape")   # now stops the reply
        stopped = tmux.wait_for(lambda s: "cancelled" in s, 20, "the reply to stop")
        tokens = int(next(line for line in stopped.splitlines() if "cancelled" in line).split()[0])
        assert 0 < tokens < 4000 and "hello there" in stopped and PLACEHOLDER not in stopped
        tmux("send-keys", "-t", "chat", "Enter")    # sends what came back
        tmux.wait_for(lambda s: (r := last_reply(s)) is not None and "cancelled" not in r
                      and PLACEHOLDER in s and len(reply_lines(s)) >= 1, 60, "the second reply")
        tmux("send-keys", "-t", "chat", "Escape")
        tmux.wait_for(lambda s: "cancelled" in (last_reply(s) or ""), 20, "the second reply to stop")
        tmux("send-keys", "-t", "chat", "F2")   # the monitor: the request is gone, its blocks freed
        tmux.wait_for(lambda s: "running 0 · waiting 0" in s and "blocks 0/" in s, 10, "an idle engine")
        tmux("send-keys", "-t", "chat", "Escape")
        tmux.wait_for(lambda s: "Message (Enter" in s, 10, "the chat again")
        tmux("send-keys", "-t", "chat", "C-q")
        deadline = time.monotonic() + 30   # saving sessions and stopping the engine, on a busy machine
        while not exit_file.exists() or not exit_file.read_text().strip():
            assert time.monotonic() < deadline, (
                f"ctrl+q did not quit within 30 s; the screen was:\n{tmux.screen()}\n{process_report()}")
            time.sleep(0.2)
        assert exit_file.read_text().strip() == "0", f"exit status {exit_file.read_text().strip()}:\n{tmux.screen()}"
        saved = list((tmp_path / "data" / "pagedserve" / "sessions").glob("*.json"))
        assert len(saved) == 1
        turns = json.loads(saved[0].read_text())["turns"]   # what the console sent the engine
        assert [t["content"] for t in turns if t["role"] == "user"] == [FIB, "hello there"]
        assert [t["stats"]["finish_reason"] for t in turns if t["role"] == "assistant"] == ["cancelled"] * 2
        assert turns[-1]["stats"]["cached"] > 0     # the second request began with the first one's prompt
    finally:
        subprocess.run(["tmux", "-S", str(tmux.socket), "kill-server"], capture_output=True)


def running(pid: int) -> bool:
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()   # a zombie has exited
    except FileNotFoundError:
        return False


def test_a_closed_terminal_quits_like_ctrl_q_and_keeps_the_prefix_cache(tiny_checkpoint, tmp_path):
    checkpoint = tiny_checkpoint()
    pagedserve = Path(sys.executable).parent / "pagedserve"
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path / "data"), "XDG_CONFIG_HOME": str(tmp_path / "config"),
           "TERM": "xterm-256color", "PAGEDSERVE_THREADS": "1", "PAGEDSERVE_CPU_KERNELS": "0"}
    cache = tmp_path / "cache"
    chat = (f"exec {shlex.quote(str(pagedserve))} chat --model {shlex.quote(str(checkpoint))} --dtype float32 "
            f"--temperature 0 --max-tokens 8 --prefix-cache-dir {shlex.quote(str(cache))}")
    tmux = Tmux(tmp_path / "tmux.sock")
    subprocess.run(["tmux", "-S", str(tmux.socket), "new-session", "-d", "-s", "chat", "-x", "110", "-y", "36",
                    "-c", str(tmp_path), chat], check=True, env=env, timeout=10)
    try:
        pid = int(tmux("display-message", "-p", "-t", "chat", "#{pane_pid}"))
        tmux.wait_for(lambda s: PLACEHOLDER in s and "loading" not in s, 120, "the model to load")
        tmux("send-keys", "-t", "chat", FIB, "Enter")
        tmux.wait_for(lambda s: "tokens ·" in (last_reply(s) or ""), 60, "the reply to end")
        assert not list(cache.glob("*.kv"))     # written when the engine stops
    finally:
        subprocess.run(["tmux", "-S", str(tmux.socket), "kill-server"], capture_output=True)   # SIGHUP
    deadline = time.monotonic() + 30
    while running(pid):
        assert time.monotonic() < deadline, f"the console outlived its terminal by 30 s:\n{process_report()}"
        time.sleep(0.2)
    assert len(list(cache.glob("*.kv"))) == 1
