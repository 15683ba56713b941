"""The model-loading line: an indeterminate bar while the engine builds, a byte count while a
preset downloads, the error if loading failed."""
from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.widgets import Label, ProgressBar


class LoadingBar(Horizontal):
    DEFAULT_CSS = """
    LoadingBar { height: 1; padding: 0 1; }
    LoadingBar Label { width: auto; margin-right: 2; }
    LoadingBar.failed Label { color: $error; }
    LoadingBar.failed ProgressBar { display: none; }
    """

    def __init__(self, what: str):
        super().__init__(id="loading")
        self.what = what

    def compose(self) -> ComposeResult:
        yield Label(f"loading {self.what}")
        yield ProgressBar(total=None, show_eta=False)

    def downloading(self, done: int, total: int) -> None:
        bar = self.query_one(ProgressBar)
        if done >= total:   # what follows (conversion, loading) has no byte count
            self.query_one(Label).update(f"converting and loading {self.what}")
            bar.update(total=None)
            return
        self.query_one(Label).update(f"downloading {self.what}: {done / 2**20:,.1f} / {total / 2**20:,.1f} MiB")
        bar.update(total=max(total, 1), progress=done)

    def failed(self, error: str) -> None:
        self.add_class("failed")
        self.query_one(Label).update(f"could not load {self.what}: {error}")
