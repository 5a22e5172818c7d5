"""The scheduler: which job gets which slot, when, and which slots step together.

Jobs wait in one FIFO queue; an idle slot goes to the first job that can take it
(a job for slot -1 takes the idle slot whose tokens share the longest prefix with
its prompt, then the least recently used; slots bound to a session come last).

A job of a *session* (a named conversation, inference_svc.sessions.host) runs in the slot
its session is bound to; when the session is bound to none, it takes an idle slot
like a job for slot -1, preferring slots bound to no session, then the least
recently used, and a session that has a job waiting last. The scheduler binds the
slot and names the session it displaces in `job.evict`; the executor moves the
states. One session never runs in two slots: its later jobs wait, in order, while
one runs. A job without a session that lands on a session's slot displaces it too
(`keeps_session` jobs, which only read the slot, leave it bound). Each round runs one unit of every
running job through the executor: the decode steps (target-only and speculative)
share one forward pass, the others run one by one. A prompt or draft catch-up unit
takes at most `chunk` tokens; while other slots decode, it is sized from the
job's last unit of the same kind (a draft catch-up runs the draft model, a prompt
chunk the target) so that its tokens cost about CHUNK_SHARE of their decode step
on top of the pass it cannot avoid: a prompt chunk is a target pass, whose fixed
part (every weight read once) costs about a decode step whatever its token count,
so that part is not charged to its tokens; a catch-up pass of the small draft has
next to none. The first chunk of a kind is one token, and a chunk at most doubles
the last (at most `shared_chunk` tokens), so a decoding stream's next token waits
for one short unit at most, whatever the models and the context length. A cancelled
job stops at the next unit boundary; a draining scheduler cuts the running jobs
once its grace has passed.

The scheduler decides; the executor (the engine's model side) runs. Time comes
from an injected clock, so every decision can be tested without sleeping. It is
not thread-safe: the engine calls the queue methods (`submit`, `admit`,
`start_drain`, `close_queue`) under its lock, and `admit` (which reads the idle slots'
tokens from the executor) and `run_round` from its own thread.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from inference_svc.errors import (
    Cancelled,
    DeadlineExceeded,
    ResourceExhausted,
    ServiceError,
    Unavailable,
)

Clock = Callable[[], float]

# a chunk unit next to decoding slots aims at this fraction of their decode step
CHUNK_SHARE = 0.5
# tokens of a job's first chunk of a kind next to decoding slots, before its cost
# is known: one token, the shortest unit there is (a prompt continuing a long
# context costs about one decode step per token)
FIRST_SHARED_CHUNK = 1
# the kinds of chunk units (Job.chunk_kind)
PROMPT, CATCH_UP = "prompt", "catch-up"


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64))
    return int(diff[0]) if diff.size else n


class Job:
    """Something that needs a slot, waiting in the queue until it gets one.

    `running` is True from admission until the executor ends the job (finished,
    stopped or failed); the scheduler then frees the slot."""

    def __init__(self, id_slot: int, wait_until: float, rpc_deadline: float | None) -> None:
        self.id_slot = id_slot
        self.wait_until = wait_until
        self.rpc_deadline = rpc_deadline
        self.submitted = 0.0  # set by Scheduler.submit
        self.slot = -1
        self.running = False
        self._cancelled = threading.Event()
        self.on_cancel: Callable[[], None] | None = None  # wakes the engine up
        # (tokens, seconds) of its last chunk unit of each kind (chunk_kind)
        self.chunk_last: dict[str, tuple[int, float]] = {}
        self.session: str | None = None  # the session's key (its store name)
        self.session_name = ""  # as the caller named it (messages)
        self.keeps_session = False  # reads the slot only: its session stays bound
        self.evict: str | None = None  # set at admission: the session displaced
        self.resident = False  # set at admission: the session was bound to the slot
        self.prev_session: str | None = None  # bound to the slot before the admission

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        if not self._cancelled.is_set():
            self._cancelled.set()
            if self.on_cancel is not None:
                self.on_cancel()

    def fail(self, exc: BaseException) -> None:
        raise NotImplementedError

    def prefix_hint(self) -> Sequence[int]:
        """Tokens an idle slot should already hold for this job (slot choice)."""
        return ()

    def batchable(self) -> bool:
        """True when the job's next unit is a plain decode step that can share a
        forward pass with other such steps."""
        return False

    def chunk_kind(self) -> str:
        """What the job's next chunk unit runs (units of one kind share a speed):
        "prompt" (the target model) or "catch-up" (the draft model)."""
        return PROMPT

    def wait_error(self, now: float, n_slots: int) -> ServiceError:
        if self.rpc_deadline is not None and now >= self.rpc_deadline:
            return DeadlineExceeded("the deadline passed while the request waited for a slot")
        if self.session is not None:
            return ResourceExhausted(f"session {self.session_name!r}: no slot for its turn "
                                     f"within {now - self.submitted:.1f} s (another turn of "
                                     "it, or of other sessions, ran): try again later")
        which = (f"slot {self.id_slot} stayed" if self.id_slot >= 0
                 else f"all {n_slots} slots stayed")
        return ResourceExhausted(f"{which} busy for {now - self.submitted:.1f} s: "
                                 "try again later")


class Executor(Protocol):
    """Runs jobs on the decoding core. Each call is one bounded unit; a job the call
    ends gets `running = False` (and its output or error) from the executor."""

    def begin(self, job: Job) -> None:
        """Starts a job on its slot (a slot operation runs to completion here)."""

    def unit(self, job: Job, budget: int) -> int:
        """One unit of a running job: a prompt or draft catch-up chunk of at most
        `budget` tokens, or one decode step; the chunk's tokens (0: a decode step)."""

    def step_batch(self, jobs: list[Job]) -> bool:
        """One decode step for each job in one forward pass; False if it could not
        (nothing changed, the jobs step one by one)."""

    def stop(self, job: Job, err: ServiceError) -> None:
        """Ends a running job at a unit boundary, keeping what its slot processed."""

    def reset(self, slot: int) -> None:
        """Empties a slot after a failure."""

    def slot_tokens(self, slot: int) -> list[int]:
        """The tokens a slot holds."""


class _Slot:
    def __init__(self, i: int) -> None:
        self.id = i
        self.job: Job | None = None
        self.session: str | None = None  # the session bound to the slot
        self.last_used = 0.0  # clock
        self.last_used_unix_ms = 0


class Scheduler:
    def __init__(self, n_slots: int, max_queue: int, max_queue_wait: float, executor: Executor,
                 clock: Clock = time.monotonic, wall: Clock = time.time,
                 on_error: Callable[[Job, BaseException], None] | None = None,
                 chunk: int = 512, shared_chunk: int = 64) -> None:
        self.n_slots = n_slots
        self.chunk = chunk
        self.shared_chunk = min(shared_chunk, chunk)
        self.max_queue = max_queue
        self.max_queue_wait = max_queue_wait
        self.ex = executor
        self.clock = clock
        self.wall = wall
        self.on_error = on_error  # told of a failure that escaped the executor (logging)
        self.slots = [_Slot(i) for i in range(n_slots)]
        self.waiting: collections.deque[Job] = collections.deque()
        self.active: list[Job] = []
        self.accepting = True
        self.step_time: float | None = None  # seconds of the decode steps of a round (average)
        self.cut_at: float | None = None  # drain: cut running jobs at this time

    # ------------------------------------------------------------ queue (under the lock)

    def deadlines(self, time_remaining: float | None) -> tuple[float, float | None]:
        """(wait_until, rpc_deadline) of a job whose caller waits `time_remaining` s."""
        now = self.clock()
        wait = self.max_queue_wait
        rpc_deadline = None
        if time_remaining is not None:
            rpc_deadline = now + time_remaining
            wait = min(wait, time_remaining - min(0.1, 0.1 * time_remaining))
        return now + max(wait, 0.0), rpc_deadline

    def submit(self, job: Job) -> None:
        if not self.accepting:
            raise Unavailable("the server is shutting down")
        if len(self.waiting) >= self.max_queue:
            raise ResourceExhausted(f"{len(self.waiting)} requests are already waiting for "
                                    f"a slot: try again later")
        job.submitted = self.clock()
        self.waiting.append(job)

    def admit(self) -> list[Job]:
        """Fails the cancelled and expired waiting jobs, then gives idle slots to the
        first jobs that can take them, in queue order; the admitted jobs."""
        if not self.waiting:
            return []
        now = self.clock()
        keep: collections.deque[Job] = collections.deque()
        for job in self.waiting:
            if job.cancelled:
                job.fail(Cancelled("cancelled while waiting for a slot"))
            elif now >= job.wait_until:
                job.fail(job.wait_error(now, self.n_slots))
            else:
                keep.append(job)
        self.waiting = keep
        idle = {s.id for s in self.slots if s.job is None}
        # sessions with a job running or admitted: their later jobs wait
        held = {s.session for s in self.slots if s.job is not None and s.session}
        wanted = {j.session for j in self.waiting if j.session is not None}
        out: list[Job] = []
        for job in list(self.waiting):
            if not idle:
                break
            key = job.session
            if key is not None:
                if key in held:
                    continue
                home = self.home_of(key)
                pick = home if home is not None else self._best_slot(job, idle, wanted)
            elif job.id_slot >= 0:
                if job.id_slot not in idle:
                    continue
                pick = job.id_slot
            else:
                pick = self._best_slot(job, idle, wanted)
            idle.discard(pick)
            self.waiting.remove(job)
            s = self.slots[pick]
            s.job = job
            job.slot = pick
            if not job.keeps_session:
                job.prev_session = s.session
                job.resident = key is not None and s.session == key
                if s.session is not None and s.session != key:
                    job.evict = s.session
                s.session = key
            if key is not None:
                held.add(key)
            out.append(job)
        return out

    def unbind(self, slot: int) -> None:
        """The slot holds no session any more (it was emptied)."""
        self.slots[slot].session = None

    def home_of(self, session: str) -> int | None:
        """The slot the session is bound to, None when none is."""
        return next((s.id for s in self.slots if s.session == session), None)

    def _best_slot(self, job: Job, idle: set[int], wanted: set[str]) -> int:
        prompt = job.prefix_hint()

        def key(i: int) -> tuple[bool, bool, int, float]:
            s = self.slots[i]
            # the slot's tokens from the executor, their one source (the engine's
            # admission runs on its thread): no copy here to fall out of step when a
            # session moves out of a slot or a slot is erased or restored
            return (s.session in wanted, s.session is not None,
                    -common_prefix(self._tokens_of(i), prompt) if prompt else 0,
                    s.last_used)

        return min(sorted(idle), key=key)

    def _tokens_of(self, slot: int) -> list[int]:
        try:
            return self.ex.slot_tokens(slot)
        except Exception:  # noqa: BLE001 - a slot that cannot be read is matched as empty
            return []

    def wake_in(self) -> float | None:
        """Seconds until the first waiting job expires (None: nothing waits)."""
        wake = min((j.wait_until for j in self.waiting), default=None)
        return None if wake is None else max(wake - self.clock(), 0.0)

    def start_drain(self, grace: float) -> None:
        """Stops taking jobs, fails the waiting ones; running ones are cut once
        `grace` seconds have passed."""
        self.cut_at = self.clock() + grace
        self.close_queue()

    def close_queue(self) -> None:
        self.accepting = False
        for job in self.waiting:
            job.fail(Unavailable("the server is shutting down"))
        self.waiting.clear()

    # ------------------------------------------------------------ rounds (engine thread)

    def run_round(self, admitted: list[Job]) -> None:
        """Starts the admitted jobs, then one unit of every running job."""
        for job in admitted:
            if job.cancelled:
                job.fail(Cancelled("cancelled"))
                if not job.keeps_session:  # nothing moved: the slot keeps its session
                    self.slots[job.slot].session = job.prev_session
                self._release(job.slot)
                continue
            job.running = True
            self.active.append(job)
            self._guarded(job, self.ex.begin)
        if self.cut_at is not None and self.clock() >= self.cut_at:
            self.stop_all(Unavailable("the server is shutting down"))
            return
        for job in [j for j in self.active if j.cancelled]:
            self._guarded(job, self.ex.stop, Cancelled("cancelled"))
        batch = sorted((j for j in self.active if j.batchable()), key=lambda j: j.slot)
        others = [j for j in self.active if j not in batch]
        if batch:
            t0 = self.clock()
            if len(batch) < 2 or not self._batch(batch):
                for job in batch:
                    self._guarded(job, self.ex.unit, self.chunk)
            dt = self.clock() - t0
            self.step_time = dt if self.step_time is None else 0.5 * (self.step_time + dt)
        for job in others:
            self._chunk_unit(job, decoding=bool(batch))

    def _chunk_unit(self, job: Job, decoding: bool) -> None:
        """A prompt or catch-up unit; next to decoding slots, sized by _shared_budget."""
        kind = job.chunk_kind()
        budget = self._shared_budget(job, kind) if decoding else self.chunk
        t0 = self.clock()
        n = self._guarded(job, self.ex.unit, budget)
        dt = self.clock() - t0
        if isinstance(n, int) and n > 0:
            job.chunk_last[kind] = (n, dt)

    def _shared_budget(self, job: Job, kind: str) -> int:
        """Tokens of a chunk next to decoding slots: the cost per token of the job's
        last unit of this kind (its time less the pass's fixed part: a decode step
        for a target pass, none for the draft's) sets how many fit in CHUNK_SHARE of
        the decode step; one token while that is unknown, at most twice the last."""
        last = job.chunk_last.get(kind)
        if last is None or self.step_time is None:
            return FIRST_SHARED_CHUNK
        n, dt = last
        fixed = self.step_time if kind == PROMPT else 0.0
        per_token = (dt - fixed) / n
        room = CHUNK_SHARE * self.step_time
        fit = self.shared_chunk if per_token <= 0 else int(room / per_token)
        return max(1, min(fit, 2 * n, self.shared_chunk))

    def stop_all(self, err: ServiceError) -> None:
        for job in list(self.active):
            self._guarded(job, self.ex.stop, err)

    def n_busy(self) -> int:
        return sum(s.job is not None for s in self.slots)

    def _batch(self, jobs: list[Job]) -> bool:
        try:
            served = self.ex.step_batch(jobs)
        except BaseException as exc:  # noqa: BLE001 - a batch failure is every job's
            for job in jobs:
                if job.running:
                    self._failed(job, exc)
            return True
        for job in jobs:
            self._settle(job)
        return served

    def _guarded(self, job: Job, fn: Callable[..., object], *args: object) -> object:
        """Runs fn(job, *args); a failure that escaped the executor fails the job and
        empties its slot, so the engine never dies and no caller waits forever.
        fn's result, None when it failed."""
        try:
            out = fn(job, *args)
        except BaseException as exc:  # noqa: BLE001 - handed to the job
            self._failed(job, exc)
            return None
        self._settle(job)
        return out

    def _failed(self, job: Job, exc: BaseException) -> None:
        if self.on_error is not None:
            self.on_error(job, exc)
        job.running = False
        self.unbind(job.slot)  # emptied: nothing of the session is left there
        try:
            self.ex.reset(job.slot)
        except BaseException:  # noqa: BLE001 - the slot is freed anyway, as empty
            pass
        self._settle(job)
        job.fail(exc)

    def _settle(self, job: Job) -> None:
        """Frees the slot of a job the executor ended."""
        if job.running:
            return
        if job in self.active:
            self.active.remove(job)
        self._release(job.slot)

    def _release(self, slot: int) -> None:
        s = self.slots[slot]
        s.job = None
        s.last_used = self.clock()
        s.last_used_unix_ms = int(self.wall() * 1000)
