"""Build a ready engine from an EngineConfig: weights, tokenizer, K/V pool, runner, scheduler, loop."""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.config import ConfigError, EngineConfig
from engine.cuda_graphs import DecodeGraphs
from engine.draft import DraftModel, check_draft
from engine.grammar import GrammarCompiler
from engine.kv.snapshot import KVSnapshot, code_identity, weights_identity
from engine.kv.pool import (KVPool, KVShape, StatePool, check_kv_layout, plan_num_blocks, plan_num_state_slots,
                            resolve_kv_cache_dtype)
from engine.loading.checkpoint import open_checkpoint
from engine.loading.model_config import ModelConfig, parse_model_config
from engine.loading.rope_scaling import override_rope_scaling
from engine.loading.tokenizer import load_tokenizer
from engine.loop import EngineLoop
from engine.models.linear import LinearLoader
from engine.models.decoder import DecoderModel, build_decoder
from engine.ngram import NgramProposer
from engine.overlap_scheduler import OverlapScheduler
from engine.runner import ModelRunner, PrefillBudget
from engine.scheduler import Scheduler
from engine.speculation import DraftProposer, Speculator

log = logging.getLogger("pagedserve.engine")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def resolve_device(cfg: EngineConfig) -> torch.device:
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(['device = "cuda" but no CUDA device is visible; use "cpu" or "auto"'])
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(cfg.device)


def cpu_has_fast_bf16() -> bool:
    """bf16 GEMMs are fast only with AVX-512 BF16 or AMX; elsewhere oneDNN emulates them ~50x slower
    than fp32 (measured on an AVX2-only EPYC: 28 ms vs 0.6 ms for a 1x1024x3072 linear)."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def resolve_dtype(cfg: EngineConfig, device: torch.device) -> torch.dtype:
    if cfg.dtype == "auto":
        if device.type == "cpu" and not cpu_has_fast_bf16():
            return torch.float32
        return torch.bfloat16
    if cfg.dtype == "float16" and device.type == "cpu":
        raise ConfigError(['dtype = "float16" has no fast path on CPUs (~0.4 GFLOP/s); '
                           'use "bfloat16" (the default) or "float32"'])
    return DTYPES[cfg.dtype]


def resolve_quantization(cfg: EngineConfig, device: torch.device, key: str = "quantization") -> str:
    """The quantization mode this run can use for `key` (the target's or the draft's weights): the
    quantized-linear kernels run on CPUs only."""
    mode = getattr(cfg, key)
    if key == "draft_quantization" and mode == "auto":
        return "int4" if device.type == "cpu" else resolve_quantization(cfg, device)
    if device.type == "cpu" or mode == "none":
        return mode
    if mode == "auto":
        return "none"
    raise ConfigError([f'{key} = "{mode}" runs on CPUs only; on {device.type} use '
                       f'"none" or "auto" (which widens a GGUF to dtype there)'])


def resolve_max_model_len(cfg: EngineConfig, model_cfg: ModelConfig) -> int:
    limit = model_cfg.max_position_embeddings
    if cfg.max_model_len > limit:
        scale = -(-cfg.max_model_len // limit) if not model_cfg.rope_scaling else 0
        raise ConfigError([f"max_model_len = {cfg.max_model_len:,} is more than the model's "
                           f"max_position_embeddings ({limit:,}); use at most {limit:,}"
                           + (f", or serve more positions with --rope-scaling yarn --rope-scale {scale}"
                              if scale else "")])
    return cfg.max_model_len or limit


def resolve_speculative(cfg: EngineConfig, device: torch.device, model: DecoderModel) -> str:
    """speculative resolved: auto = ngram where a verify row cannot change a token and costs little (a CPU,
    an attention-only model without experts, every linear weight quantized: those kernels compute each
    row's tokens as decode steps do), else none. A hybrid's verify row replays its recurrent layers token
    by token, MoE experts stay dense, and overlap_scheduling = "on" needs each step's tokens left unread."""
    if cfg.speculative != "auto":
        return cfg.speculative
    exact = (device.type == "cpu" and model.state_shape is None and not model.cfg.num_experts
             and model.linears.all_quantized)
    return "ngram" if exact and cfg.overlap_scheduling != "on" else "none"


def build_speculator(method: str, cfg: EngineConfig) -> Speculator | None:
    if method == "none":
        return None
    proposer = DraftProposer() if method == "draft" else NgramProposer(cfg.ngram_min, cfg.ngram_max)
    return Speculator(proposer, cfg.num_speculative_tokens)


def resolve_overlap(cfg: EngineConfig, device: torch.device, speculative: str) -> bool:
    """overlap_scheduling resolved: auto = on GPUs, unless speculative decoding needs each step's tokens."""
    if cfg.overlap_scheduling == "auto":
        return device.type == "cuda" and speculative == "none"
    return cfg.overlap_scheduling == "on"


def _open(cfg: EngineConfig, name: str, dtype: torch.dtype, quantization: str, progress):
    """A model's path, open checkpoint (the caller closes it) and parsed config, with cfg's rope scaling."""
    from engine.loading.resolve import resolve_model

    path = resolve_model(name, dtype=str(dtype).removeprefix("torch."), progress=progress,
                         keep_quantized=quantization != "none")
    ckpt = open_checkpoint(path)
    model_cfg = parse_model_config(ckpt.config, source=os.path.join(str(path), "config.json"))
    scaling, positions = override_rope_scaling(model_cfg.rope_scaling, model_cfg.max_position_embeddings,
                                               cfg.rope_scaling, cfg.rope_scale)
    return path, ckpt, dataclasses.replace(model_cfg, rope_scaling=scaling, max_position_embeddings=positions)


def build_draft(cfg: EngineConfig, target: DecoderModel, dtype: torch.dtype, device: torch.device,
                max_len: int, progress) -> DecoderModel | None:
    """The draft model of speculative = "draft", loaded like the target but with its weights in
    `draft_quantization`; refused (ConfigError) when it cannot propose for the target."""
    if cfg.speculative != "draft":
        return None
    quantization = resolve_quantization(cfg, device, "draft_quantization")
    _, ckpt, model_cfg = _open(cfg, cfg.draft_model, dtype, quantization, progress)
    try:
        draft = build_decoder(model_cfg, ckpt, dtype, device,
                              LinearLoader(ckpt, dtype, device, quantization, cfg.quant_group_size))
    finally:
        ckpt.close()
    problems = check_draft(draft, target, max_len)
    if problems:
        raise ConfigError([f"draft_model = {cfg.draft_model!r}: {p}" for p in problems])
    return draft


@dataclass
class Engine:
    config: EngineConfig
    model_config: ModelConfig
    model_path: str
    tokenizer: object
    model: DecoderModel
    pool: KVPool
    runner: ModelRunner
    scheduler: Scheduler
    loop: EngineLoop
    dtype: torch.dtype
    device: torch.device
    max_model_len: int
    state_pool: StatePool | None = None
    sampling_defaults: dict = field(default_factory=dict)   # from generation_config.json
    draft: DraftModel | None = None         # speculative = "draft"
    snapshot: KVSnapshot | None = None      # prefix_cache_dir: the prefix cache kept across restarts
    speculative: str = "none"               # the method served (config speculative resolved)

    @property
    def weights(self) -> str:
        """The linear weights' formats, as the model's loader counted them."""
        return self.model.linears.describe()

    def close(self) -> None:
        """Stop the loop (what is live is cancelled), then save the prefix cache where it is kept,
        unless the file holds it already."""
        self.loop.stop()
        if self.snapshot is not None:
            self.snapshot.close()


def build_engine(cfg: EngineConfig, progress=None) -> Engine:
    """Loads on a thread of its own that has ended when this returns, so the caller's thread holds
    no OpenMP pool from the loading work: a loop stepping on another thread (EngineClient) would
    run ~25 % slower next to it (see EngineLoop.run). `progress` is called from that thread."""
    if cfg.threads:     # here: the caller's thread may step the engine (LLM) and has its own setting
        torch.set_num_threads(cfg.threads)
    built: dict = {}

    def load() -> None:
        try:
            built["engine"] = _build(cfg, progress)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread below
            built["error"] = exc

    # a daemon, so that Ctrl+C in the caller ends a long load at once
    loader = threading.Thread(target=load, name="pagedserve-build", daemon=True)
    loader.start()
    loader.join()
    if "error" in built:
        raise built["error"]
    return built["engine"]


def _build(cfg: EngineConfig, progress) -> Engine:
    device = resolve_device(cfg)
    dtype = resolve_dtype(cfg, device)
    quantization = resolve_quantization(cfg, device)
    path, ckpt, model_cfg = _open(cfg, cfg.model, dtype, quantization, progress)
    eos = tuple(dict.fromkeys(ckpt.generation_eos_ids() + model_cfg.eos_token_ids))
    sampling_defaults = ckpt.sampling_defaults()
    tokenizer = load_tokenizer(path)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
        eos += (tokenizer.eos_token_id,)
    max_len = resolve_max_model_len(cfg, model_cfg)
    kv_dtype = resolve_kv_cache_dtype(cfg.kv_cache_dtype, device, dtype)
    check_kv_layout(kv_dtype, model_cfg.head_dim, cfg.block_size)
    model = build_decoder(model_cfg, ckpt, dtype, device,
                          LinearLoader(ckpt, dtype, device, quantization, cfg.quant_group_size))
    state_shape = model.state_shape
    ckpt.close()
    speculative = resolve_speculative(cfg, device, model)
    draft = build_draft(cfg, model, dtype, device, max_len, progress)
    num_slots = plan_num_state_slots(cfg.max_concurrency, cfg.state_spare_slots) if state_shape else 0

    def kv_shape(m: DecoderModel) -> KVShape:
        return KVShape(m.num_kv_layers, m.cfg.num_kv_heads, m.cfg.head_dim, cfg.block_size, kv_dtype)

    shape, draft_shape = kv_shape(model), (kv_shape(draft) if draft else None)
    # a hybrid draft: a recurrent-state slot per row of the batch and as many scratch slots (engine/draft.py)
    draft_states = draft.state_shape if draft else None
    draft_slots = 2 * cfg.max_concurrency if draft_states else 0
    blocks = plan_num_blocks(shape, kv_pool_tokens=cfg.kv_pool_tokens,
                             max_concurrency=cfg.max_concurrency, max_model_len=max_len,
                             device=device, draft=draft_shape,
                             state_bytes=sum(s.bytes_per_slot * n for s, n in ((state_shape, num_slots),
                                                                              (draft_states, draft_slots)) if s))
    pool = KVPool(shape, blocks, device)
    budget = PrefillBudget.for_device(device, dtype)
    # the draft catches up on a backlog in chunks of an idle step's prefill
    draft_model = None if draft is None else DraftModel(
        draft, KVPool(draft_shape, blocks, device), budget.idle_total,
        StatePool(draft_states, draft_slots, device) if draft_states else None)
    state_pool = StatePool(state_shape, num_slots, device) if state_shape else None
    # MoE layers pick their experts on the host (ops/moe.py's torch body reads the counts), so their steps
    # can be neither captured in a CUDA graph nor traced as one graph
    whole_graph = device.type == "cuda" and not model_cfg.num_experts
    runner = ModelRunner(model, pool, max_rows=cfg.max_concurrency, max_model_len=max_len,
                         budget=budget, state_pool=state_pool,
                         compile=cfg.compile, fullgraph=whole_graph,
                         graphs=DecodeGraphs if whole_graph and cfg.cuda_graphs else None, draft=draft_model)
    scheduler = (OverlapScheduler if resolve_overlap(cfg, device, speculative) else Scheduler)(
        runner, max_waiting=cfg.max_waiting, prefix_cache=cfg.prefix_cache,
        speculator=build_speculator(speculative, cfg))
    loop = EngineLoop(scheduler, tokenizer, eos, max_lag_tokens=cfg.client_max_lag_tokens,
                      timeout_s=cfg.client_timeout_s,
                      grammars=GrammarCompiler(tokenizer.to_json(), model_cfg.vocab_size, eos))
    engine = Engine(cfg, model_cfg, str(path), tokenizer, model, pool, runner, scheduler, loop,
                    dtype, device, max_len, state_pool, sampling_defaults, draft_model, speculative=speculative)
    engine.snapshot = warm_restart(engine, quantization)
    return engine


def warm_restart(engine: Engine, quantization: str) -> KVSnapshot | None:
    """The prefix_cache_dir snapshot of this engine, its blocks already read back; None when the
    cache is not kept (no directory, prefix_cache off, a hybrid model: its hits need recurrent-state
    checkpoints, which are not saved)."""
    cfg = engine.config
    if not cfg.prefix_cache_dir:
        return None
    if not cfg.prefix_cache or engine.state_pool is not None:
        log.warning("prefix_cache_dir = %r is ignored: %s", cfg.prefix_cache_dir,
                    "prefix_cache is off" if not cfg.prefix_cache else
                    "the prefix cache of a hybrid model is not kept across restarts")
        return None
    try:        # a directory that cannot be made fails the start, not the save at the end
        os.makedirs(os.path.expanduser(cfg.prefix_cache_dir), exist_ok=True)
    except OSError as e:
        raise ConfigError([f"prefix_cache_dir = {cfg.prefix_cache_dir!r}: {e.strerror}; name a directory "
                           "this user can create and write"]) from None
    shape = engine.pool.shape
    fingerprint = {"weights": weights_identity(engine.model_path), "dtype": str(engine.dtype),
                   "quantization": quantization, "quant_group_size": cfg.quant_group_size,
                   "device": engine.device.type, "torch": torch.__version__,
                   "code": code_identity(Path(__file__).resolve().parents[1]),
                   "kv": [shape.num_layers, shape.kv_heads, shape.head_dim, shape.block_size, str(shape.dtype)],
                   "rope": engine.model_config.rope_params}
    snapshot = KVSnapshot(cfg.prefix_cache_dir, fingerprint, engine.scheduler.kv.blocks,
                          [t for kv in engine.pool.layers for t in kv], cfg.prefix_cache_save_interval_s)
    snapshot.load()
    engine.loop.on_idle = snapshot.save_when_idle
    return snapshot
