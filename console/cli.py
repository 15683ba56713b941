"""The `pagedserve` command line (click).

Every engine and server key can be a flag; its value comes from, in order: the flag, the environment
variable PAGEDSERVE_<KEY>, the config file (fed to click as `ctx.default_map`, so `--help` shows file
values as defaults), the built-in default. Engine internals (torch) are imported inside the commands
that need them, so `pagedserve --help` and the config commands start fast.
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import json
import sys
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from console.key_options import (ENV_PREFIX, ConfigFile, ConfigProblem, KeyOption, default_map,
                                 key_options, section_values)
from engine import config as cfg
from engine import config_file
from engine.atomic_file import write_atomic
from engine.errors import UserError
from engine.grammar import Grammar
from engine.request import SamplingParams

COMMON_ENGINE_FLAGS = ("model", "dtype", "quantization", "device", "max_concurrency", "kv_pool_tokens",
                       "block_size", "max_model_len", "rope_scaling", "rope_scale", "compile", "threads",
                       "kv_cache_dtype", "speculative", "draft_model", "draft_quantization", "prefix_cache_dir")


class _Group(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except UserError as e:     # bad config, model or input: the message is the whole story
            raise ConfigProblem(str(e)) from None


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_file", type=click.Path(dir_okay=False, path_type=Path),
              envvar=ENV_PREFIX + "CONFIG", show_envvar=True,
              help="Config file to use (default: ./config.toml if present, else the user config file).")
@click.pass_context
def main(ctx: click.Context, config_file: Path | None) -> None:
    """pagedserve: serve Qwen-family models to many users at once."""
    ctx.obj = ConfigFile.discover(config_file)
    ctx.default_map = default_map(main, ctx.obj.values)


@main.command()
def version() -> None:
    """Print the pagedserve version."""
    click.echo(f"pagedserve {importlib.metadata.version('pagedserve')}")


@main.group("config")
def config_group() -> None:
    """Show, check and change the configuration."""


@config_group.command("path")
@click.pass_obj
def config_path(state: ConfigFile) -> None:
    """Print the config file in use."""
    if state.path is None:
        click.echo(f"{config_file.user_config_path()} (not created yet: built-in defaults in use)")
    else:
        click.echo(state.path)


def _source(ctx: click.Context, param: KeyOption, file: Path | None) -> str:
    source = ctx.get_parameter_source(param.name)
    if source is ParameterSource.COMMANDLINE:
        return f"flag {param.opts[0]}"
    if source is ParameterSource.ENVIRONMENT:
        return f"env {param.envvar}"
    if source is ParameterSource.DEFAULT_MAP:
        return f"file {file}"
    return "default"


@config_group.command("show")
@click.option("--sources", is_flag=True, help="Also say where each value came from: flag, env, file or default.")
@key_options(cfg.EngineConfig)
@key_options(cfg.ServerConfig)
@click.pass_context
def config_show(ctx: click.Context, sources: bool, **_keys: Any) -> None:
    """Print every key with the value a command would use (flags given here count too)."""
    state: ConfigFile = ctx.obj
    config = state.require()

    def line(name: str, value: Any, source: str) -> str:
        return f"{name} = {cfg.toml_literal(value)}" + (f"  # {source}" if sources else "")

    params = [p for p in ctx.command.params if isinstance(p, KeyOption)]
    for section, header in ((cfg.EngineConfig, None), (cfg.ServerConfig, "[server]")):
        if header:
            click.echo(f"\n{header}")
        for p in params:
            if p.section is section:
                click.echo(line(p.name, ctx.params[p.name], _source(ctx, p, state.path)))
    click.echo("\n[console.keys]")
    for binding, key in config.console.keys.items():
        click.echo(line(binding, key, f"file {state.path}"))


@config_group.command("get")
@click.argument("key")
@click.pass_context
def config_get(ctx: click.Context, key: str) -> None:
    """Print one key's value (tables dotted: server.port, console.keys.quit)."""
    path = config_file.key_path(key)
    state: ConfigFile = ctx.obj
    config = state.require()
    if path[0] == "console":
        value: Any = config.console.keys
        if len(path) == 3:
            if path[2] not in value:
                raise cfg.ConfigError([f"{key} is not set (the console uses its default binding)"])
            value = value[path[2]]
    else:  # resolve env, file and default exactly as `config show` does
        with config_show.make_context("show", [], parent=ctx.parent) as show_ctx:
            value = show_ctx.params[path[-1]]
    click.echo(value if isinstance(value, str) else cfg.toml_literal(value))


@config_group.command("set")
@click.argument("key")
@click.argument("value")
@click.pass_obj
def config_set(state: ConfigFile, key: str, value: str) -> None:
    """Set KEY to VALUE in the config file in use (the user config file is created if there is none).

    Comments and layout of the file are kept. The file is only written if the change adds no problem."""
    target = state.path or config_file.user_config_path()
    typed = config_file.set_in_file(target, key, value)
    click.echo(f"{key} = {cfg.toml_literal(typed)} (written to {target})")


@config_group.command("validate")
@click.argument("file", required=False, type=click.Path(dir_okay=False, path_type=Path))
@click.pass_obj
def config_validate(state: ConfigFile, file: Path | None) -> None:
    """Check FILE (default: the file in use) and list every problem; exit status 1 if there are any."""
    file = file or state.path
    if file is None:
        click.echo("no config file: built-in defaults in use")
        return
    try:
        config_file.load_config(file)
    except cfg.ConfigError as e:
        click.echo(f"{file}: {len(e.problems)} problem{'s' if len(e.problems) > 1 else ''}")
        for problem in e.problems:
            click.echo(f"  {problem}")
        raise click.exceptions.Exit(1) from None
    click.echo(f"{file}: valid")


@config_group.command("init")
@click.option("--force", is_flag=True, help="Overwrite an existing user config file.")
def config_init(force: bool) -> None:
    """Write the commented default config to the user config file."""
    target = config_file.user_config_path()
    if target.exists() and not force:
        raise click.ClickException(f"{target} already exists; pass --force to overwrite it")
    target.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(target, config_file.default_config_text())
    click.echo(f"wrote {target}")


def sampling_options(command):
    for decorator in reversed((
        click.option("--max-tokens", type=int, default=SamplingParams.max_tokens, show_default=True,
                     help="Most tokens to generate per answer."),
        click.option("--temperature", type=float, default=SamplingParams.temperature, show_default=True,
                     help="Sampling temperature; 0 = greedy."),
        click.option("--seed", type=int, default=None, help="Seed for reproducible sampling."),
    )):
        command = decorator(command)
    return command


def _make_llm(ctx: click.Context):
    ctx.obj.require()  # a broken config file fails before torch is loaded
    from engine import LLM  # loads torch: only commands that run a model get here
    return LLM(**section_values(ctx, cfg.EngineConfig))


def _schema_grammar(path: Path | None) -> Grammar | None:
    if path is None:
        return None
    try:
        return Grammar.json_schema(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise click.BadParameter(f"{path} is not a readable JSON file: {e}", param_hint="--json-schema") from None


@main.command()
@click.option("--prompt", required=True, help="The prompt text.")
@sampling_options
@click.option("--json-schema", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Constrain the output to JSON that validates against the JSON schema in this file.")
@key_options(cfg.EngineConfig, visible=COMMON_ENGINE_FLAGS)
@click.pass_context
def generate(ctx: click.Context, prompt: str, max_tokens: int, temperature: float, seed: int | None,
             json_schema: Path | None, **_keys: Any) -> None:
    """Generate a completion of --prompt and print it."""
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                            grammar=_schema_grammar(json_schema))
    llm = _make_llm(ctx)
    try:
        click.echo(llm.generate([prompt], params)[0].text)
    finally:
        llm.close()     # saves the prefix cache where prefix_cache_dir keeps it


def in_terminal() -> bool:
    return sys.stdin.isatty() and sys.stdout.isatty()


@main.command()
@click.option("--url", default=None, help="Attach to a running `pagedserve serve` at this URL "
              "(e.g. http://127.0.0.1:8000) instead of loading a model in this process.")
@click.option("--api-key", default=None, envvar=ENV_PREFIX + "API_KEY", show_envvar=True,
              help="Key for --url (default: server.api_key from the config file).")
@click.option("--temperature", type=float, default=0.7, show_default=True,
              help="Sampling temperature of new sessions; 0 = greedy (each session can change it).")
@click.option("--max-tokens", type=int, default=512, show_default=True,
              help="Most tokens per reply in new sessions (each session can change it).")
@key_options(cfg.EngineConfig, visible=COMMON_ENGINE_FLAGS)
@click.pass_context
def chat(ctx: click.Context, url: str | None, api_key: str | None, temperature: float, max_tokens: int,
         **_keys: Any) -> None:
    """Open the chat console: sessions as tabs, a live monitor (F2), keys in [console.keys]."""
    config = ctx.obj.require()
    SamplingParams(temperature=temperature, max_tokens=max_tokens)  # bad values fail before the UI opens
    if not in_terminal():
        raise click.ClickException("`pagedserve chat` is an interactive console and needs a terminal; "
                                   "for scripts use `pagedserve generate --prompt TEXT` or the HTTP server")
    from console.app import ConsoleApp
    from console.client import HttpClient, InProcessClient
    from console.keys import keymap
    from console.sessions import SessionStore

    keys = keymap(config.console.keys)
    if url:
        client: Any = HttpClient(url, api_key if api_key is not None else config.server.api_key)
        what = url
    else:
        engine_config = cfg.EngineConfig(**section_values(ctx, cfg.EngineConfig))
        client, what = InProcessClient(engine_config), engine_config.model
    ConsoleApp(client, SessionStore(), what=what, keymap=keys, temperature=temperature,
               max_tokens=max_tokens).run()


@main.command()
@key_options(cfg.EngineConfig)
@key_options(cfg.ServerConfig)
@click.pass_context
def serve(ctx: click.Context, **_keys: Any) -> None:
    """Serve the model over an OpenAI-compatible HTTP API (loopback unless --host says otherwise).

    /health answers 503 while the model loads. SIGINT/SIGTERM/SIGHUP drain: queued requests get 503,
    running ones finish, then the server exits 0."""
    ctx.obj.require()  # a broken config file fails before torch is loaded
    engine_cfg = cfg.EngineConfig(**section_values(ctx, cfg.EngineConfig))
    server_cfg = cfg.ServerConfig(**section_values(ctx, cfg.ServerConfig))
    from server import serve as run_server
    ctx.exit(run_server(engine_cfg, server_cfg))


def _size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB"):
        if size < 1024:
            return f"{size:.0f} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


@main.command()
def models() -> None:
    """List the model presets (use a name as --model; `pagedserve pull NAME` downloads one)."""
    from engine.loading.presets import list_presets
    rows = [(p.name, _size(p.size_bytes), "yes" if p.pulled else "no", p.description) for p in list_presets()]
    width = max([len("NAME")] + [len(r[0]) for r in rows])
    click.echo(f"{'NAME':<{width}}  {'SIZE':>10}  PULLED  DESCRIPTION")
    for name, size, pulled, description in rows:
        click.echo(f"{name:<{width}}  {size:>10}  {pulled:<6}  {description}")


@main.command()
@click.argument("name")
def pull(name: str) -> None:
    """Download model preset NAME into the cache (resumes an interrupted download)."""
    from engine.loading import presets
    with contextlib.ExitStack() as stack:
        bar = None
        shown = 0

        def progress(done: int, total: int) -> None:
            nonlocal bar, shown
            if bar is None:  # the total is known only once the pull starts
                bar = stack.enter_context(click.progressbar(length=total, label=f"pulling {name}"))
            bar.update(done - shown)
            shown = done

        try:
            path = presets.pull(name, progress=progress)
        except presets.PullError as e:
            raise click.ClickException(str(e)) from None
    click.echo(f"{name}: {path}")
