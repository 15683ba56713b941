"""The soak's figures (bench/soak.py): outcomes grouped into fixed time windows by when each job
started, TTFT/ITL p50/p99 per window from the timed streams, and the drift check between the first
and the last window."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from engine.stats import percentile
from soak_workload import Outcome

# The last window's p50 may be this much slower than the first window's before it counts as drift.
# p50 only: on a CPU shared with other work, p99s swing by more than that between quiet windows.
DRIFT_LIMIT = 1.5


@dataclass(frozen=True)
class Window:
    index: int
    start_s: float
    end_s: float
    jobs: int
    behaviours: Counter
    server_errors: int
    problems: int
    timed_streams: int
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    itl_p50_s: float | None
    itl_p99_s: float | None
    rss_bytes: int | None          # the server's RSS when the window closed


def windows(outcomes: list[Outcome], window_s: float, rss_at_ends: list[int]) -> list[Window]:
    count = max(1, len(rss_at_ends))
    groups: list[list[Outcome]] = [[] for _ in range(count)]
    for out in outcomes:
        groups[min(count - 1, int(out.job.at_s // window_s))].append(out)
    return [_window(i, group, window_s, rss_at_ends[i] if i < len(rss_at_ends) else None)
            for i, group in enumerate(groups)]


def _window(index: int, group: list[Outcome], window_s: float, rss: int | None) -> Window:
    traces = [o.trace for o in group if o.trace is not None and o.trace.arrivals and o.problem is None]
    ttfts = [t.arrivals[0][0] - t.submitted for t in traces]
    gaps = [g for t in traces for g in t.gaps()]
    return Window(index, index * window_s, (index + 1) * window_s, len(group),
                  Counter(o.job.behaviour for o in group),
                  sum(1 for o in group for s in o.statuses if s >= 500),
                  sum(1 for o in group if o.problem is not None), len(traces),
                  percentile(ttfts, 50), percentile(ttfts, 99), percentile(gaps, 50), percentile(gaps, 99), rss)


def table(rows: list[Window]) -> str:
    def ms(s: float | None) -> str:
        return "-" if s is None else f"{s * 1e3:.1f}"
    head = (f"{'window':>6} {'minutes':>11} {'jobs':>5} {'timed':>5} {'5xx':>4} {'problems':>8} "
            f"{'TTFT p50/p99 ms':>17} {'ITL p50/p99 ms':>15} {'RSS MiB':>8}")
    lines = [head]
    for w in rows:
        rss = "-" if w.rss_bytes is None else f"{w.rss_bytes / 2**20:.0f}"
        lines.append(f"{w.index:>6} {w.start_s / 60:>5.1f}-{w.end_s / 60:<5.1f} {w.jobs:>5} {w.timed_streams:>5} "
                     f"{w.server_errors:>4} {w.problems:>8} {ms(w.ttft_p50_s) + '/' + ms(w.ttft_p99_s):>17} "
                     f"{ms(w.itl_p50_s) + '/' + ms(w.itl_p99_s):>15} {rss:>8}")
    return "\n".join(lines)


def drift(rows: list[Window]) -> list[str]:
    """What drifted from the first window to the last (p50s beyond DRIFT_LIMIT); empty when nothing."""
    timed = [w for w in rows if w.timed_streams]
    if len(timed) < 2:
        return []
    first, last = timed[0], timed[-1]
    found = []
    for name, a, b in (("TTFT", first.ttft_p50_s, last.ttft_p50_s), ("ITL", first.itl_p50_s, last.itl_p50_s)):
        if a and b and b / a > DRIFT_LIMIT:
            found.append(f"{name} p50 {a * 1e3:.1f} -> {b * 1e3:.1f} ms ({b / a:.2f}x > {DRIFT_LIMIT}x)")
    return found


def problem_summary(outcomes: list[Outcome], limit: int = 10) -> list[str]:
    counts = Counter(f"{o.job.behaviour}/{o.job.route}{'/stream' if o.job.stream else ''}: {o.problem}"
                     for o in outcomes if o.problem is not None)
    return [f"{n}x {text}" for text, n in counts.most_common(limit)]
