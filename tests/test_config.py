"""engine.config and engine.config_file: defaults, TOML files, validation listing every problem, did-you-mean."""
from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from engine.config import (
    Config, ConfigError, ConsoleConfig, EngineConfig, ServerConfig, config_from_dict, make_engine_config,
)
from engine.config_file import (
    default_config_text, find_config_file, key_path, load_config, parse_value, set_in_file, user_config_path,
)

ROOT = Path(__file__).resolve().parents[1]

# the defaults as the brief specifies them, written out by hand
SPEC_ENGINE = dict(model="qwen2.5-coder-1.5b", dtype="auto", device="auto", max_concurrency=8, kv_pool_tokens=0,
                   block_size=16, max_model_len=0, rope_scaling="auto", rope_scale=0.0, compile=False, cuda_graphs=True, threads=0, max_waiting=256,
                   client_max_lag_tokens=1024, client_timeout_s=60.0, prefix_cache=True, prefix_cache_dir="",
                   prefix_cache_save_interval_s=300.0,
                   speculative="auto", draft_model="", draft_quantization="auto", num_speculative_tokens=5,
                   ngram_min=3, ngram_max=4,
                   state_spare_slots=4, quantization="auto", quant_group_size=32, kv_cache_dtype="auto",
                   overlap_scheduling="auto")
SPEC_SERVER = dict(host="127.0.0.1", port=8000, api_key="", max_body_bytes=1048576, admin_key="",
                   served_model_name=(),
                   tool_call_parser="auto", reasoning_parser="auto", sse_keepalive_s=1.0,
                   header_timeout_s=10.0, request_timeout_s=0.0, responses_store=256,
                   allowed_origins=())


def test_defaults_match_the_spec():
    assert EngineConfig() == EngineConfig(**SPEC_ENGINE)
    assert vars(EngineConfig()) == SPEC_ENGINE
    assert vars(ServerConfig()) == SPEC_SERVER
    assert ConsoleConfig().keys == {}
    assert ConsoleConfig().keys is not ConsoleConfig().keys  # no shared mutable default


def test_shipped_config_toml_is_exactly_the_defaults():
    text = (ROOT / "config.toml").read_text()
    assert load_config(ROOT / "config.toml") == Config()
    data = tomllib.loads(text)
    assert {k: v for k, v in data.items() if k not in ("server", "console")} == SPEC_ENGINE
    assert data["server"] == SPEC_SERVER | {"served_model_name": [], "allowed_origins": []}    # TOML arrays
    assert data["console"] == {"keys": {}}
    # `config init` writes the same commented file that ships
    assert text == default_config_text()


def test_every_key_in_the_shipped_file_has_a_comment_line_above_it():
    lines = (ROOT / "config.toml").read_text().splitlines()
    keyed = [i for i, line in enumerate(lines) if "=" in line and not line.startswith("#")]
    assert len(keyed) == len(SPEC_ENGINE) + len(SPEC_SERVER)
    for i in keyed:
        assert lines[i - 1].startswith("# "), lines[i]


def test_one_error_lists_every_problem_with_key_value_and_what_is_allowed():
    data = {
        "max_concurency": 3,
        "block_size": 12,
        "dtype": "int8",
        "max_concurrency": True,
        "client_timeout_s": 0,
        "server": {"prot": 80, "port": 70000},
        "console": {"keys": {"quit": 5}},
    }
    with pytest.raises(ConfigError) as err:
        config_from_dict(data, "my.toml")
    assert sorted(err.value.problems) == sorted([
        "unknown key 'max_concurency'; did you mean 'max_concurrency'?",
        "block_size = 12: must be a power of two between 8 and 256",
        'dtype = "int8": must be one of "auto", "bfloat16", "float32", "float16"',
        "max_concurrency = true: must be an integer >= 1",
        "client_timeout_s = 0: must be a number > 0 (seconds)",
        "unknown key 'server.prot'; did you mean 'server.port'?",
        "server.port = 70000: must be an integer between 1 and 65535",
        'console.keys.quit = 5: must be a non-empty key string such as "ctrl+q"',
    ])
    assert str(err.value).startswith("my.toml: 8 problems:")


def test_unknown_table_key_and_a_table_where_a_value_belongs():
    with pytest.raises(ConfigError) as err:
        config_from_dict({"sever": {"port": 1}, "server": 5, "console": {"kyes": {}}})
    assert sorted(err.value.problems) == sorted([
        "unknown key 'sever'; did you mean 'server'?",
        "server = 5: must be a table ([server])",
        "unknown key 'console.kyes'; did you mean 'console.keys'?",
    ])


def test_unknown_key_without_a_close_match_lists_the_keys():
    with pytest.raises(ConfigError, match="unknown key 'zzz'; the keys are: model, dtype"):
        config_from_dict({"zzz": 1})


@pytest.mark.parametrize("size, ok", [(8, True), (16, True), (256, True), (4, False), (12, False), (512, False)])
def test_block_size_is_a_power_of_two_in_range(size, ok):
    if ok:
        assert config_from_dict({"block_size": size}).engine.block_size == size
    else:
        with pytest.raises(ConfigError, match=f"block_size = {size}: must be a power of two between 8 and 256"):
            config_from_dict({"block_size": size})


def test_types_are_strict_but_an_integer_is_a_fine_float():
    cfg = config_from_dict({"client_timeout_s": 5, "server": {"port": 1}})
    assert cfg.engine.client_timeout_s == 5.0 and isinstance(cfg.engine.client_timeout_s, float)
    with pytest.raises(ConfigError, match='max_concurrency = "8": must be an integer >= 1'):
        config_from_dict({"max_concurrency": "8"})
    with pytest.raises(ConfigError, match="compile = 1: must be true or false"):
        config_from_dict({"compile": 1})


def test_make_engine_config_and_replace():
    cfg = make_engine_config(model="/m", max_concurrency=2, compile=True)
    assert (cfg.model, cfg.max_concurrency, cfg.compile, cfg.block_size) == ("/m", 2, True, 16)
    again = cfg.replace(block_size=32)
    assert (again.block_size, cfg.block_size) == (32, 16)
    with pytest.raises(ConfigError) as err:
        make_engine_config(max_concurency=4)
    assert str(err.value) == "unknown key 'max_concurency'; did you mean 'max_concurrency'?"
    with pytest.raises(ConfigError, match="threads = -1: must be an integer >= 0"):
        cfg.replace(threads=-1)
    with pytest.raises(ConfigError, match="block_size = 12"):
        EngineConfig(block_size=12)


def test_load_config_none_missing_and_malformed(tmp_path):
    assert load_config(None) == Config()
    with pytest.raises(ConfigError, match=r"nothere\.toml: no such file"):
        load_config(tmp_path / "nothere.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("max_concurrency = = 3\n")
    with pytest.raises(ConfigError, match=r"bad\.toml: not valid TOML"):
        load_config(bad)
    good = tmp_path / "good.toml"
    good.write_text('model = "/ckpt"\n[server]\nport = 9000\n[console.keys]\nquit = "ctrl+q"\n')
    cfg = load_config(good)
    assert (cfg.engine.model, cfg.server.port, cfg.console.keys) == ("/ckpt", 9000, {"quit": "ctrl+q"})
    assert cfg.engine.max_concurrency == 8


def test_config_file_discovery_order(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    user = user_config_path()
    assert user == tmp_path / "xdg" / "pagedserve" / "config.toml"
    cwd = tmp_path / "work"
    cwd.mkdir()
    assert find_config_file(None, cwd) is None
    user.parent.mkdir(parents=True)
    user.write_text("")
    assert find_config_file(None, cwd) == user
    (cwd / "config.toml").write_text("")
    assert find_config_file(None, cwd) == cwd / "config.toml"
    assert find_config_file(tmp_path / "x.toml", cwd) == tmp_path / "x.toml"


def test_dotted_keys_and_parse_value():
    assert key_path("server.port") == ("server", "port")
    assert key_path("console.keys.quit") == ("console", "keys", "quit")
    with pytest.raises(ConfigError, match="did you mean 'server.port'"):
        key_path("server.prot")
    assert parse_value("max_concurrency", "4") == 4
    assert parse_value("client_timeout_s", "2.5") == 2.5
    assert parse_value("compile", "yes") is True and parse_value("compile", "false") is False
    assert parse_value("console.keys.quit", "ctrl+q") == "ctrl+q"
    with pytest.raises(ConfigError, match='max_concurrency = "four": must be an integer >= 1'):
        parse_value("max_concurrency", "four")


def test_importing_the_config_does_not_import_torch():
    code = "import sys, engine.config, engine.config_file; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_set_in_file_keeps_old_problems_but_refuses_new_ones_and_malformed_files(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("block_size = 12  # wrong already\n")
    assert set_in_file(path, "threads", "2") == 2
    assert tomllib.loads(path.read_text()) == {"block_size": 12, "threads": 2}
    assert "# wrong already" in path.read_text()
    with pytest.raises(ConfigError, match="max_waiting = 0: must be an integer >= 1"):
        set_in_file(path, "max_waiting", "0")
    path.write_text("threads = = 2\n")
    with pytest.raises(ConfigError, match="not valid TOML, fix it by hand first"):
        set_in_file(path, "threads", "3")
    assert path.read_text() == "threads = = 2\n"
