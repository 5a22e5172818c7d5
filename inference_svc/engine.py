"""The engine: one thread that owns the decoding core and runs every slot.

Handlers submit *jobs*. A job needs a slot: a generation, or a slot operation
(save, restore, erase) that runs once the slot is idle. Jobs wait in one FIFO
queue; an idle slot goes to the first job that can take it (a job for slot -1
takes the idle slot whose tokens share the longest prefix with its prompt,
then the least recently used). Each round of the loop runs one *unit* of every
active generation: a prompt chunk of at most `batch` tokens, or one
speculative step. So concurrent requests progress interleaved, and a
cancelled request stops within one unit, leaving in its slot what it
processed. `call` runs a function on the engine thread between units.
"""

from __future__ import annotations

import collections
import queue
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np

from inference_svc import log
from inference_svc.config import Config
from inference_svc.core import Context, Model, StreamDecoder, Tokenizer
from inference_svc.core.speculative import NO_SPEC, Counters, SpecDecoder
from inference_svc.errors import (
    Cancelled,
    DeadlineExceeded,
    ResourceExhausted,
    ServiceError,
    Unavailable,
)
from inference_svc.metrics import Metrics
from inference_svc.slotfile import ModelSpec
from inference_svc.snapshots import model_spec
from inference_svc.types import Chunk, Finished, GenerateParams, SlotInfo, StopReason, Timings

T = TypeVar("T")


def common_prefix(a: list[int] | tuple[int, ...], b: list[int] | tuple[int, ...]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64))
    return int(diff[0]) if diff.size else n


class StopText:
    """Text of a token stream with stop strings: text that may begin a stop string is
    held back until it cannot; a match cuts the text before the stop string."""

    def __init__(self, tokenizer: Tokenizer, stops: tuple[str, ...]) -> None:
        self._dec = StreamDecoder(tokenizer)
        self._stops = stops
        self._held = ""

    def push(self, token: int) -> tuple[str, str | None]:
        """(text to emit, the stop string matched or None)."""
        buf = self._held + self._dec.push(token)
        if not self._stops:
            return buf, None
        hit: tuple[int, str] | None = None
        for s in self._stops:
            i = buf.find(s)
            if i >= 0 and (hit is None or i < hit[0]):
                hit = (i, s)
        if hit is not None:
            self._held = ""
            return buf[:hit[0]], hit[1]
        hold = 0
        for s in self._stops:
            for k in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:k]):
                    hold = k
                    break
        self._held = buf[len(buf) - hold:] if hold else ""
        return buf[:len(buf) - hold], None

    def flush(self) -> str:
        out = self._held + self._dec.flush()
        self._held = ""
        return out


class Job:
    """Something that needs a slot, waiting in the queue until it gets one."""

    def __init__(self, id_slot: int, wait_until: float, rpc_deadline: float | None) -> None:
        self.id_slot = id_slot
        self.wait_until = wait_until
        self.rpc_deadline = rpc_deadline
        self.submitted = time.monotonic()
        self.slot = -1
        self._cancelled = threading.Event()
        self.on_cancel: Callable[[], None] | None = None  # wakes the engine up

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

    def wait_error(self, n_slots: int) -> ServiceError:
        if self.rpc_deadline is not None and time.monotonic() >= self.rpc_deadline:
            return DeadlineExceeded("the deadline passed while the request waited for a slot")
        waited = time.monotonic() - self.submitted
        which = (f"slot {self.id_slot} stayed" if self.id_slot >= 0
                 else f"all {n_slots} slots stayed")
        return ResourceExhausted(f"{which} busy for {waited:.1f} s: try again later")


class GenJob(Job):
    """A generation. Output goes to `out`: Chunk..., then Finished or an exception."""

    def __init__(self, params: GenerateParams, wait_until: float, rpc_deadline: float | None,
                 text: StopText | None) -> None:
        super().__init__(params.id_slot, wait_until, rpc_deadline)
        self.params = params
        self.out: queue.SimpleQueue[Chunk | Finished | BaseException] = queue.SimpleQueue()
        self.ended = threading.Event()  # set once the last item (Finished or an error) is out
        self.text = text  # None: no stop strings, the reader decodes the tokens
        self.todo: list[int] | None = None  # prompt tokens left to process; None: decoding
        self.emitted = 0
        self.timings = Timings(n_truncated=params.n_truncated)
        self.counters0 = Counters()
        self.t_start = self.t_first = 0.0

    def fail(self, exc: BaseException) -> None:
        self.out.put(exc)
        self.ended.set()


class SlotOp(Job, Generic[T]):
    """A function run on the engine thread with an idle slot (save, restore, erase)."""

    def __init__(self, id_slot: int, fn: Callable[[int], T], wait_until: float,
                 rpc_deadline: float | None) -> None:
        super().__init__(id_slot, wait_until, rpc_deadline)
        self.fn = fn
        self._done = threading.Event()
        self._result: T | None = None
        self._error: BaseException | None = None

    def run(self, slot: int) -> None:
        try:
            self._result = self.fn(slot)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting handler
            self._error = exc
        self._done.set()

    def fail(self, exc: BaseException) -> None:
        self._error = exc
        self._done.set()

    def result(self) -> T:
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]


@dataclass
class _Call:
    fn: Callable[[], Any]
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None


@dataclass
class _Slot:
    id: int
    job: Job | None = None
    tokens: list[int] = field(default_factory=list)  # as of the last time it was idle
    last_used: float = 0.0  # monotonic
    last_used_unix_ms: int = 0


class Engine:
    """Owns the models' contexts and the speculative decoder; see the module doc."""

    def __init__(self, cfg: Config, target: Model, draft: Model | None,
                 metrics: Metrics | None = None) -> None:
        self.cfg = cfg
        self.metrics = metrics or Metrics()
        self.log = log.get()
        self.target = target
        self.draft = draft
        self.n_slots = cfg.slots
        self.n_ctx = cfg.ctx or target.hparams.n_ctx_train
        self.tokenizer = target.tokenizer
        self.eos_id = self.tokenizer.eos_id
        # the KV caches are committed at start (reserve_kv): a machine that cannot hold
        # them fails here, and no prefill or restore pays the first touch of their pages
        self.tctx = Context(target, n_slots=cfg.slots, n_ctx=self.n_ctx, n_threads=cfg.threads,
                            n_batch=cfg.batch, reserve_kv=True, kv_type=cfg.kv_type)
        self.dctx: Context | None = None
        self.dec: SpecDecoder | None = None
        try:
            if draft is not None:
                self.dctx = Context(draft, n_slots=cfg.slots, n_ctx=self.n_ctx,
                                    n_threads=cfg.draft_threads, n_batch=cfg.batch,
                                    reserve_kv=True, kv_type=cfg.kv_type)
            self.dec = SpecDecoder(self.tctx, self.dctx)
        except BaseException:
            self._free()
            raise
        self.target_spec: ModelSpec = model_spec(self.tctx)
        self.draft_spec: ModelSpec | None = model_spec(self.dctx) if self.dctx else None
        rng = random.SystemRandom() if cfg.seed is None else random.Random(cfg.seed)
        for i in range(self.n_slots):
            self.dec.seed(i, rng.getrandbits(64))
        self._slots = [_Slot(i) for i in range(self.n_slots)]
        self._cond = threading.Condition()
        self._waiting: collections.deque[Job] = collections.deque()
        self._calls: list[_Call] = []
        self._active: list[GenJob] = []
        self._accepting = True
        self._closed = False
        self._cut_at: float | None = None  # drain: cut running generations at this time
        self._thread = threading.Thread(target=self._run, name="warmslot-engine", daemon=True)
        self._thread.start()

    @property
    def has_draft(self) -> bool:
        return self.dctx is not None

    # ---------------------------------------------------------------- handler side

    def _deadlines(self, time_remaining: float | None) -> tuple[float, float | None]:
        now = time.monotonic()
        wait = self.cfg.max_queue_wait
        rpc_deadline = None
        if time_remaining is not None:
            rpc_deadline = now + time_remaining
            wait = min(wait, time_remaining - min(0.1, 0.1 * time_remaining))
        return now + max(wait, 0.0), rpc_deadline

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _submit(self, job: Job) -> None:
        job.on_cancel = self._wake
        with self._cond:
            if not self._accepting:
                raise Unavailable("the server is shutting down")
            if len(self._waiting) >= self.cfg.max_queue:
                raise ResourceExhausted(f"{len(self._waiting)} requests are already waiting for "
                                        f"a slot: try again later")
            self._waiting.append(job)
            self.metrics.queue_depth.set(len(self._waiting))
            self._cond.notify_all()

    def generate(self, params: GenerateParams, time_remaining: float | None = None) -> GenJob:
        """Queues a generation; read its output from job.out, call job.cancel() to stop it."""
        wait_until, rpc_deadline = self._deadlines(time_remaining)
        job = GenJob(params, wait_until, rpc_deadline,
                     StopText(self.tokenizer, params.stop) if params.stop else None)
        self._submit(job)
        return job

    def slot_op(self, id_slot: int, fn: Callable[[int], T],
                time_remaining: float | None = None) -> T:
        """Runs fn(slot) on the engine thread once the slot is idle; returns its result."""
        wait_until, rpc_deadline = self._deadlines(time_remaining)
        job: SlotOp[T] = SlotOp(id_slot, fn, wait_until, rpc_deadline)
        self._submit(job)
        return job.result()

    def call(self, fn: Callable[[], T]) -> T:
        """Runs fn on the engine thread between units (no slot needed)."""
        c = _Call(fn)
        with self._cond:
            if self._closed:
                raise Unavailable("the engine is closed")
            self._calls.append(c)
            self._cond.notify_all()
        c.done.wait()
        if c.error is not None:
            raise c.error
        return c.result

    def n_running(self) -> int:
        """Generations running now (read without locking: a hint)."""
        return len(self._active)

    def list_slots(self) -> list[SlotInfo]:
        return self.call(self._slot_infos)

    def drain(self, grace: float) -> None:
        """Stops taking jobs, fails the waiting ones, and waits for the running ones at
        most `grace` seconds before cutting them at a unit boundary. The engine still
        runs `call`s afterwards (e.g. to save every slot) until close()."""
        with self._cond:
            self._accepting = False
            self._cut_at = time.monotonic() + grace
            for job in self._waiting:
                job.fail(Unavailable("the server is shutting down"))
            self._waiting.clear()
            self._cond.notify_all()
            while self._active and not self._closed:
                self._cond.wait(0.1)

    def close(self) -> None:
        """Stops the engine thread and frees the core."""
        with self._cond:
            self._accepting = False
            self._closed = True
            for job in self._waiting:
                job.fail(Unavailable("the server is shutting down"))
            self._waiting.clear()
            self._cond.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join()
        self._free()

    def _free(self) -> None:
        for obj in (self.dec, self.dctx, self.tctx):
            if obj is not None:
                obj.close()

    # ---------------------------------------------------------------- engine thread

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    admitted: list[Job] = []
                    if self._waiting:
                        self._sweep_locked()
                        admitted = self._admit_locked()
                    calls, self._calls = self._calls, []
                    if calls or admitted or self._active or self._closed:
                        break
                    now = time.monotonic()
                    wake = min((j.wait_until for j in self._waiting), default=None)
                    self._cond.wait(None if wake is None else max(wake - now, 0.0) + 0.001)
                if self._closed and not calls:
                    for job in list(self._active):
                        self._guarded(job, self._stop, Unavailable("the server is shutting down"))
                    return
            for c in calls:
                try:
                    c.result = c.fn()
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    c.error = exc
                c.done.set()
            for job in admitted:
                self._guarded(job, self._begin)
            cut = self._cut_at is not None and time.monotonic() >= self._cut_at
            batched = [] if cut else self._batched_steps()
            for job in list(self._active):
                if cut:
                    self._guarded(job, self._stop, Unavailable("the server is shutting down"))
                elif job not in batched:
                    self._guarded(job, self._unit)
            # every round: a generation that ended while others run changes the count too
            self.metrics.slots_busy.set(sum(s.job is not None for s in self._slots))
            self.metrics.queue_depth.set(len(self._waiting))
            if not self._active:
                with self._cond:
                    self._cond.notify_all()  # drain() waits for this

    def _guarded(self, job: Job, fn: Callable[..., None], *args: Any) -> None:
        """Runs fn(job, *args); a failure that escaped it fails the job and frees its slot
        (emptied), so the engine thread never dies and no handler waits forever."""
        try:
            fn(job, *args)
        except BaseException as exc:  # noqa: BLE001 - logged and handed to the request
            self.log.error("engine failure", exc_info=exc, extra=log.fields(slot=job.slot))
            if job in self._active:
                self._active.remove(job)  # type: ignore[arg-type]
            try:
                self.dec.clear(job.slot)
                self._release(job.slot)
            except BaseException:  # noqa: BLE001
                self._slots[job.slot].job = None
                self._slots[job.slot].tokens = []
            job.fail(exc)

    def _sweep_locked(self) -> None:
        now = time.monotonic()
        keep: collections.deque[Job] = collections.deque()
        for job in self._waiting:
            if job.cancelled:
                job.fail(Cancelled("cancelled while waiting for a slot"))
            elif now >= job.wait_until:
                job.fail(job.wait_error(self.n_slots))
            else:
                keep.append(job)
        self._waiting = keep
        self.metrics.queue_depth.set(len(keep))

    def _admit_locked(self) -> list[Job]:
        idle = {s.id for s in self._slots if s.job is None}
        out: list[Job] = []
        for job in list(self._waiting):
            if not idle:
                break
            if job.id_slot >= 0:
                if job.id_slot not in idle:
                    continue
                pick = job.id_slot
            else:
                pick = self._best_slot(job, idle)
            idle.discard(pick)
            self._waiting.remove(job)
            self._slots[pick].job = job
            job.slot = pick
            out.append(job)
        return out

    def _best_slot(self, job: Job, idle: set[int]) -> int:
        """The idle slot sharing the longest prefix with the prompt, then the LRU one."""
        prompt = job.params.prompt if isinstance(job, GenJob) and job.params.cache_prompt else ()

        def key(i: int) -> tuple[int, float]:
            s = self._slots[i]
            return (-common_prefix(s.tokens, prompt) if prompt else 0, s.last_used)

        return min(sorted(idle), key=key)

    def _release(self, slot: int) -> None:
        s = self._slots[slot]
        s.job = None
        s.tokens = self.dec.tokens(slot)
        s.last_used = time.monotonic()
        s.last_used_unix_ms = int(time.time() * 1000)

    def _slot_infos(self) -> list[SlotInfo]:
        dec = self.dec
        return [SlotInfo(i, dec.n_tokens(i), s.job is not None, dec.draft_n_tokens(i),
                         dec.draft_offset(i), dec.counters(i), s.last_used_unix_ms)
                for i, s in enumerate(self._slots)]

    def _begin(self, job: Job) -> None:
        slot = job.slot
        if isinstance(job, SlotOp):
            try:
                job.run(slot)
            finally:
                self._release(slot)
            return
        assert isinstance(job, GenJob)
        if job.cancelled:
            job.fail(Cancelled("cancelled"))
            self._release(slot)
            return
        try:
            p = job.params
            dec = self.dec
            job.t_start = time.monotonic()
            job.timings.queue_ms = 1e3 * (job.t_start - job.submitted)
            job.timings.id_slot = slot
            common = common_prefix(self._slots[slot].tokens, p.prompt) if p.cache_prompt else 0
            keep = min(common, len(p.prompt) - 1)
            dec.truncate(slot, keep)
            if p.seed is not None:
                dec.seed(slot, p.seed)
            job.timings.cache_n = keep
            job.timings.prompt_n = len(p.prompt) - keep
            job.counters0 = dec.counters(slot)
            job.todo = list(p.prompt[keep:])
        except Exception as exc:
            self._abort(job, exc)
            return
        self._active.append(job)

    def _batched_steps(self) -> list[GenJob]:
        """One forward pass for the target-only decode steps of every running request
        (a step each, as `_unit` would take them one by one); the jobs it served."""
        jobs = [j for j in self._active if isinstance(j, GenJob) and j.todo is None
                and j.params.spec is None and not j.cancelled]
        if len(jobs) < 2:
            return []
        try:
            toks = self.dec.step_multi([j.slot for j in jobs],
                                       [j.params.sampling for j in jobs])
        except Exception:  # noqa: BLE001 - e.g. a full slot: each job steps on its own
            return []
        for job, tok in zip(jobs, toks, strict=True):
            self._guarded(job, self._take, [tok])
        return jobs

    def _unit(self, job: GenJob) -> None:
        if job.cancelled:
            self._stop(job, Cancelled("cancelled"))
            return
        try:
            if job.todo is not None:
                self._prefill_unit(job)
            else:
                p = job.params
                toks = self.dec.step(job.slot, p.sampling, p.spec or NO_SPEC,
                                     max_new=p.max_tokens - job.emitted)
                self._take(job, toks)
        except Exception as exc:
            self._abort(job, exc)

    def _prefill_unit(self, job: GenJob) -> None:
        p, dec, slot = job.params, self.dec, job.slot
        todo = job.todo
        assert todo is not None
        batch = self.cfg.batch
        if len(todo) > batch and dec.n_tokens(slot) == self.tctx.n_tokens(slot):
            # a chunk of a long prompt: into the KV without sampling (no pending token)
            self.tctx.decode(slot, todo[:batch])
            if p.spec is not None:
                dec.draft_sync(slot)
            job.todo = todo[batch:]
            return
        first = dec.prefill(slot, todo, p.sampling, with_draft=p.spec is not None)
        job.todo = None
        job.t_first = time.monotonic()
        job.timings.prompt_ms = 1e3 * (job.t_first - job.t_start)
        if p.max_tokens == 0:
            dec.truncate(slot, dec.n_tokens(slot) - 1)  # drop the sampled token
            self._finish(job, StopReason.MAX_TOKENS)
        else:
            self._take(job, [first])

    def _take(self, job: GenJob, toks: list[int]) -> None:
        """Emits new tokens up to EOS, a stop string or max_tokens."""
        p, slot = job.params, job.slot
        out: list[int] = []
        text: list[str] = []
        reason: StopReason | None = None
        stop = ""
        for i, t in enumerate(toks):
            if t == self.eos_id:
                # S ends with toks: keep what precedes the EOS
                self.dec.truncate(slot, self.dec.n_tokens(slot) - (len(toks) - i))
                reason = StopReason.EOS
                break
            out.append(t)
            job.emitted += 1
            if job.text is None:
                matched = None
            else:
                piece, matched = job.text.push(t)
                text.append(piece)
            if matched is not None:
                self.dec.truncate(slot, self.dec.n_tokens(slot) - (len(toks) - i - 1))
                reason, stop = StopReason.STOP_STRING, matched
                break
            if job.emitted >= p.max_tokens:
                reason = StopReason.MAX_TOKENS
                break
        joined = "".join(text) if job.text is not None else None
        if reason is not None:
            self._finish(job, reason, stop, out, joined)
        elif out:
            job.out.put(Chunk(out, joined))

    def _close_out(self, job: GenJob) -> Timings:
        """Commits the pending token, releases the slot and completes the timings."""
        slot = job.slot
        self.dec.commit(slot)
        now = time.monotonic()
        tm = job.timings
        if job.t_first:
            tm.predicted_ms = 1e3 * (now - job.t_first)
        else:
            tm.prompt_ms = 1e3 * (now - job.t_start)
        tm.predicted_n = job.emitted
        tm.add_counters(self.dec.counters(slot) - job.counters0)
        if job in self._active:
            self._active.remove(job)
        self._release(slot)
        m = self.metrics
        m.tokens.labels("prompt").inc(tm.prompt_n)
        m.tokens.labels("cached").inc(tm.cache_n)
        m.tokens.labels("predicted").inc(tm.predicted_n)
        m.tokens.labels("drafted").inc(tm.draft_n)
        m.tokens.labels("accepted").inc(tm.draft_n_accepted)
        m.tokens.labels("draft_prefill").inc(tm.draft_prompt_n)
        if job.t_first:
            m.prompt_seconds.observe(tm.prompt_ms / 1e3)
            if tm.prompt_per_second:
                m.prompt_speed.observe(tm.prompt_per_second)
            if tm.predicted_per_second:
                m.decode_speed.observe(tm.predicted_per_second)
        return tm

    def _finish(self, job: GenJob, reason: StopReason, stop: str = "",
                tokens: list[int] | None = None, text: str | None = None) -> None:
        """Ends a generation: its last tokens and text go out with the timings."""
        if job.text is not None and reason is not StopReason.STOP_STRING:
            text = (text or "") + job.text.flush()
        tm = self._close_out(job)
        last = Chunk(tokens or [], text) if tokens or text else None
        job.out.put(Finished(reason, tm, stop, job.params.seed, last))
        job.ended.set()
        self.log.info("generate", extra=log.fields(
            slot=job.slot, stop_reason=reason.name.lower(), prompt_n=tm.prompt_n,
            cache_n=tm.cache_n, predicted_n=tm.predicted_n, prompt_ms=round(tm.prompt_ms, 2),
            predicted_ms=round(tm.predicted_ms, 2), draft_n=tm.draft_n,
            draft_n_accepted=tm.draft_n_accepted, draft_prompt_n=tm.draft_prompt_n))

    def _stop(self, job: GenJob, err: ServiceError) -> None:
        """Ends a generation early at a unit boundary; the slot keeps what was processed."""
        try:
            tm = self._close_out(job)
        except Exception as exc:
            self._abort(job, exc)
            return
        job.fail(err)
        self.log.info("generate stopped", extra=log.fields(
            slot=job.slot, reason=err.message, prompt_n=tm.prompt_n, predicted_n=tm.predicted_n))

    def _abort(self, job: GenJob, exc: BaseException) -> None:
        """A unit failed: the request gets the error, the slot is emptied."""
        self.log.warning("generate failed", exc_info=not isinstance(exc, ServiceError),
                         extra=log.fields(slot=job.slot, error=str(exc)))
        if job in self._active:
            self._active.remove(job)
        try:
            self.dec.clear(job.slot)
        finally:
            self._release(job.slot)
            job.fail(exc)
