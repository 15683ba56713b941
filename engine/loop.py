"""The engine loop (one thread owns the scheduler) and the client side: submit, stream, cancel.

Every request gets an output buffer. The loop appends to it and never waits for a reader; a reader
that falls `max_lag_tokens` behind pauses only its own request, one that reads nothing for
`timeout_s` while output waits is cancelled.
"""
from __future__ import annotations

import concurrent.futures
import itertools
import queue
import threading
import time
from collections.abc import Callable

from engine.detokenize import IncrementalDetokenizer
from engine.errors import EngineBusy
from engine.grammar import GrammarCompiler, GrammarError
from engine.output import Delta, RequestHandle
from engine.request import FinishReason, Request, RequestState, SamplingParams
from engine.scheduler import Scheduler
from engine.stats import SchedulerStats

# A burst of requests that reaches an idle engine over a few milliseconds (a server's handlers parse
# and tokenize one request after another) must be planned together: an idle step grants far more
# prefill than a step with decoders in it (engine/runner.py PrefillBudget), so a request that starts
# decoding alone leaves the rest of its burst to trickle in through the small mixed-step budget.
# So the idle loop, woken by a submission, steps only once no further submission came for
# ADMIT_WINDOW_S, and at the latest ADMIT_WINDOW_CAP_S after it woke: a lone request waits
# ADMIT_WINDOW_S, a steady stream cannot hold the engine back for longer than the cap (16 streamed
# HTTP requests took 11-20 ms to reach the loop on a 2-core CPU). A loop with live requests never
# waits.
ADMIT_WINDOW_S = 0.005
ADMIT_WINDOW_CAP_S = 0.050


class EngineLoop:
    """Owns the scheduler. `start()` runs it on a thread of its own, `run(until)` in the calling
    thread while others submit and read; `run_until_idle()` runs what is queued inline."""

    def __init__(self, scheduler: Scheduler, tokenizer, eos_token_ids: tuple[int, ...], *,
                 max_lag_tokens: int = 1024, timeout_s: float = 60.0,
                 grammars: GrammarCompiler | None = None):
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.grammars = grammars
        self.max_lag_tokens = max_lag_tokens
        self.timeout_s = timeout_s
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, RequestHandle] = {}    # admitted and not finished, by request id
        self._unfinished = 0                        # submitted, final delta not yet pushed
        self._count_lock = threading.Lock()
        self._ids = itertools.count()
        self._wakeup = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._stepper: int | None = None       # ident of the thread inside run(), if any
        # called by run() when nothing is live or queued, with a test for a submission that came
        # since, which should end it soon (the prefix cache's idle save)
        self.on_idle: Callable[[Callable[[], bool]], None] | None = None

    # -- client API (any thread)
    def submit(self, prompt_ids: list[int], params: SamplingParams, *, request_id: str | None = None,
               bounded: bool = True, client: str = "", after: str | None = None,
               timeout_s: float | None = None, group: str | None = None) -> RequestHandle:
        """Queue a request. A prompt that can never run (too long, empty) or a full queue raises
        RequestRejected / QueueFull here, a grammar that does not compile GrammarError (compiled
        here, in the caller's thread, unless cached); a later rejection arrives as a final error
        delta. `after`: the id of a request with the same prompt (an earlier choice of the same
        completion) whose prompt this one waits for, so as to reuse its cached K/V blocks.
        `timeout_s`: it stops with what it has (FinishReason.TIMEOUT) once it has run this long.
        `group`: an id shared by requests that `cancel(group)` stops together (a completion's
        choices); a request is in its own group by default."""
        rid = request_id or f"req-{next(self._ids)}"
        self.scheduler.check(rid, len(prompt_ids))
        matcher = None
        if params.grammar is not None:
            if self.grammars is None:
                raise GrammarError("this engine was built without a grammar compiler")
            matcher = self.grammars.matcher(params.grammar)
        now = time.monotonic()
        request = Request(id=rid, prompt_token_ids=tuple(prompt_ids), params=params,
                          eos_token_ids=self.eos_token_ids, client=client, matcher=matcher,
                          after=after, arrival_time=now)
        handle = RequestHandle(self, request, IncrementalDetokenizer(self.tokenizer, stop=params.stop),
                               bounded=bounded, group=group,
                               deadline=None if timeout_s is None else now + timeout_s)
        with self._count_lock:
            self._unfinished += 1
        self._commands.put(("submit", handle, None))
        self.wake()
        return handle

    def cancel(self, request_id: str | None) -> None:
        """Stop a request, or every request of a group, by id; None: every live request."""
        self._commands.put(("cancel", request_id, None))
        self.wake()

    def shed_waiting(self, error: str) -> None:
        """Cancel every request that has not started yet (still waiting for admission), with `error`
        in its final delta: a draining server's queued requests."""
        self._commands.put(("shed", error, None))
        self.wake()

    def is_live(self, request_id: str) -> bool:
        """An admitted request, or a group with one, not finished yet (any thread: the table is
        copied in one step under the GIL)."""
        return any(request_id in (h.id, h.group) for h in list(self._live.values()))

    @property
    def num_unfinished(self) -> int:
        """Requests submitted whose final delta is not in their buffer yet (any thread)."""
        return self._unfinished

    def stats(self, timeout_s: float = 10.0) -> SchedulerStats:
        """The scheduler's statistics, computed when asked (a step only bumps counters): by the
        stepping thread between two steps when one runs, so the snapshot is consistent. EngineBusy
        if no step ended within `timeout_s`."""
        if self._stepper is None or self._stepper == threading.get_ident():
            return self.scheduler.stats()
        reply: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("stats", reply, None))
        self.wake()
        try:
            return reply.result(timeout_s)
        except concurrent.futures.TimeoutError:
            raise EngineBusy(f"the engine is in a step that has run for over {timeout_s:g} s, and its statistics "
                             "are read between steps; try again") from None

    def wake(self) -> None:
        """Make an idle `run` look at its commands, readers and `until` again now."""
        self._wakeup.set()

    # -- loop side
    def _drain_commands(self) -> None:
        while True:
            try:
                kind, arg, handle = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "submit":
                self._admit(arg)
            elif kind == "stats":
                arg.set_result(self.scheduler.stats())
            elif kind == "cancel":
                for h in [h for h in self._live.values() if arg is None or arg in (h.id, h.group)]:
                    self._stop(h, FinishReason.CANCELLED)
            elif kind == "shed":
                for h in [h for h in self._live.values() if h.request.state is RequestState.WAITING]:
                    self._stop(h, FinishReason.CANCELLED, arg)

    def _admit(self, handle: RequestHandle) -> None:
        try:
            self.scheduler.add(handle.request)
        except ValueError as e:      # RequestRejected / QueueFull carry the numbers
            self._finish(handle, Delta(finish_reason=FinishReason.ERROR, error=str(e)))
            return
        self._live[handle.id] = handle

    def _stop(self, handle: RequestHandle, reason: FinishReason, error: str | None = None) -> None:
        """Retire a live request from above the scheduler (cancel, timeout, stalled reader)."""
        self.scheduler.finish(handle.id, reason)
        self._finish(handle, Delta(finish_reason=reason, error=error))

    def _finish(self, handle: RequestHandle, delta: Delta) -> None:
        self._live.pop(handle.id, None)
        delta.text += handle.detok.finish() if delta.finish_reason is not FinishReason.ERROR else ""
        delta.stop_sequence = handle.detok.stop_sequence
        delta.prompt_tokens = len(handle.request.prompt_token_ids)
        delta.completion_tokens = len(handle.request.output_token_ids)
        delta.cached_tokens = handle.request.num_cached_tokens or 0
        handle._push(delta)
        with self._count_lock:
            self._unfinished -= 1

    def _apply(self, events) -> None:
        for ev in events:
            live = self._live.get(ev.request_id)
            if live is None:
                continue
            request = live.request
            delta = Delta(prompt_tokens=len(request.prompt_token_ids), completion_tokens=ev.generated_tokens,
                          cached_tokens=request.num_cached_tokens or 0)
            if ev.token is not None:
                delta.token_ids.append(ev.token)
                delta.logprobs.append((ev.token, ev.logprob, ev.top_logprobs))
                delta.token_times.append(request.last_token_time)
                delta.text = live.detok.push([ev.token])
                if live.detok.stopped and ev.finished is None:   # tokens after it in a run are dropped
                    self.scheduler.finish(ev.request_id, FinishReason.STOP, tokens=ev.generated_tokens)
                    delta.finish_reason = FinishReason.STOP
            if ev.finished is not None or ev.error is not None:
                delta.finish_reason = ev.finished or FinishReason.ERROR
                delta.error = ev.error
            if delta.finish_reason is not None:
                self._finish(live, delta)
            else:
                live._push(delta)

    def _police_readers(self) -> None:
        now = time.monotonic()
        for h in list(self._live.values()):
            if h.deadline is not None and now > h.deadline:
                self._stop(h, FinishReason.TIMEOUT)
                continue
            if not h.bounded:
                continue
            paused = h.request.pause_requested
            if h.lag and now - h.last_read > self.timeout_s:
                self._stop(h, FinishReason.CANCELLED, f"reader stalled for over {self.timeout_s:g} s")
            elif not paused and h.lag > self.max_lag_tokens:
                self.scheduler.pause(h.id)
            elif paused and h.lag <= self.max_lag_tokens // 2:
                self.scheduler.resume(h.id)

    def run_once(self) -> bool:
        """One iteration: commands, one engine step, outputs. Returns whether anything moved."""
        self._drain_commands()
        self._police_readers()
        if not self.scheduler.has_work:
            return False
        events = self.scheduler.step()
        self._apply(events)
        # only paused requests left: nothing ran, so the thread should wait for a reader
        return bool(events) or self.scheduler.num_active > 0 or self.scheduler.in_flight

    def run_until_idle(self) -> None:
        while self.run_once() or not self._commands.empty():
            pass

    def start(self) -> None:
        self._stopping.clear()
        self._thread = threading.Thread(target=self.run, args=(self._stopping,),
                                        name="pagedserve-engine", daemon=True)
        self._thread.start()

    def run(self, until: threading.Event) -> None:
        """Step in the calling thread until `until` is set (then `wake()`); `start()` runs this on a
        thread of its own. Whichever thread steps should be the only live thread in the process
        that has run torch ops on several cores: each such thread keeps an OpenMP pool, and with a
        second pool alive every decode step was ~25 % slower on a 2-core CPU (0.6B, fp32: ~95 ms a
        step alone, 120-130 ms with a pool left on the main thread; likely libgomp's shorter spin
        once it manages more threads than there are CPUs)."""
        self._stepper = threading.get_ident()
        try:
            self._run(until)
        finally:
            self._stepper = None
            self._drain_commands()

    def _run(self, until: threading.Event) -> None:
        while not until.is_set():
            if not self._live and not self._commands.empty():
                self._gather_burst(until)
            if not self.run_once():
                if self.on_idle is not None and not self._live and not self._unfinished:
                    self.on_idle(lambda: self._unfinished > 0)
                # idle: sleep until a command arrives or a reader drains (paused requests resume)
                self._wakeup.wait(timeout=0.05 if self._live else 1.0)
                self._wakeup.clear()

    def _gather_burst(self, until: threading.Event) -> None:
        """Idle loop, commands waiting: wait for the rest of a burst (see ADMIT_WINDOW_S)."""
        woke = time.monotonic()
        quiet_until, queued = woke + ADMIT_WINDOW_S, self._commands.qsize()
        while not until.is_set():
            remaining = min(quiet_until, woke + ADMIT_WINDOW_CAP_S) - time.monotonic()
            if remaining <= 0:
                return
            self._wakeup.wait(remaining)
            self._wakeup.clear()
            # only a new command restarts the quiet period; a reader's wake-up does not
            if (now_queued := self._commands.qsize()) > queued:
                quiet_until, queued = time.monotonic() + ADMIT_WINDOW_S, now_queued

    def stop(self) -> None:
        """Cancel what is live and stop the thread; the scheduler ends with nothing in use."""
        self.cancel(None)
        if self._thread is None:
            self._drain_commands()
            return
        self._stopping.set()
        self.wake()
        self._thread.join(timeout=30)
        self._thread = None
