"""The monitor screen: every request in the engine, cache and slot usage, prefix-cache hits,
speculative decoding's acceptance, rates and latencies.

It draws the snapshots it is handed (the app polls the client) and asks the app to cancel the
selected request with a message; it never talks to the engine itself."""
from __future__ import annotations

from collections import deque

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Label, ProgressBar, Sparkline

from console.client import EngineSnapshot
from console.keys import MONITOR_KEYS, bindings

COLUMNS = (("id", "ID"), ("client", "Client"), ("state", "State"), ("prompt", "Prompt"),
           ("generated", "Generated"), ("rate", "tok/s"), ("blocks", "Blocks"))
HISTORY = 60   # sparkline points (one per snapshot)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


def cache_line(snap: EngineSnapshot) -> str:
    """Prefix-cache hits, and speculative decoding's acceptance once it has verified anything."""
    line = f"prefix cache hit rate {snap.prefix_cache_hit_rate:.1%} · cached blocks {snap.cached_blocks}"
    if snap.spec_proposed_tokens_total:
        line += (f" · speculation {snap.spec_acceptance_rate:.1%} accepted, "
                 f"{snap.spec_mean_acceptance_length:.2f} tokens per verify row")
    return line


class MonitorScreen(Screen):
    BINDINGS = bindings(MONITOR_KEYS)
    DEFAULT_CSS = """
    MonitorScreen { layout: vertical; }
    MonitorScreen .gauges { height: 2; padding: 0 1; }
    MonitorScreen .gauges Label { width: 16; }
    MonitorScreen .gauges ProgressBar { width: 1fr; }
    MonitorScreen #counts, MonitorScreen #latency, MonitorScreen #cache { height: 1; padding: 0 1; }
    MonitorScreen Sparkline { height: 3; padding: 0 1; }
    MonitorScreen DataTable { height: 1fr; }
    """

    class CancelRequest(Message):
        def __init__(self, request_id: str):
            super().__init__()
            self.request_id = request_id

    def __init__(self) -> None:
        super().__init__(id="monitor")
        self.rates: deque[float] = deque([0.0] * HISTORY, maxlen=HISTORY)
        # A snapshot can arrive after the app pushed this screen but before its widgets exist: it
        # is kept and drawn on mount (querying the widgets then raised NoMatches and ended the app).
        self._mounted = False
        self._early: EngineSnapshot | None = None

    def compose(self) -> ComposeResult:
        with Vertical(classes="gauges"):
            with Horizontal():
                yield Label("K/V cache")
                yield ProgressBar(total=1, show_eta=False, id="kv")
            with Horizontal():
                yield Label("state slots")
                yield ProgressBar(total=1, show_eta=False, id="slots")
        yield Label("", id="counts")
        yield Label("", id="latency")
        yield Label("", id="cache")
        yield Sparkline(list(self.rates), id="rate")
        table = DataTable(cursor_type="row", zebra_stripes=True)
        for key, label in COLUMNS:
            table.add_column(label, key=key)
        yield table
        yield Footer()

    def on_mount(self) -> None:
        self._mounted = True
        self.show(self._early or EngineSnapshot())

    def show(self, snap: EngineSnapshot) -> None:
        if not self._mounted:
            self._early = snap
            return
        self.query_one("#kv", ProgressBar).update(total=max(snap.blocks_total, 1), progress=snap.blocks_used)
        self.query_one("#slots", ProgressBar).update(total=max(snap.slots_total, 1), progress=snap.slots_used)
        self.query_one("#counts", Label).update(
            f"running {snap.running} · waiting {snap.waiting} · paused {snap.paused} · "
            f"blocks {snap.blocks_used}/{snap.blocks_total} · slots {snap.slots_used}/{snap.slots_total} · "
            f"{snap.generation_tokens_per_s:.1f} tok/s")
        self.query_one("#latency", Label).update(
            f"TTFT p50 {_ms(snap.ttft_p50_s)} · ITL p50 {_ms(snap.itl_p50_s)} · ITL p99 {_ms(snap.itl_p99_s)}")
        self.query_one("#cache", Label).update(cache_line(snap))
        self.rates.append(snap.generation_tokens_per_s)
        self.query_one(Sparkline).data = list(self.rates)
        self._show_rows(snap)

    def _show_rows(self, snap: EngineSnapshot) -> None:
        table = self.query_one(DataTable)
        live = {r.id for r in snap.requests}
        for key in [k for k in table.rows if k.value not in live]:
            table.remove_row(key)
        for r in snap.requests:
            # Text, not str: DataTable reads a str as markup, and clients name themselves ("[/]")
            cells = {"id": Text(r.id), "client": Text(r.client or "-"), "state": r.state,
                     "prompt": r.prompt_tokens, "generated": r.generated_tokens,
                     "rate": f"{r.tokens_per_s:.1f}", "blocks": r.blocks}
            if r.id in table.rows:
                for key, value in cells.items():
                    table.update_cell(r.id, key, value)
            else:
                table.add_row(*cells.values(), key=r.id)

    def action_cancel_request(self) -> None:
        table = self.query_one(DataTable)
        if table.row_count:
            row_key, _ = table.coordinate_to_cell_key(table.cursor_coordinate)
            self.post_message(self.CancelRequest(str(row_key.value)))
