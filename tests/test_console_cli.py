"""`pagedserve chat`: which client it builds from flags and the config file, and its refusals."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from console import cli
from console.app import ConsoleApp
from console.client import HttpClient, InProcessClient


@pytest.fixture
def opened(monkeypatch, tmp_path):
    """The ConsoleApp `chat` would run (not run); sessions would go to tmp_path."""
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "in_terminal", lambda: True)
    apps = []
    monkeypatch.setattr(ConsoleApp, "run", lambda self: apps.append(self))
    return apps


def chat(*args):
    return CliRunner().invoke(cli.main, list(args), catch_exceptions=False)


def test_chat_with_url_attaches_to_a_server_with_the_key_and_keymap(opened, tmp_path):
    (tmp_path / "config.toml").write_text('[server]\napi_key = "from-file"\n[console.keys]\nquit = "ctrl+x"\n')
    assert chat("chat", "--url", "http://127.0.0.1:8000/", "--temperature", "0.3").exit_code == 0
    (app,) = opened
    assert isinstance(app.client, HttpClient) and app.client.url == "http://127.0.0.1:8000"
    assert app.client.http.headers["authorization"] == "Bearer from-file"
    assert app.key_overrides == {"quit": "ctrl+x"} and app.new_session_params["temperature"] == 0.3
    assert str(app.store.sessions_dir).startswith(str(tmp_path / "data"))
    assert chat("chat", "--url", "http://h:1", "--api-key", "flag").exit_code == 0
    assert opened[1].client.http.headers["authorization"] == "Bearer flag"


def test_chat_without_url_runs_the_engine_in_process(opened):
    assert chat("chat", "--model", "/ckpt", "--dtype", "float32", "--max-tokens", "64").exit_code == 0
    (app,) = opened
    assert isinstance(app.client, InProcessClient) and app.what == "/ckpt"
    assert (app.client._config.model, app.client._config.dtype) == ("/ckpt", "float32")
    assert app.new_session_params["max_tokens"] == 64


def test_chat_refuses_unknown_binding_ids_and_bad_sampling_values(opened, tmp_path):
    (tmp_path / "config.toml").write_text('[console.keys]\nregenrate = "ctrl+g"\n')
    result = chat("chat")
    assert result.exit_code == 2 and "console.keys.regenrate: unknown binding id; did you mean 'regenerate'" in result.output
    (tmp_path / "config.toml").unlink()
    result = chat("chat", "--temperature", "-1")
    assert result.exit_code == 2 and "temperature" in result.output
    assert opened == []


def test_chat_needs_a_terminal(monkeypatch):
    monkeypatch.setattr(cli, "in_terminal", lambda: False)
    result = chat("chat", "--model", "/ckpt")
    assert result.exit_code == 1 and "needs a terminal" in result.output
