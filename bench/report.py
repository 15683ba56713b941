"""The end-of-run table: each measurement next to the baselines measured in the same run.

A group holds one subject (ours) and its baselines (transformers, the roofline, the idle latency);
the ratio column is subject / baseline, so read it with the unit: tok/s above 1 is faster than the
baseline, ms above 1 is slower.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class Measurement:
    group: str          # what is compared, e.g. "decode b=8"
    name: str           # who was measured, e.g. "pagedserve", "transformers", "roofline"
    value: float
    unit: str
    subject: bool       # the row the group's baselines are compared against
    note: str = ""


@dataclass
class BenchReport:
    model: str
    machine: dict = field(default_factory=dict)
    rows: list[Measurement] = field(default_factory=list)

    def add(self, group: str, name: str, value: float, unit: str, *, subject: bool = False,
            note: str = "") -> None:
        self.rows.append(Measurement(group, name, float(value), unit, subject, note))

    def groups(self) -> dict[str, list[Measurement]]:
        out: dict[str, list[Measurement]] = {}
        for row in self.rows:
            out.setdefault(row.group, []).append(row)
        for rows in out.values():
            rows.sort(key=lambda r: not r.subject)       # subject first, baselines in run order
        return out

    def ratio(self, row: Measurement) -> float | None:
        subject = next((r for r in self.groups()[row.group] if r.subject), None)
        if subject is None or row.subject or not row.value or subject.unit != row.unit:
            return None
        return subject.value / row.value

    def table(self) -> str:
        head = ("group", "measured", "value", "unit", "ours / this", "note")
        lines = []
        for group, rows in self.groups().items():
            for i, row in enumerate(rows):
                ratio = self.ratio(row)
                lines.append((group if i == 0 else "", row.name, f"{row.value:,.2f}", row.unit,
                              "" if ratio is None else f"{ratio:.2f}x", row.note))
        widths = [max(len(r[c]) for r in [head, *lines]) for c in range(len(head))]
        fmt = "  ".join(f"{{:{'>' if c in (2, 4) else '<'}{w}}}" for c, w in enumerate(widths))
        out = [fmt.format(*head), fmt.format(*("-" * w for w in widths))]
        out += [fmt.format(*line) for line in lines]
        return "\n".join(s.rstrip() for s in out)

    def save_json(self, directory: Path) -> Path:
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"report-{time.strftime('%Y%m%d-%H%M%S')}.json"
        data = {"model": self.model, "machine": self.machine,
                "rows": [asdict(r) | {"ratio": self.ratio(r)} for r in self.rows]}
        path.write_text(json.dumps(data, indent=2))
        return path
