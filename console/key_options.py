"""Config keys as click options, and the config file in use.

Every EngineConfig / ServerConfig key becomes a KeyOption (`--max-concurrency`, env
PAGEDSERVE_MAX_CONCURRENCY); the discovered config file's values reach click as `ctx.default_map`.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import click

from engine import config as cfg
from engine import config_file

ENV_PREFIX = "PAGEDSERVE_"
_CLICK_TYPES = {int: click.INT, float: click.FLOAT, str: click.STRING, bool: click.BOOL}


class ConfigProblem(click.ClickException):
    """A ConfigError (or bad sampling value) shown as `Error: ...`, exit status 2, no traceback."""

    exit_code = 2


class KeyOption(click.Option):
    """An option that sets config key `self.name` of the dataclass `section` (EngineConfig, ServerConfig)."""

    def __init__(self, *args: Any, section: type, **kwargs: Any):
        super().__init__(*args, callback=self._check, **kwargs)
        self.section = section

    def _check(self, ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        # ranges live in engine.config (one source); click only converted the text to the key's type
        problems = cfg.section_problems(self.section, {self.name: value})
        if problems:
            raise click.BadParameter(problems[0], ctx=ctx, param=param)
        return value


def _key_option(section: type, f: dataclasses.Field, hidden: bool):
    default = cfg.default_of(f)
    flag = "--" + f.name.replace("_", "-")
    decls = [f"{flag}/--no-{flag[2:]}" if isinstance(default, bool) else flag, f.name]
    choices = f.metadata["choices"]
    many = isinstance(default, tuple)     # a list key: the flag is repeated, once per value
    return click.option(
        *decls, cls=KeyOption, section=section, default=default, show_default=True,
        type=click.Choice(choices) if choices else _CLICK_TYPES[str if many else type(default)],
        multiple=many, envvar=ENV_PREFIX + f.name.upper(), show_envvar=True, hidden=hidden,
        help=f.metadata["help"],
    )


def key_options(section: type, visible: tuple[str, ...] | None = None):
    """One KeyOption per key of `section`; keys outside `visible` still work but stay out of --help."""
    def decorate(command):
        for f in reversed(dataclasses.fields(section)):
            command = _key_option(section, f, hidden=visible is not None and f.name not in visible)(command)
        return command
    return decorate


def section_values(ctx: click.Context, section: type) -> dict[str, Any]:
    return {f.name: ctx.params[f.name] for f in dataclasses.fields(section)}


@dataclasses.dataclass
class ConfigFile:
    """The config file in use. A broken file does not stop `config path/validate/set/init`; the
    commands that need its values call `require()`."""

    path: Path | None
    config: cfg.Config
    values: dict[str, Any]  # the keys the file sets, by flag name, validated
    error: cfg.ConfigError | None = None

    @classmethod
    def discover(cls, explicit: Path | None) -> ConfigFile:
        path = config_file.find_config_file(explicit)
        if path is None:
            return cls(None, cfg.Config(), {})
        try:
            data = config_file.read_toml(path)
            config = cfg.config_from_dict(data, str(path))
        except cfg.ConfigError as e:
            return cls(path, cfg.Config(), {}, e)
        values = {k: getattr(config.engine, k) for k in data if k not in cfg.TABLES}
        values |= {k: getattr(config.server, k) for k in data.get("server", {})}
        return cls(path, config, values)

    def require(self) -> cfg.Config:
        if self.error is not None:
            raise self.error
        return self.config


def default_map(group: click.Group, values: dict[str, Any]) -> dict[str, Any]:
    """click's default_map for every command under `group`: each KeyOption's value from the file."""
    result: dict[str, Any] = {}
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            result[name] = default_map(command, values)
        else:
            result[name] = {p.name: values[p.name] for p in command.params
                            if isinstance(p, KeyOption) and p.name in values}
    return result
