"""The scheduler's side of prefix caching (engine/kv/prefix_cache.py). No torch here.

Full blocks are indexed as soon as their K/V is computed; an admitted request takes the longest
cached run of its blocks and starts after it. Hybrid models also need the recurrent state there: the
state at a request's last full-block boundary is copied into a spare slot (a checkpoint) after the
step that computed it, and a hit resumes from the latest checkpoint within the cached run. Slot
resets and copies are queued as StateOps for the next plan, which the engine runs before its rows.
"""
from __future__ import annotations

from engine.contracts import PlanRow, StateOp
from engine.kv.prefix_cache import BlockChain
from engine.kv.resources import KVResources
from engine.request import Request, RequestState


class PrefixReuse:
    """Which cached blocks (and checkpoint) a request starts from, and what it leaves behind. The
    caches it decides over belong to the resources (`kv`): blocks' to the allocator, checkpoints' to
    the slot allocator."""

    def __init__(self, block_size: int, kv: KVResources) -> None:
        self._ops: list[StateOp] = []
        self.block_size = block_size
        self.cache = kv.blocks.cache
        self.slots = kv.slots
        self.checkpoints = kv.slots.checkpoints
        self._chains: dict[str, BlockChain] = {}    # block hashes of live requests' tokens
        self._indexed: dict[str, int] = {}          # an admitted request's full blocks in the cache
        self.query_tokens = self.hit_tokens = self.checkpoint_hits = 0

    def lookup(self, req: Request) -> tuple[list[int], bytes | None]:
        """The cached blocks a request may start from, and (hybrid) the hash of the checkpoint its
        state resumes from. The last token is always fed, so there is something to sample."""
        if self.cache is None:
            return [], None
        # never the last token's block: it is fed (and with overlapped scheduling may not be known yet)
        tokens = req.all_token_ids
        hashes = self._chains.setdefault(req.id, self.cache.chain()).extend(tokens, len(tokens) - 1)
        hit = self.cache.lookup(tokens, hashes[:(len(tokens) - 1) // self.block_size])
        if self.checkpoints is None:
            return hit, None
        resume = self.checkpoints.latest(hashes, len(hit))    # K/V past the state would be rewritten
        return hit[:resume], hashes[resume - 1] if resume else None

    def computing(self, req: Request, hit: int, running: list[Request], least: int) -> bool:
        """Whether a request still prefilling shares `least` tokens or more of req's prompt and has yet
        to compute some past the `hit` blocks cached now: req then waits to take them from the cache
        rather than compute them alongside it (agents started at once with one long system prompt). Not
        for hybrid models, which resume only from checkpoints."""
        if self.cache is None or self.checkpoints is not None:
            return False
        mine = self._chains[req.id].hashes
        for other in running:
            if other.state is not RequestState.PREFILL:
                continue
            theirs = self._chains[other.id].hashes
            shared = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
            if shared * self.block_size >= least and shared > max(hit, other.num_computed_tokens // self.block_size):
                return True
        return False

    def admitted(self, req: Request, hit: list[int], restore: bytes | None, state_op: StateOp | None) -> None:
        """A request claimed its resources: count the hit (the request's own count, what its first
        admission found: a readmission after preemption finds its own blocks) and queue the op that
        readies its slot."""
        if state_op is not None:
            self._ops.append(state_op)
        self.checkpoint_hits += restore is not None
        if self.cache is not None:
            self._indexed[req.id] = len(hit)
            self.query_tokens += len(req.all_token_ids)
            self.hit_tokens += req.num_computed_tokens
            if req.num_cached_tokens is None:
                req.num_cached_tokens = req.num_computed_tokens

    def _checkpoint_due(self, req: Request) -> int:
        """The block boundary a later request with these tokens would resume from."""
        bs = self.block_size
        return (len(req.all_token_ids) - 1) // bs * bs

    def prefill_end(self, req: Request) -> int:
        """Where a prefill chunk may end: the end of the tokens, or (hybrid) a due checkpoint's
        boundary, so that the state there exists after the step (if a slot is there to keep it)."""
        due = self._checkpoint_due(req)
        if (self.checkpoints is not None and req.state_slot is not None and req.num_computed_tokens < due
                and self.slots.num_free
                and self._chains[req.id].hashes[due // self.block_size - 1] not in self.checkpoints):
            return due
        return len(req.all_token_ids)

    def remember(self, req: Request, row: PlanRow, cut: bool = False) -> None:
        """After a step: index the request's newly computed full blocks; (hybrid) checkpoint the
        state if the row ended on the due boundary (a sampling row ends on the last one). The engine
        rolls a verify row's state back to its accepted run (engine/state_rollback.py), so the
        state is at the computed positions unless a finish `cut` the run short: then none is taken."""
        if self.cache is None:
            return
        bs, done, tokens = self.block_size, req.num_computed_tokens, req.all_token_ids
        chain = self._chains[req.id]
        hashes = chain.extend(tokens, done)
        for i in range(self._indexed[req.id], done // bs):
            self.cache.insert(req.blocks[i].block_id, chain, i, tokens)
        self._indexed[req.id] = done // bs
        if (self.checkpoints is None or cut or done % bs
                or (not row.sample and done != self._checkpoint_due(req))
                or hashes[done // bs - 1] in self.checkpoints):
            return
        slot = self.slots.acquire()
        if slot is not None:
            self._ops.append(StateOp(slot, req.state_slot))
            self.slots.keep_as(slot, hashes[done // bs - 1])

    def take_ops(self) -> tuple[StateOp, ...]:
        """The slot operations queued since the last plan, in order."""
        ops, self._ops = tuple(self._ops), []
        return ops

    def released(self, req: Request) -> None:
        """The request gave back its blocks (finish or preemption): nothing more to index."""
        self._indexed.pop(req.id, None)

    def forget(self, req: Request) -> None:
        self._chains.pop(req.id, None)

    def stats(self) -> dict:
        """The prefix-cache fields of SchedulerStats."""
        return dict(
            slots_used=self.slots.num_used, prefix_cache_query_tokens=self.query_tokens,
            prefix_cache_hit_tokens=self.hit_tokens,
            prefix_cache_hit_rate=self.hit_tokens / self.query_tokens if self.query_tokens else 0.0,
            cached_blocks=0 if self.cache is None else self.cache.num_cached,
            cache_evictions_total=0 if self.cache is None else self.cache.evictions,
            checkpoints=len(self.checkpoints or ()), checkpoint_hits_total=self.checkpoint_hits,
            checkpoint_evictions_total=0 if self.checkpoints is None else self.checkpoints.evictions)
