"""Prometheus metrics under `pagedserve:` with vLLM-like names.

Engine-wide numbers (running, waiting, K/V usage, token totals, preemptions, prefix cache, speculative
decoding) are read from the
scheduler's latest stats snapshot at scrape time; latencies and finish reasons are observed by the
server per request, as a client sees them.
"""
from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.stats import SchedulerStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class _SnapshotCollector:
    def __init__(self, snapshot: Callable[[], SchedulerStats | None]):
        self._snapshot = snapshot

    def collect(self):
        s = self._snapshot()
        if s is None:       # still loading: publish nothing rather than made-up zeros
            return
        gauges = {
            "num_requests_running": ("Requests admitted and decoding or prefilling.", s.running),
            "num_requests_waiting": ("Requests queued for admission.", s.waiting),
            "num_requests_paused": ("Requests paused because their client reads slowly.", s.paused),
            "kv_cache_usage_perc": ("Fraction of K/V cache blocks in use (1 = full).",
                                    s.blocks_used / s.blocks_total if s.blocks_total else 0.0),
            "prefix_cache_hit_rate": ("Fraction of looked-up prompt tokens served from the prefix "
                                      "cache (0 before the first lookup).", s.prefix_cache_hit_rate),
            "cached_blocks": ("K/V blocks indexed by the prefix cache (held or idle).", s.cached_blocks),
            "spec_decode_acceptance_rate": ("Fraction of proposed tokens accepted (0 before the first "
                                            "verify row).", s.spec_acceptance_rate),
            "spec_decode_mean_acceptance_length": ("Tokens a verify row produced on average: accepted "
                                                   "proposals plus one (0 before the first).",
                                                   s.spec_mean_acceptance_length),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(f"pagedserve:{name}", doc, value=value)
        counters = {
            "prompt_tokens": ("Prompt tokens computed (recomputation included).",
                              s.prompt_tokens_total),
            "generation_tokens": ("Tokens generated.", s.generation_tokens_total),
            "num_preemptions": ("Requests preempted to free K/V blocks.", s.preemptions_total),
            "prefix_cache_queries": ("Prompt tokens looked up in the prefix cache.",
                                     s.prefix_cache_query_tokens),
            "prefix_cache_hits": ("Prompt tokens served from the prefix cache.", s.prefix_cache_hit_tokens),
            "prefix_cache_evictions": ("Idle cached blocks reused for other tokens.",
                                       s.cache_evictions_total),
            "state_checkpoint_hits": ("Admissions of hybrid models that resumed from a recurrent-state "
                                      "checkpoint.", s.checkpoint_hits_total),
            "engine_steps": ("Engine steps run (one plan each).", s.steps_total),
            "spec_decode_num_draft_tokens": ("Proposed tokens verified (speculative decoding).",
                                             s.spec_proposed_tokens_total),
            "spec_decode_num_accepted_tokens": ("Proposed tokens accepted.", s.spec_accepted_tokens_total),
            "spec_decode_num_drafts": ("Verify rows run (decode rows that carried proposals).",
                                       s.spec_verify_rows_total),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(f"pagedserve:{name}", doc, value=value)


class ServerMetrics:
    def __init__(self, snapshot: Callable[[], SchedulerStats | None]):
        self.registry = CollectorRegistry()
        self.registry.register(_SnapshotCollector(snapshot))
        self.ttft = Histogram("pagedserve:time_to_first_token_seconds",
                              "From request arrival to its first token.",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("pagedserve:inter_token_latency_seconds",
                             "Time between consecutive tokens of one request.",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("pagedserve:e2e_request_latency_seconds",
                             "From request arrival to its last token.",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.finished = Counter("pagedserve:request_finished", "Finished requests by reason.",
                                ["finished_reason"], registry=self.registry)
        self.open_streams = Gauge("pagedserve:http_streams_open", "Streamed (SSE) answers being served.",
                                  registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)
