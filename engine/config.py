"""pagedserve's configuration: typed dataclasses, the one source of defaults, and their validation
(the TOML files they are read from and written to: engine/config_file.py).

No torch here: the CLI reads and validates configs without loading the engine. Validation collects
every problem (so `pagedserve config validate` can list them all) and each problem names the key, the
value and what is allowed.
"""
from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import tomlkit

from engine.errors import UserError

TABLES = ("server", "console")


class ConfigError(UserError, ValueError):
    """One or more configuration problems; `.problems` lists them, `.source` names the file (or None)."""

    def __init__(self, problems: list[str], source: str | None = None):
        self.problems = list(problems)
        self.source = source
        prefix = f"{source}: " if source else ""
        if len(self.problems) == 1:
            message = prefix + self.problems[0]
        else:
            message = f"{prefix}{len(self.problems)} problems:\n" + "\n".join(f"  {p}" for p in self.problems)
        super().__init__(message)


def _key(default: Any, allowed: str, check: Callable[[Any], bool], help: str, choices: tuple = ()) -> Any:
    """A config key: its default (whose type is the key's type), the check, and the words for both."""
    metadata = {"allowed": allowed, "check": check, "help": help, "choices": choices}
    if isinstance(default, dict):  # a mutable default must be a factory
        return field(default_factory=dict, metadata=metadata)
    return field(default=default, metadata=metadata)


def _choice(default: str, choices: tuple[str, ...], help: str) -> Any:
    allowed = "one of " + ", ".join(f'"{c}"' for c in choices)
    return _key(default, allowed, lambda v: v in choices, help, choices)


@dataclass(frozen=True)
class EngineConfig:
    model: str = _key("qwen2.5-coder-1.5b", "a non-empty string: a preset name, a checkpoint dir or a .gguf file",
                      bool, "the model to serve: a preset name (`pagedserve models`), a Hugging Face checkpoint dir or a .gguf file")
    dtype: str = _choice("auto", ("auto", "bfloat16", "float32", "float16"),
                         "weights and activations dtype; auto = bfloat16 on GPUs and on CPUs with fast bf16 (AVX-512 BF16, AMX), else float32")
    quantization: str = _choice("auto", ("auto", "none", "int8", "int4"),
                                "linear-layer weights on CPU; auto = as stored (a GGUF stays quantized), none = widen to dtype, int8/int4 = quantize at load")
    quant_group_size: int = _key(32, "a multiple of 32 between 32 and 4096", lambda v: 32 <= v <= 4096 and v % 32 == 0, "values per scale when quantization = int8/int4 quantizes a dense checkpoint at load")
    device: str = _choice("auto", ("auto", "cpu", "cuda"), "where to run; auto = cuda when a GPU is visible, else cpu")
    max_concurrency: int = _key(8, "an integer >= 1", lambda v: v >= 1, "most requests decoded at once (rows per step)")
    kv_pool_tokens: int = _key(0, "an integer >= 0 (0 = sized for max_concurrency)", lambda v: v >= 0,
                               "K/V cache size in tokens, all requests together; 0 = on CPUs max_concurrency "
                               "sequences of up to 8,192 tokens within half the free memory, on GPUs what "
                               "free memory holds")
    block_size: int = _key(16, "a power of two between 8 and 256", lambda v: 8 <= v <= 256 and v & (v - 1) == 0, "tokens per K/V cache block")
    max_model_len: int = _key(0, "an integer >= 0 (0 = the model's own limit)", lambda v: v >= 0, "longest prompt + output in tokens; 0 = the model's own limit")
    rope_scaling: str = _choice("auto", ("auto", "none", "linear", "yarn"),
                                "rotary position scaling, to serve more positions than the model was trained on: "
                                "auto = as its config.json or GGUF says; yarn / linear = its trained context "
                                "times rope_scale (yarn 4 takes Qwen2.5 from 32,768 to 131,072 positions); none = "
                                "plain rotary at the trained context. Applies to draft_model too")
    rope_scale: float = _key(0.0, "a number >= 1, or 0 (unset)", lambda v: v == 0 or v >= 1,
                             "how many times the trained context rope_scaling = yarn or linear serves")
    compile: bool = _key(False, "true or false", lambda v: True, "run the model under torch.compile")
    cuda_graphs: bool = _key(True, "true or false", lambda v: True,
                             "on GPUs, replay decode-only steps from CUDA graphs (one per batch-size bucket; "
                             "not for MoE models)")
    kv_cache_dtype: str = _choice("auto", ("auto", "model", "bf16", "fp16", "fp32", "q8_0", "q4_0"), "K/V cache storage; auto = bf16 on CPUs whatever dtype is (attention widens it as it reads), the model's dtype on GPUs; model = dtype; q8_0 / q4_0 = 8- / 4-bit blocks of 32 with an fp16 scale, K Hadamard-rotated (block_size a multiple of 16)")
    prefix_cache: bool = _key(True, "true or false", lambda v: True, "reuse K/V blocks of prompts seen before")
    prefix_cache_dir: str = _key("", "a directory path (empty = the cache is not kept)", lambda v: True,
                                 "keep the prefix cache across restarts: saved here when the engine stops, read back "
                                 "when it starts (one file per model and K/V layout; attention-only models)")
    prefix_cache_save_interval_s: float = _key(300.0, "a number >= 0 (seconds; 0 = only when the engine stops)",
                                               lambda v: v >= 0,
                                               "with prefix_cache_dir, also save while the engine is idle, at most this "
                                               "often and only when the cache gained blocks, so a crash loses at most "
                                               "this long of it; a request that comes stops the save until the next idle "
                                               "moment; 0 = only when the engine stops")
    speculative: str = _choice("auto", ("auto", "none", "ngram", "draft"), "speculative decoding, verified in the same step (greedy output is unchanged): "
                               "ngram = the tokens that followed an earlier occurrence of the latest ones (prompt lookup), draft = what draft_model proposes; "
                               "auto = ngram on CPUs for attention-only models whose linear weights are all quantized (the GGUF presets), else none")
    draft_model: str = _key("", "a preset name, a checkpoint dir or a .gguf file (empty = none)", lambda v: True,
                            "the model that proposes tokens for speculative = \"draft\" (setting it turns that on); it must share model's vocabulary")
    draft_quantization: str = _choice("auto", ("auto", "none", "int8", "int4"),
                                      "the draft model's linear weights; auto = int4 on CPUs (re-quantized at load: "
                                      "the draft only picks what is proposed, never what is output, and reads its "
                                      "weights once per proposal), as quantization on GPUs; none/int8/int4 as "
                                      "quantization takes them")
    num_speculative_tokens: int = _key(5, "an integer between 1 and 32", lambda v: 1 <= v <= 32, "most tokens proposed per request and step")
    ngram_min: int = _key(3, "an integer between 1 and 16", lambda v: 1 <= v <= 16, "shortest run of latest tokens the ngram proposer looks up")
    ngram_max: int = _key(4, "an integer between 1 and 16, >= ngram_min", lambda v: 1 <= v <= 16, "longest run looked up (tried first)")
    overlap_scheduling: str = _choice("auto", ("auto", "on", "off"), "plan each step while the one before runs, its drawn tokens left on the device; auto = on GPUs unless speculative decoding is on (it proposes from those tokens); on CPUs a step runs to its end before the next is planned either way")
    state_spare_slots: int = _key(4, "an integer >= 0", lambda v: v >= 0, "extra recurrent-state slots that hold prefix-cache checkpoints (hybrid models)")
    threads: int = _key(0, "an integer >= 0 (0 = all cores)", lambda v: v >= 0, "CPU threads for torch; 0 = all cores")
    max_waiting: int = _key(256, "an integer >= 1", lambda v: v >= 1, "most requests queued before the server answers 503")
    client_max_lag_tokens: int = _key(1024, "an integer >= 1", lambda v: v >= 1, "a consumer this many tokens behind pauses its own request")
    client_timeout_s: float = _key(60.0, "a number > 0 (seconds)", lambda v: v > 0, "a consumer stalled this many seconds is cancelled")

    def __post_init__(self) -> None:
        _validate_instance(self)
        if self.draft_model and self.speculative in ("none", "auto"):     # naming a draft model asks for it
            object.__setattr__(self, "speculative", "draft")
        problems = [f"ngram_min = {self.ngram_min} is more than ngram_max = {self.ngram_max}; raise ngram_max or "
                    "lower ngram_min"] if self.ngram_min > self.ngram_max else []
        if (self.speculative == "draft") != bool(self.draft_model):
            problems.append(f'speculative = "{self.speculative}" with draft_model = {self.draft_model!r}: "draft" '
                            'needs a draft_model (e.g. --draft-model qwen2.5-coder-0.5b) and a draft_model needs "draft"')
        if (self.rope_scaling in ("linear", "yarn")) != (self.rope_scale > 0):
            problems.append(f'rope_scaling = "{self.rope_scaling}" with rope_scale = {self.rope_scale:g}: "yarn" and '
                            '"linear" need rope_scale, how many times the trained context to serve (e.g. '
                            '--rope-scaling yarn --rope-scale 4), and rope_scale needs one of them')
        if self.overlap_scheduling == "on" and self.speculative not in ("none", "auto"):
            problems.append(f'overlap_scheduling = "on" with speculative = "{self.speculative}": speculation proposes '
                            'from the tokens overlap leaves unread; set one of them off')
        if problems:
            raise ConfigError(problems)

    def replace(self, **overrides: Any) -> EngineConfig:
        """A copy with `overrides` applied; unknown names and bad values raise ConfigError."""
        return _replace_checked(self, overrides)


@dataclass(frozen=True)
class ServerConfig:
    host: str = _key("127.0.0.1", "a non-empty host name or address", bool, "address the HTTP server listens on")
    port: int = _key(8000, "an integer between 1 and 65535", lambda v: 1 <= v <= 65535, "TCP port of the HTTP server")
    api_key: str = _key("", "a string (empty = no key)", lambda v: True,
                        "clients must send `Authorization: Bearer <api_key>`; empty = no authentication")
    max_body_bytes: int = _key(1048576, "an integer >= 1", lambda v: v >= 1, "largest request body accepted")
    admin_key: str = _key("", "a string (empty = loopback only)", lambda v: True,
                          "the operator's key for the request table (GET/DELETE /v1/requests), which "
                          "shows and cancels every client's requests; empty = it answers loopback only")
    served_model_name: tuple = _key((), "a list of non-empty names", lambda v: all(v),
                                    "names clients send as `model` and /v1/models lists (repeat the flag "
                                    "for aliases; one with * ? [...] is a pattern names may match, never "
                                    "listed); empty = the preset name, or the model file's or directory's "
                                    "name")
    tool_call_parser: str = _choice("auto", ("auto", "hermes", "qwen3_coder", "none"),
                                    "how tool calls are read from replies; auto = from the chat template "
                                    "(<function=...> = qwen3_coder, <tool_call> = hermes), none = as text")
    reasoning_parser: str = _choice("auto", ("auto", "qwen3", "none"),
                                    "how <think> blocks are split into reasoning_content; auto = qwen3 when "
                                    "the chat template has <think>, none = left in content")
    sse_keepalive_s: float = _key(1.0, "a number > 0 (seconds)", lambda v: v > 0,
                                  "a stream with nothing to send (queued, or in a long prefill) gets a "
                                  "`: keep-alive` comment this often")
    header_timeout_s: float = _key(10.0, "a number > 0 (seconds)", lambda v: v > 0,
                                   "a connection whose request headers are not all in after this many "
                                   "seconds is closed (slow senders hold connections otherwise)")
    request_timeout_s: float = _key(0.0, "a number >= 0 (seconds; 0 = no limit)", lambda v: v >= 0,
                                    "a request still generating after this many seconds stops and returns "
                                    "what it has (finish_reason length); 0 = no limit")
    responses_store: int = _key(256, "an integer >= 0 (0 = keep none)", lambda v: v >= 0,
                                "how many finished /v1/responses answers are kept in memory for "
                                "previous_response_id and GET /v1/responses/{id} (the oldest go first; "
                                "lost on restart); 0 = keep none")
    allowed_origins: tuple = _key((), 'a list of origins such as "http://localhost:3000", or "*"',
                                  lambda v: all(v), "web origins whose pages may call the API from a browser "
                                                    "(CORS; \"*\" = any); empty = none")

    def __post_init__(self) -> None:
        _validate_instance(self)


@dataclass(frozen=True)
class ConsoleConfig:
    keys: dict = _key({}, 'a table of binding id = key string, e.g. quit = "ctrl+q"', lambda v: True,
                      'key bindings: binding id = key string, e.g. quit = "ctrl+q"; unset ids keep their defaults')

    def __post_init__(self) -> None:
        _validate_instance(self)


@dataclass(frozen=True)
class Config:
    engine: EngineConfig = field(default_factory=EngineConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    console: ConsoleConfig = field(default_factory=ConsoleConfig)


TABLE_CLASSES: dict[str, type] = {"server": ServerConfig, "console": ConsoleConfig}


def default_of(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def toml_literal(value: Any) -> str:
    """`value` as it would be written in a TOML file (for messages and `config show`)."""
    if isinstance(value, Mapping):
        return "{ " + ", ".join(f"{k} = {toml_literal(v)}" for k, v in value.items()) + " }"
    try:
        return tomlkit.item(value).as_string()
    except (TypeError, ValueError):  # not a TOML value at all, e.g. None passed as a keyword
        return repr(value)


def unknown_key(name: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(name, candidates, n=1)
    if close:
        return f"unknown key '{name}'; did you mean '{close[0]}'?"
    return f"unknown key '{name}'; the keys are: {', '.join(candidates)}"


def _value_problems(f: dataclasses.Field, value: Any, name: str) -> list[str]:
    kind = type(default_of(f))
    if kind is float:  # TOML and callers write 60 for 60.0
        typed = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif kind is tuple:  # a list of strings (TOML arrays and click's repeated flags)
        typed = isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)
    else:  # bool is an int subclass: `max_concurrency = true` must not pass
        typed = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
    if kind is dict and typed:
        return [f'{name}.{k} = {toml_literal(v)}: must be a non-empty key string such as "ctrl+q"'
                for k, v in value.items() if not (isinstance(v, str) and v)]
    if typed and f.metadata["check"](value):
        return []
    return [f"{name} = {toml_literal(value)}: must be {f.metadata['allowed']}"]


def section_problems(cls: type, values: Mapping[str, Any], prefix: str = "", extra: tuple[str, ...] = ()) -> list[str]:
    """Every problem of `values` for the dataclass `cls`: unknown keys (with did-you-mean among the keys
    and `extra` names) and bad values. `prefix` ("server.") makes the messages name the dotted key."""
    names = [f.name for f in fields(cls)]
    candidates = [prefix + n for n in (*names, *extra)]
    problems = [unknown_key(prefix + k, candidates) for k in values if k not in names and k not in extra]
    for f in fields(cls):
        if f.name in values:
            problems += _value_problems(f, values[f.name], prefix + f.name)
    return problems


def _normalized(value: Any) -> Any:
    # tomlkit hands out str/int/dict subclasses; store plain values so configs compare and print plainly
    if isinstance(value, Mapping):
        return {str(k): _normalized(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return tuple(_normalized(v) for v in value)
    for kind in (bool, int, float, str):
        if isinstance(value, kind):
            return kind(value)
    return value


def _validate_instance(obj: Any) -> None:
    problems = section_problems(type(obj), {f.name: getattr(obj, f.name) for f in fields(obj)})
    if problems:
        raise ConfigError(problems)
    for f in fields(obj):
        value = getattr(obj, f.name)
        if type(default_of(f)) is float:
            value = float(value)
        object.__setattr__(obj, f.name, _normalized(value))


def _replace_checked(obj: Any, overrides: Mapping[str, Any]) -> Any:
    problems = section_problems(type(obj), overrides)
    if problems:
        raise ConfigError(problems)
    return dataclasses.replace(obj, **overrides)


def make_engine_config(**kwargs: Any) -> EngineConfig:
    """The engine config for `LLM(model=..., **kwargs)`: defaults with every given key applied."""
    return EngineConfig().replace(**kwargs)


def config_from_dict(data: Mapping[str, Any], source: str | None = None) -> Config:
    """Validate a parsed TOML document; raise one ConfigError listing every problem."""
    top = {k: v for k, v in data.items() if k not in TABLES}
    problems = section_problems(EngineConfig, top, extra=TABLES)
    tables = {}
    for table, cls in TABLE_CLASSES.items():
        values = data.get(table, {})
        if not isinstance(values, Mapping):
            problems.append(f"{table} = {toml_literal(values)}: must be a table ([{table}])")
            continue
        problems += section_problems(cls, values, prefix=f"{table}.")
        tables[table] = values
    if problems:
        raise ConfigError(problems, source)
    return Config(EngineConfig(**top), ServerConfig(**tables["server"]), ConsoleConfig(**tables["console"]))
