"""pagedserve's config files: reading TOML into a Config, finding the file in use, `config set` (which
keeps a file's comments and layout) and the commented default file (the shipped config.toml).

No torch here, as in engine/config.py.
"""
from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

import platformdirs
import tomlkit

from engine.atomic_file import write_atomic
from engine.config import (TABLE_CLASSES, Config, ConfigError, ConsoleConfig, EngineConfig, ServerConfig,
                           config_from_dict, default_of, toml_literal, unknown_key)


def read_toml(path: str | Path) -> dict[str, Any]:
    """The parsed file; a missing, unreadable or malformed file raises ConfigError naming it."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(["no such file"], str(path)) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError([f"cannot read it: {e}"], str(path)) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError([f"not valid TOML: {e}"], str(path)) from None


def load_config(path: str | Path | None = None) -> Config:
    """The config in `path`, or the built-in defaults for None."""
    return Config() if path is None else config_from_dict(read_toml(path), str(path))


def user_config_path() -> Path:
    return Path(platformdirs.user_config_dir("pagedserve")) / "config.toml"


def find_config_file(explicit: str | Path | None = None, cwd: Path | None = None) -> Path | None:
    """The file in use: `explicit` (--config), else ./config.toml if present, else the user config
    file if present, else None (built-in defaults)."""
    if explicit is not None:
        return Path(explicit)
    local = (cwd or Path.cwd()) / "config.toml"
    if local.is_file():
        return local
    user = user_config_path()
    return user if user.is_file() else None


def dotted_keys() -> list[str]:
    """Every settable key, tables dotted: `max_concurrency`, `server.port`, `console.keys`."""
    keys = [f.name for f in fields(EngineConfig)]
    for table, cls in TABLE_CLASSES.items():
        keys += [f"{table}.{f.name}" for f in fields(cls)]
    return keys


def key_path(dotted: str) -> tuple[str, ...]:
    """`server.port` -> ("server", "port"); `console.keys.quit` -> ("console", "keys", "quit").
    Unknown keys raise ConfigError with a did-you-mean."""
    if dotted.startswith("console.keys.") and len(dotted) > len("console.keys."):
        return ("console", "keys", dotted[len("console.keys."):])
    if dotted not in dotted_keys():
        raise ConfigError([unknown_key(dotted, dotted_keys())])
    return tuple(dotted.split("."))


def _field_at(path: tuple[str, ...]) -> dataclasses.Field:
    cls = TABLE_CLASSES[path[0]] if len(path) > 1 else EngineConfig
    return cls.__dataclass_fields__[path[-1] if len(path) < 3 else path[1]]


_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def parse_value(dotted: str, text: str) -> Any:
    """The text of `config set KEY VALUE` as the key's type (range checks happen in validation)."""
    path = key_path(dotted)
    if len(path) == 3:
        return text
    f = _field_at(path)
    kind = type(default_of(f))
    problem = ConfigError([f"{dotted} = {toml_literal(text)}: must be {f.metadata['allowed']}"])
    if kind is dict:
        raise ConfigError([f"{dotted} is a table: set one binding with `config set {dotted}.<id> KEY`"])
    if kind is bool:
        if text.lower() not in _TRUE + _FALSE:
            raise problem
        return text.lower() in _TRUE
    if kind is tuple:   # `config set server.served_model_name "a,b"`
        return [part.strip() for part in text.split(",") if part.strip()]
    try:
        return kind(text)
    except ValueError:
        raise problem from None


def _problems(data: Mapping[str, Any]) -> list[str]:
    try:
        config_from_dict(data)
    except ConfigError as e:
        return e.problems
    return []


def set_in_file(path: Path, dotted: str, text: str) -> Any:
    """Set key `dotted` to the value written `text` in the TOML file `path`, keeping its comments and
    layout; a missing file starts as the commented default. Writes nothing (and raises ConfigError) if
    the change adds a problem; problems the file already had do not block it. Returns the typed value."""
    key = key_path(dotted)
    value = parse_value(dotted, text)
    try:
        doc = tomlkit.parse(path.read_text(encoding="utf-8") if path.is_file() else default_config_text())
    except tomlkit.exceptions.ParseError as e:
        raise ConfigError([f"not valid TOML, fix it by hand first: {e}"], str(path)) from None
    before = _problems(doc.unwrap())
    container: Any = doc
    for part in key[:-1]:
        if part not in container:
            container[part] = tomlkit.table()
        container = container[part]
    container[key[-1]] = value
    added = [p for p in _problems(doc.unwrap()) if p not in before]
    if added:
        raise ConfigError(added, str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, tomlkit.dumps(doc))       # a crash mid-write keeps the old file, never half of it
    return value


_HEADER = """\
# pagedserve configuration. Every key is optional: a missing key keeps its built-in default.
# Precedence: command-line flag > environment variable PAGEDSERVE_<KEY> > this file > built-in default.
# Check a file with `pagedserve config validate FILE`; change a key with `pagedserve config set KEY VALUE`.
"""


def default_config_text() -> str:
    """The commented default config (the shipped config.toml and what `config init` writes)."""
    lines = [_HEADER]
    for header, cls in (([], EngineConfig), (["[server]"], ServerConfig)):
        lines += header
        for f in fields(cls):
            lines += [f"# {f.metadata['help']}", f"{f.name} = {toml_literal(default_of(f))}", ""]
    lines += ["[console]", f"# {ConsoleConfig.__dataclass_fields__['keys'].metadata['help']}", "[console.keys]", ""]
    return "\n".join(lines)
