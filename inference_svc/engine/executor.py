"""The engine: one thread that owns the decoding core and runs every slot.

Handlers submit *jobs*: a generation, or a slot operation (save, restore,
erase) that runs once the slot is idle. The scheduler (inference_svc.engine.scheduler)
decides which job gets which slot and when; the engine is its executor: each
round it runs one *unit* of every active generation, a prompt or draft catch-up
chunk (at most `batch` tokens, `batch_shared` while other slots decode) or one
decode step, the decode steps of all slots (speculative or not) in one target
pass, so concurrent requests progress
interleaved and a cancelled request stops within one unit, leaving in its slot
what it processed. `call` runs a function on the engine thread between units.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from inference_svc import log
from inference_svc.config import Config
from inference_svc.core.params import NO_SPEC, Counters, Drafter, SpecParams, TokenLogprob
from inference_svc.engine.draft_length import DraftLengths
from inference_svc.engine.scheduler import CATCH_UP, PROMPT, Job, Scheduler, common_prefix
from inference_svc.errors import FailedPrecondition, InvalidArgument, ServiceError, Unavailable
from inference_svc.metrics import Metrics
from inference_svc.types import Chunk, Finished, GenerateParams, SlotInfo, StopReason, Timings

if TYPE_CHECKING:
    from inference_svc.chat import Message
    from inference_svc.core import Tokenizer
    from inference_svc.engine.slot_owner import SlotOwner

T = TypeVar("T")

# the acceptance a request's draft-length controller assumes before its first step
START_ACCEPTANCE = 0.5


class StopText:
    """Text of a token stream with stop strings: text that may begin a stop string is
    held back until it cannot; a match cuts the text before the stop string."""

    def __init__(self, tokenizer: Tokenizer, stops: tuple[str, ...]) -> None:
        from inference_svc.core import StreamDecoder

        self._stream = StreamDecoder(tokenizer)
        self._stops = stops
        self._held = ""

    def push(self, token: int) -> tuple[str, str | None]:
        """(text to emit, the stop string matched or None)."""
        buf = self._held + self._stream.push(token)
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
        out = self._held + self._stream.flush()
        self._held = ""
        return out


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
        self.draft_lag = 0  # the draft's lag behind the target's KV still to catch up
        self.draft_len: DraftLengths | None = None  # None: every step drafts spec's lengths
        self.emitted = 0
        self.timings = Timings(n_truncated=params.n_truncated)
        self.counters0 = Counters()
        self.t_start = self.t_first = 0.0
        self.on_fail: Callable[[GenJob], None] | None = None  # ends a session reservation
        # told the whole reply's text when the generation ends (a session's Chat keeps
        # it); while set, the reply is collected
        self.on_finish: Callable[[GenJob, str], None] | None = None
        self.reply_tokens: list[int] = []
        self.reply_text: list[str] = []  # with stop strings: the text sent

    def fail(self, exc: BaseException) -> None:
        self.running = False
        if self.on_fail is not None:
            self.on_fail(self)
        self.out.put(exc)
        self.ended.set()

    def collect(self, timeout: float) -> tuple[list[int], Timings]:
        """Reads the whole output (for callers that do not stream it): every token and
        the timings; raises the job's error. Each read waits at most `timeout` s."""
        toks: list[int] = []
        while True:
            item = self.out.get(timeout=timeout)
            if isinstance(item, BaseException):
                raise item
            chunk = item.last if isinstance(item, Finished) else item
            if isinstance(chunk, Chunk):
                toks += chunk.tokens
            if isinstance(item, Finished):
                return toks, item.timings

    def prefix_hint(self) -> Sequence[int]:
        # a session's prompt continues the session: it is no prefix of any slot
        return self.params.prompt if self.params.cache_prompt and not self.session else ()

    def batchable(self) -> bool:
        # decode steps, speculative or not, share a target pass (step_batch)
        return self.todo is None and not self.cancelled

    def chunk_kind(self) -> str:
        # a speculative request's draft decodes its lag (-1: not known yet) first
        return CATCH_UP if self.params.spec is not None and self.draft_lag else PROMPT

    def step_spec(self) -> SpecParams:
        """The speculative parameters of the next step."""
        spec = self.params.spec
        if spec is None:
            return NO_SPEC
        if self.draft_len is None:
            return spec
        n, lookup_k, n_head = self.draft_len.next()
        return SpecParams(n_max=n, n_min=min(spec.n_min, max(n, n_head)), p_min=spec.p_min,
                          lookup_k=lookup_k, head_n_max=n_head)


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
        self.running = False
        self._error = exc
        self._done.set()

    def result(self) -> T:
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]


class ReplacedTurn(Protocol):
    """The session turn a request sent again replaces (sessions.turn_mark.TurnMark)."""

    @property
    def start(self) -> int:
        """The session's tokens before that turn."""


class SessionHooks(Protocol):
    """What the engine asks of the sessions layer at a turn's edges (implemented by
    inference_svc.sessions.host.SessionHost; the engine imports no sessions)."""

    ack_stored: bool  # a turn's last message waits until its end state is stored

    def prepare(self, job: GenJob, name: str, deadline: float | None) -> None:
        """Names and reserves the job's session before it queues (request thread)."""

    def release(self, job: Job) -> None:
        """Ends a failed job's reservation of its session."""

    def enter(self, job: Job) -> None:
        """At the job's start (engine thread): moves the displaced session out of the
        slot and the job's own session in."""

    def continues(self, key: str, history: tuple[Message, ...],
                  replaces: ReplacedTurn | None = None) -> bool:
        """Whether session `key` still keeps the conversation a Chat was rendered after
        (before the turn it replaces)."""

    def turn_start(self, key: str, turn_id: str,
                   prompt: Sequence[int]) -> ReplacedTurn | None:
        """At a session turn's start: the mark of the turn it replaces (its id is the
        session's last turn's), or None; FailedPrecondition for that id with another
        prompt."""

    def mark_turn(self, key: str, turn_id: str, n_tokens: int,
                  replaces: ReplacedTurn | None, prompt: Sequence[int]) -> None:
        """Once a session turn is admitted: marks it as starting from `n_tokens`
        tokens, the turn it replaces dropped."""

    def after_turn(self, slot: int, key: str, then: Callable[[], None] | None) -> bool:
        """At the end of a session's turn (engine thread): its state for write-through;
        True when `then` will be called once it is stored."""


@dataclass
class _Call:
    fn: Callable[[], Any]
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None



class Engine:
    """Runs the scheduler's rounds on its thread: it is the scheduler's executor, and
    changes the slots only through their owner (inference_svc.engine.slot_owner)."""

    def __init__(self, cfg: Config, owner: SlotOwner, metrics: Metrics | None = None) -> None:
        """Takes `owner` over: close() closes it."""
        self.cfg = cfg
        self.metrics = metrics or Metrics()
        self.log = log.get()
        self.owner = owner
        self.n_slots = owner.n_slots
        self.n_ctx = owner.n_ctx
        self.tokenizer = owner.tokenizer
        self.eos_id = owner.eos_id
        try:
            self.sched = Scheduler(cfg.slots, cfg.max_queue, cfg.max_queue_wait, self,
                                   on_error=self._log_failure, chunk=cfg.batch,
                                   shared_chunk=cfg.batch_shared)
        except BaseException:
            owner.close()
            raise
        self._cond = threading.Condition()
        self._calls: list[_Call] = []
        self._closed = False
        self.sessions: SessionHooks | None = None  # set by the server once the store is open
        self._thread = threading.Thread(target=self._run, name="warmslot-engine", daemon=True)
        self._thread.start()
        owner.own(self._thread)


    # ---------------------------------------------------------------- handler side

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _submit(self, job: Job) -> None:
        job.on_cancel = self._wake
        with self._cond:
            self.sched.submit(job)
            self.metrics.queue_depth.set(len(self.sched.waiting))
            self._cond.notify_all()

    def generate(self, params: GenerateParams, time_remaining: float | None = None) -> GenJob:
        """Queues a generation; read its output from job.out, call job.cancel() to stop it."""
        with self._cond:
            wait_until, rpc_deadline = self.sched.deadlines(time_remaining)
        job = GenJob(params, wait_until, rpc_deadline,
                     StopText(self.tokenizer, params.stop) if params.stop else None)
        if params.session is not None:
            if self.sessions is None:
                raise Unavailable("sessions are not available yet")
            job.on_fail = self.sessions.release
            self.sessions.prepare(job, params.session, wait_until - self.sched.clock()
                                  + time.monotonic())
        try:
            self._submit(job)
        except BaseException:
            if self.sessions is not None:
                self.sessions.release(job)
            raise
        return job

    def slot_op(self, id_slot: int, fn: Callable[[int], T],
                time_remaining: float | None = None, keep_session: bool = False) -> T:
        """Runs fn(slot) on the engine thread once the slot is idle; returns its result.
        A session bound to the slot is moved to the RAM tier first, unless
        `keep_session` (fn only reads the slot)."""
        with self._cond:
            wait_until, rpc_deadline = self.sched.deadlines(time_remaining)
        job: SlotOp[T] = SlotOp(id_slot, fn, wait_until, rpc_deadline)
        job.keeps_session = keep_session
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
        return len(self.sched.active)

    def list_slots(self) -> list[SlotInfo]:
        return self.call(self._slot_infos)

    # ---------------------------------------------------------------- sessions' slots

    def session_resident(self, key: str) -> bool:
        with self._cond:
            return self.sched.home_of(key) is not None

    def resident_keys(self) -> set[str]:
        """The sessions bound to slots (read without locking: a hint)."""
        return {s.session for s in self.sched.slots if s.session is not None}

    def resident_sessions(self) -> list[tuple[str, int, int, bool, int]]:
        """(session, tokens, slot, busy, last used unix ms) of every bound slot."""
        def rows() -> list[tuple[str, int, int, bool, int]]:
            with self._cond:
                bound = [(s.session, s.id, s.job is not None, s.last_used_unix_ms)
                         for s in self.sched.slots if s.session is not None]
            return [(k, self.owner.n_tokens(i), i, busy, ms) for k, i, busy, ms in bound]
        return self.call(rows)

    def unbind_session(self, key: str) -> int | None:
        """Empties the slot the session is bound to and unbinds it: the tokens it held,
        None when it is bound to none. FailedPrecondition while a turn of it runs or
        waits."""
        def run() -> int | None:
            with self._cond:
                busy = any(j.session == key for j in self.sched.waiting)
                home = self.sched.home_of(key)
                if home is not None and self.sched.slots[home].job is not None:
                    busy = True
                if busy:
                    raise FailedPrecondition("a turn of the session is running or waiting: "
                                             "delete it once that has ended")
                if home is None:
                    return None
                n = self.owner.n_tokens(home)
                self.unbind_slot(home)
                return n
        return self.call(run)

    def unbind_slot(self, slot: int) -> None:
        """Empties an idle slot and unbinds its session (engine thread)."""
        self.owner.clear(slot)
        self.sched.unbind(slot)

    def slot_last_used_ms(self, slot: int) -> int:
        return self.sched.slots[slot].last_used_unix_ms

    def drain(self, grace: float) -> None:
        """Stops taking jobs, fails the waiting ones, and waits for the running ones at
        most `grace` seconds before cutting them at a unit boundary. The engine still
        runs `call`s afterwards (e.g. to save every slot) until close()."""
        with self._cond:
            self.sched.start_drain(grace)
            self._cond.notify_all()
            while self.sched.active and not self._closed:
                self._cond.wait(0.1)

    def close(self) -> None:
        """Stops the engine thread and frees the core."""
        with self._cond:
            self._closed = True
            self.sched.close_queue()
            self._cond.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join()
        self.owner.close()

    # ---------------------------------------------------------------- engine thread

    def _run(self) -> None:
        sched = self.sched
        while True:
            with self._cond:
                while True:
                    admitted = sched.admit()
                    calls, self._calls = self._calls, []
                    if calls or admitted or sched.active or self._closed:
                        break
                    wake = sched.wake_in()
                    self._cond.wait(None if wake is None else wake + 0.001)
                if self._closed and not calls:
                    sched.stop_all(Unavailable("the server is shutting down"))
                    return
            for c in calls:
                try:
                    c.result = c.fn()
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    c.error = exc
                c.done.set()
            sched.run_round(admitted)
            # every round: a generation that ended while others run changes the count too
            self.metrics.slots_busy.set(sched.n_busy())
            self.metrics.queue_depth.set(len(sched.waiting))
            if not sched.active:
                with self._cond:
                    self._cond.notify_all()  # drain() waits for this

    def _log_failure(self, job: Job, exc: BaseException) -> None:
        self.log.error("engine failure", exc_info=exc, extra=log.fields(slot=job.slot))

    def _slot_infos(self) -> list[SlotInfo]:
        owner = self.owner
        return [SlotInfo(i, owner.n_tokens(i), s.job is not None, owner.draft_n_tokens(i),
                         owner.draft_offset(i), owner.counters(i), s.last_used_unix_ms)
                for i, s in enumerate(self.sched.slots)]

    # ---------------------------------------------------------------- executor

    def reset(self, slot: int) -> None:
        self.owner.clear(slot)

    def slot_tokens(self, slot: int) -> list[int]:
        return self.owner.tokens(slot)

    def begin(self, job: Job) -> None:
        slot = job.slot
        if (job.evict is not None or job.session is not None) and self.sessions is not None:
            try:
                self.sessions.enter(job)
            except Exception as exc:
                if isinstance(job, GenJob):
                    self._abort(job, exc)
                else:
                    job.fail(exc)
                return
        if isinstance(job, SlotOp):
            job.run(slot)
            job.running = False
            return
        assert isinstance(job, GenJob)
        try:
            p = job.params
            owner = self.owner
            job.t_start = time.monotonic()
            job.timings.queue_ms = 1e3 * (job.t_start - job.submitted)
            job.timings.id_slot = slot
            new = p.prompt
            # a session turn sent again with its id replaces the session's last turn
            try:
                replaces = (self.sessions.turn_start(job.session, p.turn_id, p.prompt)
                            if job.session is not None and self.sessions is not None
                            else None)
            except FailedPrecondition as exc:
                job.fail(exc)
                return
            if job.session is not None and not p.conversation:
                # the prompt continues the session's tokens (those before the turn it
                # replaces)
                held = owner.n_tokens(slot)
                keep = min(replaces.start, held) if replaces is not None else held
                if keep + len(p.prompt) + p.max_tokens > self.n_ctx:
                    job.fail(InvalidArgument(
                        f"session {job.session_name!r} holds {keep} tokens: with the prompt "
                        f"of {len(p.prompt)} and max_tokens {p.max_tokens} it exceeds the "
                        f"context of {self.n_ctx} tokens (start a new session)"))
                    return
                job.timings.session_n_discarded = held - keep
                start = keep
                if 0 < keep < owner.keep_min(slot):
                    # the sliding-window layers no longer hold the window of position
                    # keep: the kept tokens are processed again with the prompt
                    new = (*owner.tokens(slot)[:keep], *p.prompt)
                    keep = 0
            else:
                if (job.session is not None and p.history is not None
                        and self.sessions is not None
                        and not self.sessions.continues(job.session, p.history, replaces)):
                    # rendered before another turn of the session changed its
                    # conversation: running it would drop that turn
                    job.fail(FailedPrecondition(
                        f"session {job.session_name!r}: its conversation changed (another "
                        "turn of it ran, or it was deleted) after this Chat was rendered; "
                        "send the messages again"))
                    return
                # a Chat's prompt is its session's whole conversation: what the session
                # holds of it is kept, the rest processed (as cache_prompt does). The
                # slot's tokens are read from the core, their one source: moving a
                # session out (sessions.enter) may have emptied the slot since it was
                # last idle
                common = common_prefix(owner.tokens(slot), p.prompt) if p.cache_prompt else 0
                if job.session is not None:
                    # turns the session held that the conversation does not repeat
                    job.timings.session_n_discarded = max(owner.n_tokens(slot) - common, 0)
                keep = min(common, len(p.prompt) - 1)
                if 0 < keep < owner.keep_min(slot):
                    # the sliding-window layers no longer hold the window of position
                    # keep: rebuilding it needs every earlier position, so all is
                    # re-processed
                    keep = 0
                new = p.prompt[keep:]
                start = keep
            owner.truncate(slot, keep)
            if job.session is not None and self.sessions is not None:
                self.sessions.mark_turn(job.session, p.turn_id, start, replaces, p.prompt)
            if p.seed is not None:
                owner.seed(slot, p.seed)
            job.timings.cache_n = keep
            job.timings.prompt_n = len(new)
            job.counters0 = owner.counters(slot)
            sc = self.cfg.speculative
            if p.spec is not None and sc.adaptive:
                # every request starts from the same estimate, whatever the slot did
                # before: a seeded request draws the same tokens in any slot, restored or not
                job.draft_len = DraftLengths.start(p.spec.n_max, sc.draft_cost,
                                                   p.spec.lookup_k, sc.lookup_cost,
                                                   START_ACCEPTANCE, p.spec.head_n_max,
                                                   sc.head_cost)
            job.todo = list(new)
            # -1: unknown, the first prefill unit of a speculative request catches up
            job.draft_lag = -1 if p.spec is not None and self.owner.has_draft else 0
        except Exception as exc:
            self._abort(job, exc)

    def step_batch(self, jobs: list[Job]) -> bool:
        """One decode step for each job, in one target pass (as `unit` would take them
        one by one)."""
        try:
            self._steps([j for j in jobs if isinstance(j, GenJob)])
        except Exception:  # noqa: BLE001 - e.g. a full slot: each job steps on its own
            return False
        return True

    def unit(self, job: Job, budget: int) -> int:
        assert isinstance(job, GenJob)
        try:
            if job.todo is not None:
                return self._prefill_unit(job, budget)
            self._steps([job])
        except Exception as exc:
            self._abort(job, exc)
        return 0

    def _steps(self, gens: list[GenJob]) -> None:
        """A decode step of every job in one target pass (each drafting what its
        controller asks); raises, with nothing decoded, when the core refuses it."""
        specs = [j.step_spec() for j in gens]
        res = self.owner.step_batch([j.slot for j in gens], [j.params.sampling for j in gens],
                                  specs, [j.params.max_tokens - j.emitted for j in gens])
        for job, spec, r in zip(gens, specs, res, strict=True):
            by_lookup = r.drafter == Drafter.LOOKUP
            if job.draft_len is not None:
                job.draft_len.observe((spec.n_max, spec.lookup_k, spec.head_n_max), by_lookup,
                                      r.match, r.drafted, len(r.tokens) - 1,
                                      by_head=r.drafter == Drafter.HEAD)
            if r.drafter == Drafter.HEAD:
                job.timings.head_n += r.drafted
                job.timings.head_n_accepted += len(r.tokens) - 1
            if by_lookup:
                job.timings.lookup_n += r.drafted
                job.timings.lookup_n_accepted += len(r.tokens) - 1
            try:
                self._take(job, r.tokens, self._logprobs(job))
            except Exception as exc:
                self._abort(job, exc)

    def _prefill_unit(self, job: GenJob, batch: int) -> int:
        """A draft catch-up or prompt chunk of at most `batch` tokens; its tokens."""
        p, owner, slot = job.params, self.owner, job.slot
        todo = job.todo
        assert todo is not None
        if p.spec is not None and job.draft_lag:
            # a draft behind its target (a restored slot to re-prefill) catches up in
            # units of at most `batch` tokens before the prompt
            done, job.draft_lag = owner.draft_catch_up(slot, batch)
            if done:
                return done
        if len(todo) > batch:
            # a chunk of a long prompt: into the KV without sampling
            owner.prefill_chunk(slot, todo[:batch], with_draft=p.spec is not None)
            job.todo = todo[batch:]
            return batch
        first = owner.prefill(slot, todo, p.sampling, with_draft=p.spec is not None)
        job.todo = None
        job.t_first = time.monotonic()
        job.timings.prompt_ms = 1e3 * (job.t_first - job.t_start)
        if p.max_tokens == 0:
            owner.truncate(slot, owner.n_tokens(slot) - 1)  # drop the sampled token
            self._finish(job, StopReason.MAX_TOKENS)
        else:
            self._take(job, [first], self._logprobs(job))
        return len(todo)

    def _logprobs(self, job: GenJob) -> list[TokenLogprob] | None:
        """The logprobs of the tokens the job's last core call returned, when it asked."""
        return self.owner.logprobs(job.slot) if job.params.sampling.logprobs else None

    def _take(self, job: GenJob, toks: list[int],
              lps: list[TokenLogprob] | None = None) -> None:
        """Emits new tokens up to EOS, a stop string or max_tokens (with their logprobs
        when the request asked: lps holds one per token of toks)."""
        p, slot = job.params, job.slot
        out: list[int] = []
        text: list[str] = []
        reason: StopReason | None = None
        stop = ""
        for i, t in enumerate(toks):
            if t == self.eos_id:
                # S ends with toks: keep what precedes the EOS
                self.owner.truncate(slot, self.owner.n_tokens(slot) - (len(toks) - i))
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
                self.owner.truncate(slot, self.owner.n_tokens(slot) - (len(toks) - i - 1))
                reason, stop = StopReason.STOP_STRING, matched
                break
            if job.emitted >= p.max_tokens:
                reason = StopReason.MAX_TOKENS
                break
        joined = "".join(text) if job.text is not None else None
        if job.on_finish is not None:
            job.reply_tokens += out
            if joined:
                job.reply_text.append(joined)
        out_lps = lps[:len(out)] if lps is not None else None
        if reason is not None:
            self._finish(job, reason, stop, out, joined, out_lps)
        elif out:
            job.out.put(Chunk(out, joined, out_lps))

    def _close_out(self, job: GenJob) -> Timings:
        """Commits the pending token, ends the job (the scheduler frees the slot) and
        completes the timings."""
        slot = job.slot
        self.owner.commit(slot)
        now = time.monotonic()
        tm = job.timings
        if job.t_first:
            tm.predicted_ms = 1e3 * (now - job.t_first)
        else:
            tm.prompt_ms = 1e3 * (now - job.t_start)
        tm.predicted_n = job.emitted
        tm.add_counters(self.owner.counters(slot) - job.counters0)
        job.running = False
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
                tokens: list[int] | None = None, text: str | None = None,
                lps: list[TokenLogprob] | None = None) -> None:
        """Ends a generation: its last tokens and text go out with the timings."""
        if job.text is not None and reason is not StopReason.STOP_STRING:
            tail = job.text.flush()
            text = (text or "") + tail
            job.reply_text.append(tail)
        tm = self._close_out(job)
        if job.on_finish is not None:
            reply = ("".join(job.reply_text) if job.text is not None
                     else self.tokenizer.decode(job.reply_tokens))
            try:
                job.on_finish(job, reply)
            except Exception:  # noqa: BLE001 - the generation itself succeeded
                self.log.exception("recording the reply failed",
                                   extra=log.fields(slot=job.slot))
        last = Chunk(tokens or [], text, lps) if tokens or text else None
        fin = Finished(reason, tm, stop, job.params.seed, last)

        def answer() -> None:
            job.out.put(fin)
            job.ended.set()

        sessions = self.sessions if job.session is not None else None
        # write-through: the session's end state goes to the store after the answer, or
        # (--session-ack-stored) the answer's last message waits for it
        if sessions is None or not sessions.ack_stored:
            answer()
        held_back = False
        if sessions is not None and job.session is not None:
            try:
                held_back = sessions.after_turn(
                    job.slot, job.session, answer if sessions.ack_stored else None)
            except Exception:  # noqa: BLE001 - the turn itself succeeded
                self.log.exception("capturing a session for write-through failed",
                                   extra=log.fields(slot=job.slot))
            if sessions.ack_stored and not held_back:
                answer()
        self.log.info("generate", extra=log.fields(
            slot=job.slot, stop_reason=reason.name.lower(), prompt_n=tm.prompt_n,
            cache_n=tm.cache_n, predicted_n=tm.predicted_n, prompt_ms=round(tm.prompt_ms, 2),
            predicted_ms=round(tm.predicted_ms, 2), draft_n=tm.draft_n,
            draft_n_accepted=tm.draft_n_accepted, draft_prompt_n=tm.draft_prompt_n))

    def stop(self, job: Job, err: ServiceError) -> None:
        """Ends a generation early at a unit boundary; the slot keeps what was processed."""
        assert isinstance(job, GenJob)
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
        try:
            self.sched.unbind(job.slot)  # emptied: nothing of it is left
            self.owner.clear(job.slot)
        finally:
            job.fail(exc)
