"""The `pagedserve` CLI: config precedence (flag > env > file > default), config commands, generate/chat
with a fake LLM, models/pull with a fake preset module, and a --help that loads neither torch nor textual."""
from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import engine
from console.cli import main
from engine import config as cfg
from engine import config_file
from engine.loading import presets

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def home(tmp_path, monkeypatch):
    """An empty working directory, a private user config dir and no PAGEDSERVE_* variables."""
    for name in list(os.environ):
        if name.startswith("PAGEDSERVE_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return work


class FakeLLM:
    """Stands in for engine.LLM: records its keyword arguments and the calls it gets."""

    made: list[FakeLLM] = []

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.calls = []
        FakeLLM.made.append(self)

    def generate(self, prompts, params):
        self.calls.append(("generate", list(prompts), params))
        return [type("Out", (), {"text": f"echo:{prompts[0]}"})()]

    def close(self):
        self.calls.append(("close",))

    def chat(self, messages, params):
        self.calls.append(("chat", [dict(m) for m in messages], params))
        return type("Out", (), {"text": f"reply{len(messages)}"})()


@pytest.fixture
def fake_llm(monkeypatch):
    FakeLLM.made = []
    monkeypatch.setattr(engine, "LLM", FakeLLM, raising=False)
    return FakeLLM


def run(*args, env=None, input=None):
    return CliRunner().invoke(main, list(args), env=env, input=input, catch_exceptions=False)


def show_sources(*flags, group_args=(), env=None) -> dict[str, tuple[str, str]]:
    """`config show --sources FLAGS` as {dotted key: (value, source)}."""
    result = run(*group_args, "config", "show", "--sources", *flags, env=env)
    assert result.exit_code == 0, result.output
    prefix, parsed = "", {}
    for line in result.output.splitlines():
        if line.startswith("["):
            prefix = line.strip("[]") + "."
        elif " = " in line:
            key, rest = line.split(" = ", 1)
            value, source = rest.split("  # ")
            parsed[prefix + key] = (value, source)
    return parsed


# flag, env, file value for max_concurrency -> expected value and source kind
PRECEDENCE = [
    (None, None, None, "8", "default"),
    (None, None, "3", "3", "file"),
    (None, "5", "3", "5", "env"),
    (None, "5", None, "5", "env"),
    ("7", "5", "3", "7", "flag"),
    ("7", None, "3", "7", "flag"),
    ("7", None, None, "7", "flag"),
]


@pytest.mark.parametrize("flag, env, file, expected, source", PRECEDENCE)
def test_precedence_for_an_engine_key(home, fake_llm, flag, env, file, expected, source):
    if file:
        (home / "config.toml").write_text(f"max_concurrency = {file}\n")
    environ = {"PAGEDSERVE_MAX_CONCURRENCY": env} if env else {}
    flags = ["--max-concurrency", flag] if flag else []
    result = run("generate", "--prompt", "hi", *flags, env=environ)
    assert result.exit_code == 0, result.output
    assert fake_llm.made[0].kwargs["max_concurrency"] == int(expected)
    where = {"default": "default", "file": f"file {home / 'config.toml'}",
             "env": "env PAGEDSERVE_MAX_CONCURRENCY", "flag": "flag --max-concurrency"}[source]
    assert show_sources(*flags, env=environ)["max_concurrency"] == (expected, where)


@pytest.mark.parametrize("flag, env, file, expected, source", PRECEDENCE)
def test_precedence_for_a_server_key(home, flag, env, file, expected, source):
    if file:
        (home / "config.toml").write_text(f"[server]\nport = {file}\n")
    environ = {"PAGEDSERVE_PORT": env} if env else {}
    flags = ["--port", flag] if flag else []
    where = {"default": "default", "file": f"file {home / 'config.toml'}", "env": "env PAGEDSERVE_PORT",
             "flag": "flag --port"}[source]
    assert show_sources(*flags, env=environ)["server.port"] == ("8000" if source == "default" else expected, where)


def test_generate_passes_every_engine_key_and_sampling_values(home, fake_llm):
    (home / "config.toml").write_text('max_waiting = 9\nclient_timeout_s = 5\n[server]\nport = 1\n')
    result = run("generate", "--model", "/ckpt", "--prompt", "hello", "--max-tokens", "5", "--temperature", "0",
                 "--seed", "3", "--dtype", "float32", "--block-size", "32", "--compile",
                 env={"PAGEDSERVE_THREADS": "2"})
    assert result.exit_code == 0, result.output
    assert result.output == "echo:hello\n"
    llm = fake_llm.made[0]
    assert llm.kwargs == dict(vars(cfg.EngineConfig()), model="/ckpt", dtype="float32", block_size=32, compile=True, threads=2,
                              max_waiting=9, client_timeout_s=5.0)
    (_, prompts, params), closed = llm.calls
    assert prompts == ["hello"] and closed == ("close",)    # closing saves a kept prefix cache
    assert (params.max_tokens, params.temperature, params.seed) == (5, 0.0, 3)


def test_help_shows_file_values_as_defaults(home):
    (home / "config.toml").write_text("max_concurrency = 3\n")
    result = run("generate", "--help")
    assert "[env var: PAGEDSERVE_MAX_CONCURRENCY; default: 3]" in " ".join(result.output.split())


@pytest.mark.parametrize("args, env, message", [
    (["--block-size", "12"], {}, "block_size = 12: must be a power of two between 8 and 256"),
    (["--max-concurrency", "many"], {}, "'many' is not a valid integer"),
    ([], {"PAGEDSERVE_MAX_CONCURRENCY": "0"}, "Invalid value for '--max-concurrency' (env var: "
                                               "'PAGEDSERVE_MAX_CONCURRENCY'): max_concurrency = 0: must be"),
    (["--dtype", "int8"], {}, "'int8' is not one of 'auto', 'bfloat16', 'float32', 'float16'"),
])
def test_bad_values_are_usage_errors_naming_the_option(home, fake_llm, args, env, message):
    result = run("generate", "--prompt", "x", *args, env=env)
    assert result.exit_code == 2
    option = "--" + (args[0][2:] if args else "max-concurrency")
    assert f"Error: Invalid value for '{option}'" in result.output
    assert message in result.output
    assert fake_llm.made == []


def test_a_bad_file_stops_engine_commands_with_every_problem_and_no_traceback(home, fake_llm):
    (home / "config.toml").write_text("max_concurency = 3\nblock_size = 12\n")
    result = run("generate", "--prompt", "x")
    assert result.exit_code == 2
    assert "unknown key 'max_concurency'; did you mean 'max_concurrency'?" in result.output
    assert "block_size = 12: must be a power of two between 8 and 256" in result.output
    assert "Traceback" not in result.output and fake_llm.made == []


def test_bad_sampling_value_exits_2(home, fake_llm):
    result = run("generate", "--prompt", "x", "--temperature", "-1")
    assert result.exit_code == 2 and "temperature=-1.0 must be >= 0" in result.output


def test_config_path_follows_flag_then_cwd_then_user_file(home, tmp_path):
    user = config_file.user_config_path()
    assert run("config", "path").output.startswith(f"{user} (not created yet")
    user.parent.mkdir(parents=True)
    user.write_text("")
    assert run("config", "path").output == f"{user}\n"
    (home / "config.toml").write_text("")
    assert run("config", "path").output == f"{home / 'config.toml'}\n"
    other = tmp_path / "other.toml"
    assert run("--config", str(other), "config", "path").output == f"{other}\n"
    assert run("config", "path", env={"PAGEDSERVE_CONFIG": str(other)}).output == f"{other}\n"


def test_user_file_values_apply_when_there_is_no_local_file(home, fake_llm):
    user = config_file.user_config_path()
    user.parent.mkdir(parents=True)
    user.write_text("threads = 3\n")
    assert run("generate", "--prompt", "x").exit_code == 0
    assert fake_llm.made[0].kwargs["threads"] == 3


def test_config_show_lists_every_key_with_its_source(home):
    (home / "config.toml").write_text('dtype = "float32"\n[console.keys]\nquit = "ctrl+q"\n')
    shown = show_sources(group_args=("--config", "config.toml"), env={"PAGEDSERVE_DEVICE": "cpu"})
    assert shown["dtype"] == ('"float32"', "file config.toml")
    assert shown["device"] == ('"cpu"', "env PAGEDSERVE_DEVICE")
    assert shown["block_size"] == ("16", "default")
    assert shown["server.port"] == ("8000", "default")
    assert shown["console.keys.quit"] == ('"ctrl+q"', "file config.toml")
    assert set(shown) == set(config_file.dotted_keys()) - {"console.keys"} | {"console.keys.quit"}
    plain = run("config", "show").output
    assert "#" not in plain and "max_concurrency = 8\n" in plain


def test_config_get(home):
    (home / "config.toml").write_text('model = "/ckpt"\n[server]\nport = 9000\n[console.keys]\nquit = "q"\n')
    assert run("config", "get", "model").output == "/ckpt\n"
    assert run("config", "get", "server.port").output == "9000\n"
    assert run("config", "get", "server.port", env={"PAGEDSERVE_PORT": "9001"}).output == "9001\n"
    assert run("config", "get", "compile").output == "false\n"
    assert run("config", "get", "console.keys.quit").output == "q\n"
    result = run("config", "get", "max_concurency")
    assert result.exit_code == 2
    assert "unknown key 'max_concurency'; did you mean 'max_concurrency'?" in result.output


def test_config_validate_lists_every_problem(home, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('max_concurency = 3\nblock_size = 12\ndevice = "tpu"\n[server]\nport = "http"\n')
    result = run("config", "validate", str(bad))
    assert result.exit_code == 1
    assert result.output.splitlines() == [
        f"{bad}: 4 problems",
        "  unknown key 'max_concurency'; did you mean 'max_concurrency'?",
        '  device = "tpu": must be one of "auto", "cpu", "cuda"',
        "  block_size = 12: must be a power of two between 8 and 256",
        '  server.port = "http": must be an integer between 1 and 65535',
    ]
    good = tmp_path / "good.toml"
    good.write_text("block_size = 32\n")
    assert run("config", "validate", str(good)).output == f"{good}: valid\n"
    # the file in use is validated when no FILE is given, even though it is broken
    (home / "config.toml").write_text("block_size = 12\n")
    result = run("config", "validate")
    assert result.exit_code == 1 and "block_size = 12" in result.output


def test_config_set_keeps_comments_and_rejects_invalid_values(home):
    path = home / "config.toml"
    original = "# my settings\nmax_concurrency = 4  # four users\n\n[server]\n# the port\nport = 8000\n"
    path.write_text(original)
    assert run("config", "set", "server.port", "9001").exit_code == 0
    assert run("config", "set", "block_size", "32").exit_code == 0
    assert run("config", "set", "console.keys.quit", "ctrl+q").exit_code == 0
    text = path.read_text()
    for kept in ("# my settings", "max_concurrency = 4  # four users", "# the port"):
        assert kept in text
    loaded = config_file.load_config(path)
    assert (loaded.server.port, loaded.engine.block_size, loaded.engine.max_concurrency) == (9001, 32, 4)
    assert loaded.console.keys == {"quit": "ctrl+q"}
    before = path.read_text()
    for key, value, message in [("block_size", "12", "block_size = 12: must be a power of two"),
                                ("server.port", "0", "server.port = 0: must be an integer between 1 and 65535"),
                                ("compile", "maybe", 'compile = "maybe": must be true or false'),
                                ("max_concurency", "3", "did you mean 'max_concurrency'?")]:
        result = run("config", "set", key, value)
        assert result.exit_code == 2 and message in result.output
        assert path.read_text() == before


def test_config_set_creates_the_user_config_from_the_commented_default(home):
    assert run("config", "set", "threads", "2").exit_code == 0
    user = config_file.user_config_path()
    assert config_file.load_config(user) == cfg.Config(engine=cfg.EngineConfig(threads=2))
    assert "# CPU threads for torch" in user.read_text()


def test_config_init_writes_the_default_and_refuses_to_overwrite(home):
    user = config_file.user_config_path()
    result = run("config", "init")
    assert result.exit_code == 0 and user.read_text() == (ROOT / "config.toml").read_text()
    user.write_text("threads = 1\n")
    result = run("config", "init")
    assert result.exit_code != 0 and "--force" in result.output
    assert user.read_text() == "threads = 1\n"
    assert run("config", "init", "--force").exit_code == 0
    assert config_file.load_config(user) == cfg.Config()


def test_models_lists_presets(home, monkeypatch):
    listed = [presets.PresetStatus("tiny", "a tiny model", 98_362_432, True, Path("/c/tiny.gguf")),
              presets.PresetStatus("big-one", "a big model", 1_117_320_768, False, None)]
    monkeypatch.setattr(presets, "list_presets", lambda: listed)
    lines = run("models").output.splitlines()
    assert lines[0].split() == ["NAME", "SIZE", "PULLED", "DESCRIPTION"]
    assert lines[1].split() == ["tiny", "93.8", "MiB", "yes", "a", "tiny", "model"]
    assert lines[2].split() == ["big-one", "1.0", "GiB", "no", "a", "big", "model"]


def test_pull_reports_progress_and_the_path(home, monkeypatch):
    seen = []

    def fake_pull(name, progress):
        for done in (0, 50, 100):
            progress(done, 100)
            seen.append(done)
        return Path(f"/cache/{name}.gguf")

    monkeypatch.setattr(presets, "pull", fake_pull)
    result = run("pull", "tiny")
    assert result.exit_code == 0 and seen == [0, 50, 100]
    assert "pulling tiny" in result.output and result.output.endswith("tiny: /cache/tiny.gguf\n")

    def failing_pull(name, progress):
        raise presets.PullError(f"unknown model preset {name!r}")

    monkeypatch.setattr(presets, "pull", failing_pull)
    result = run("pull", "nope")
    assert result.exit_code == 1 and "Error: unknown model preset 'nope'" in result.output


def test_version(home):
    assert run("version").output == f"pagedserve {importlib.metadata.version('pagedserve')}\n"


def test_help_and_config_commands_import_neither_torch_nor_textual(tmp_path):
    code = (
        "import sys\n"
        "from console.cli import main\n"
        "for args in (['--help'], ['config', 'show'], ['generate', '--help']):\n"
        "    main(args, standalone_mode=False)\n"
        "print('torch' in sys.modules, 'textual' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin", "XDG_CONFIG_HOME": str(tmp_path)})
    assert out.stdout.splitlines()[-1] == "False False"


@pytest.mark.parametrize("args, message", [
    (("--model", "/nonexistent/model"), "is not a preset"),
    (("--temperature", "-1"), "temperature=-1.0 must be >= 0"),
])
def test_generate_with_bad_input_prints_the_error_not_a_traceback(home, args, message):
    """The real engine, no mocks: user errors from any layer end as one line and exit status 2."""
    result = CliRunner().invoke(main, ["generate", "--prompt", "hi", *args])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output


def test_generate_json_schema_constrains_the_output(home, tiny_checkpoint):
    import jsonschema
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    (home / "schema.json").write_text(json.dumps(schema))
    model = tiny_checkpoint("qwen3", tied=False, heads=8, kv_heads=2, head_dim=32)
    result = CliRunner().invoke(main, ["generate", "--model", str(model), "--dtype", "float32", "--prompt", "hi",
                                       "--json-schema", "schema.json", "--temperature", "1", "--seed", "0",
                                       "--max-tokens", "200"])
    assert result.exit_code == 0, result.output
    jsonschema.validate(json.loads(result.output), schema)
    (home / "bad.json").write_text('{"type": "objekt"}')
    bad = CliRunner().invoke(main, ["generate", "--model", str(model), "--dtype", "float32", "--prompt", "hi",
                                    "--json-schema", "bad.json"])
    assert bad.exit_code == 2 and "objekt" in bad.output and "Traceback" not in bad.output
    (home / "broken.json").write_text('{"type": ')
    broken = CliRunner().invoke(main, ["generate", "--prompt", "hi", "--json-schema", "broken.json"])
    assert broken.exit_code == 2 and "broken.json is not a readable JSON file" in broken.output
