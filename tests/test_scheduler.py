"""The scheduler's decisions against a fake executor and a fake clock: admission
order, slot choice, queue limits, waiting deadlines, cancellation, interleaving,
batching and draining, as exact sequences of executor calls. No threads, no sleeps."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from inference_svc.core.params import SamplingParams, SpecParams
from inference_svc.engine.executor import GenJob
from inference_svc.engine.scheduler import Job, Scheduler
from inference_svc.errors import (
    Cancelled,
    DeadlineExceeded,
    ResourceExhausted,
    ServiceError,
    Unavailable,
)
from inference_svc.types import GenerateParams


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class FakeJob(Job):
    """`prefill` units of prompt, then `decode` batchable decode steps."""

    def __init__(self, name: str, id_slot: int, sched: Scheduler, *, prompt: Sequence[int] = (),
                 prefill: int = 1, decode: int = 0, time_remaining: float | None = None) -> None:
        super().__init__(id_slot, *sched.deadlines(time_remaining))
        self.name = name
        self.prompt = list(prompt)
        self.prefill = prefill
        self.decode = decode
        self.error: BaseException | None = None

    def fail(self, exc: BaseException) -> None:
        self.running = False
        self.error = exc

    def prefix_hint(self) -> Sequence[int]:
        return self.prompt

    def batchable(self) -> bool:
        return self.prefill == 0 and self.decode > 0 and not self.cancelled


class FakeExecutor:
    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.budgets: list[tuple[str, int]] = []  # (job, token budget) of each unit
        self.tokens: dict[int, list[int]] = {}
        self.batch_ok = True
        self.raise_on: str | None = None

    def _step(self, job: FakeJob) -> None:
        if job.name == self.raise_on:
            raise RuntimeError("core failure")
        if job.prefill:
            job.prefill -= 1
        else:
            job.decode -= 1
        if not job.prefill and not job.decode:
            job.running = False
            self.tokens[job.slot] = job.prompt

    def begin(self, job: Job) -> None:
        assert isinstance(job, FakeJob)
        self.log.append(("begin", job.name, job.slot))

    def unit(self, job: Job, budget: int) -> None:
        assert isinstance(job, FakeJob)
        self.log.append(("unit", job.name))
        self.budgets.append((job.name, budget))
        self._step(job)

    def step_batch(self, jobs: list[Job]) -> bool:
        if not self.batch_ok:
            return False
        self.log.append(("batch", [j.name for j in jobs]))  # type: ignore[attr-defined]
        for j in jobs:
            assert isinstance(j, FakeJob)
            self._step(j)
        return True

    def stop(self, job: Job, err: ServiceError) -> None:
        assert isinstance(job, FakeJob)
        self.log.append(("stop", job.name, type(err).__name__))
        job.running = False
        job.error = err

    def reset(self, slot: int) -> None:
        self.log.append(("reset", slot))
        self.tokens[slot] = []

    def slot_tokens(self, slot: int) -> list[int]:
        return list(self.tokens.get(slot, []))


@pytest.fixture()
def clock() -> Clock:
    return Clock()


@pytest.fixture()
def ex() -> FakeExecutor:
    return FakeExecutor()


def make(ex: FakeExecutor, clock: Clock, n_slots: int = 2, max_queue: int = 8,
         max_queue_wait: float = 5.0) -> Scheduler:
    return Scheduler(n_slots, max_queue, max_queue_wait, ex, clock=clock, wall=clock)


def submit(s: Scheduler, *jobs: FakeJob) -> None:
    for j in jobs:
        s.submit(j)


def step(s: Scheduler) -> list[str]:
    """One engine round: admit, then run; the names admitted."""
    admitted = s.admit()
    s.run_round(admitted)
    return [j.name for j in admitted]  # type: ignore[attr-defined]


def test_fifo_admission_skips_jobs_for_busy_slots(ex: FakeExecutor, clock: Clock) -> None:
    s = make(ex, clock)
    a, b = FakeJob("a", 0, s, prefill=2), FakeJob("b", 0, s)
    c, d = FakeJob("c", -1, s), FakeJob("d", -1, s)
    submit(s, a, b, c, d)
    assert step(s) == ["a", "c"]
    assert (a.slot, c.slot) == (0, 1)
    assert [j.name for j in s.waiting] == ["b", "d"]
    # c ended in round one and freed slot 1: d (any slot) takes it; b still waits for slot 0
    assert step(s) == ["d"]
    # a ended in round two: b gets slot 0
    assert step(s) == ["b"]
    assert ex.log == [("begin", "a", 0), ("begin", "c", 1), ("unit", "a"), ("unit", "c"),
                      ("begin", "d", 1), ("unit", "a"), ("unit", "d"),
                      ("begin", "b", 0), ("unit", "b")]
    assert not s.active and not s.waiting and s.n_busy() == 0


def test_any_slot_job_takes_the_longest_prefix_then_the_lru_slot(
        ex: FakeExecutor, clock: Clock) -> None:
    s = make(ex, clock, n_slots=3)
    for slot, prompt in ((0, [1, 2, 3]), (1, [1, 2, 9]), (2, [7])):
        clock.t += 1
        submit(s, FakeJob(f"fill{slot}", slot, s, prompt=prompt))
        step(s)
    assert [ex.slot_tokens(i) for i in range(3)] == [[1, 2, 3], [1, 2, 9], [7]]
    assert [x.last_used for x in s.slots] == [101.0, 102.0, 103.0]
    j = FakeJob("p", -1, s, prompt=[1, 2, 9, 4])
    submit(s, j)
    step(s)
    assert j.slot == 1  # three tokens shared
    # no prefix shared anywhere: the least recently used slot (slot 0, used at 101)
    k = FakeJob("q", -1, s, prompt=[5])
    submit(s, k)
    step(s)
    assert k.slot == 0


def test_full_queue_is_resource_exhausted(ex: FakeExecutor, clock: Clock) -> None:
    s = make(ex, clock, n_slots=1, max_queue=3)
    submit(s, *(FakeJob(str(i), 0, s) for i in range(3)))
    with pytest.raises(ResourceExhausted, match="3 requests are already waiting for a slot"):
        s.submit(FakeJob("x", 0, s))
    assert len(s.waiting) == 3


def test_waiting_job_gives_up_at_its_wait_limit(ex: FakeExecutor, clock: Clock) -> None:
    s = make(ex, clock, max_queue_wait=0.3)
    long = FakeJob("long", 0, s, prefill=100)
    submit(s, long)
    step(s)
    w = FakeJob("w", 0, s)
    submit(s, w)
    assert s.wake_in() == pytest.approx(0.3)
    clock.t += 0.299
    step(s)
    assert w.error is None and list(s.waiting) == [w]
    clock.t += 0.001
    step(s)
    assert isinstance(w.error, ResourceExhausted)
    assert w.error.message == "slot 0 stayed busy for 0.3 s: try again later"
    assert not s.waiting and s.wake_in() is None
    assert ("begin", "w", 0) not in ex.log
    # a job for any slot names every slot
    s2 = make(FakeExecutor(), clock, n_slots=1, max_queue_wait=2.0)
    submit(s2, FakeJob("l", 0, s2, prefill=100))
    step(s2)
    any_slot = FakeJob("a", -1, s2)
    submit(s2, any_slot)
    clock.t += 2.0
    step(s2)
    assert isinstance(any_slot.error, ResourceExhausted)
    assert any_slot.error.message == "all 1 slots stayed busy for 2.0 s: try again later"


def test_caller_deadline_shorter_than_the_wait_is_deadline_exceeded(
        ex: FakeExecutor, clock: Clock) -> None:
    s = make(ex, clock, max_queue_wait=30.0)
    submit(s, FakeJob("long", 0, s, prefill=100))
    step(s)
    w = FakeJob("w", 0, s, time_remaining=1.0)
    # the queue gives up 10 % (at most 0.1 s) before the caller's deadline
    assert (w.wait_until, w.rpc_deadline) == (pytest.approx(100.9), 101.0)
    submit(s, w)
    clock.t = 100.95
    step(s)
    assert isinstance(w.error, ResourceExhausted)
    w2 = FakeJob("w2", 0, s, time_remaining=0.5)
    submit(s, w2)
    clock.t += 0.5
    step(s)
    assert isinstance(w2.error, DeadlineExceeded)


def test_cancelled_while_waiting_never_runs(ex: FakeExecutor, clock: Clock) -> None:
    s = make(ex, clock, n_slots=1, max_queue_wait=30.0)
    long = FakeJob("long", 0, s, prefill=5)
    w = FakeJob("w", 0, s)
    woken: list[str] = []
    w.on_cancel = lambda: woken.append("w")
    submit(s, long, w)
    step(s)
    w.cancel()
    w.cancel()  # a second cancel changes nothing
    assert woken == ["w"]
    step(s)
    assert isinstance(w.error, Cancelled) and "while waiting" in w.error.message
    assert not s.waiting and s.active == [long]
    assert [e for e in ex.log if e[1] == "w"] == []


def test_cancelled_before_its_first_unit(ex: FakeExecutor, clock: Clock) -> None:
    s = make(ex, clock, n_slots=1)
    j = FakeJob("j", 0, s)
    submit(s, j)
    admitted = s.admit()
    j.cancel()
    s.run_round(admitted)
    assert isinstance(j.error, Cancelled)
    assert ex.log == [] and s.n_busy() == 0


def test_running_job_cancelled_stops_at_the_next_unit_and_frees_the_slot(
        ex: FakeExecutor, clock: Clock) -> None:
    s = make(ex, clock, n_slots=1)
    run, nxt = FakeJob("run", 0, s, prefill=10), FakeJob("next", 0, s)
    submit(s, run, nxt)
    step(s)
    step(s)
    run.cancel()
    step(s)
    assert ex.log == [("begin", "run", 0), ("unit", "run"), ("unit", "run"),
                      ("stop", "run", "Cancelled")]
    assert s.n_busy() == 0 and not s.active
    assert step(s) == ["next"]


def test_rounds_interleave_running_jobs(ex: FakeExecutor, clock: Clock) -> None:
    s = make(ex, clock)
    submit(s, FakeJob("a", 0, s, prefill=3), FakeJob("b", 1, s, prefill=2))
    for _ in range(3):
        step(s)
    assert [e for e in ex.log if e[0] == "unit"] == [
        ("unit", "a"), ("unit", "b"), ("unit", "a"), ("unit", "b"), ("unit", "a")]


def test_decode_steps_of_running_jobs_share_one_batch(ex: FakeExecutor, clock: Clock) -> None:
    s = make(ex, clock, n_slots=3)
    # submitted in the reverse slot order: a batch goes in slot order
    submit(s, FakeJob("c", 2, s, prefill=3), FakeJob("b", 1, s, prefill=1, decode=2),
           FakeJob("a", 0, s, prefill=1, decode=3))
    for _ in range(4):
        step(s)
    assert ex.log[3:] == [
        ("unit", "c"), ("unit", "b"), ("unit", "a"),  # prompts
        ("batch", ["a", "b"]), ("unit", "c"),
        ("batch", ["a", "b"]), ("unit", "c"),
        ("unit", "a"),  # alone: b has ended
    ]


def test_a_batch_the_executor_refuses_runs_one_by_one(ex: FakeExecutor, clock: Clock) -> None:
    s = make(ex, clock)
    submit(s, FakeJob("a", 0, s, prefill=0, decode=1), FakeJob("b", 1, s, prefill=0, decode=1))
    ex.batch_ok = False
    step(s)
    assert ex.log[2:] == [("unit", "a"), ("unit", "b")]


def test_executor_failure_fails_the_job_and_empties_its_slot(
        ex: FakeExecutor, clock: Clock) -> None:
    errors: list[str] = []
    s = Scheduler(2, 8, 5.0, ex, clock=clock, wall=clock,
                  on_error=lambda job, exc: errors.append(str(exc)))
    bad, good = FakeJob("bad", 0, s, prompt=[1, 2], prefill=2), FakeJob("good", 1, s, prefill=2)
    submit(s, bad, good)
    ex.raise_on = "bad"
    step(s)
    assert isinstance(bad.error, RuntimeError) and errors == ["core failure"]
    assert ("reset", 0) in ex.log and ex.slot_tokens(0) == [] and s.slots[0].job is None
    assert s.active == [good] and good.error is None


def test_drain_fails_the_waiting_and_cuts_the_running_after_the_grace(
        ex: FakeExecutor, clock: Clock) -> None:
    s = make(ex, clock, n_slots=1)
    run, w = FakeJob("run", 0, s, prefill=100), FakeJob("w", 0, s)
    submit(s, run, w)
    step(s)
    s.start_drain(2.0)
    assert isinstance(w.error, Unavailable) and not s.waiting
    with pytest.raises(Unavailable, match="shutting down"):
        s.submit(FakeJob("late", 0, s))
    clock.t += 1.999
    step(s)
    assert run.running and ex.log[-1] == ("unit", "run")
    clock.t += 0.001
    step(s)
    assert ex.log[-1] == ("stop", "run", "Unavailable")
    assert not s.active and s.n_busy() == 0
    assert sum(e[0] == "unit" for e in ex.log) == 2


def test_released_slot_records_its_time(ex: FakeExecutor, clock: Clock) -> None:
    s = make(ex, clock, n_slots=1)
    clock.t = 1234.5
    submit(s, FakeJob("j", 0, s, prompt=[4, 5, 6]))
    step(s)
    sl = s.slots[0]
    assert (sl.last_used, sl.last_used_unix_ms, sl.job) == (1234.5, 1234500, None)


def test_slot_choice_reads_the_tokens_a_slot_holds_now(ex: FakeExecutor,
                                                       clock: Clock) -> None:
    """The slot's tokens come from the executor when a job is admitted: a slot emptied
    or refilled while idle (a session moved out, an erase, a restore) is matched by what
    it holds now, not by what it held when its last job ended."""
    s = make(ex, clock, n_slots=2)
    for slot, prompt in ((1, [5]), (0, [1, 2, 3])):  # slot 1 the least recently used
        clock.t += 1
        submit(s, FakeJob(f"fill{slot}", slot, s, prompt=prompt))
        step(s)
    ex.reset(0)  # emptied behind the scheduler's back
    j = FakeJob("p", -1, s, prompt=[1, 2, 3, 4])
    submit(s, j)
    step(s)
    assert j.slot == 1  # no prefix held anywhere: the least recently used slot
    while s.active:
        step(s)
    ex.tokens[0] = [1, 2, 3, 4, 6]  # restored behind the scheduler's back
    k = FakeJob("q", -1, s, prompt=[1, 2, 3, 4, 6, 7])
    submit(s, k)
    step(s)
    assert k.slot == 0


class ChunkJob(FakeJob):
    """`catch` tokens of draft catch-up, then `tokens` of prompt, processed `budget`
    tokens per unit, then `decode` decode steps."""

    def __init__(self, name: str, id_slot: int, sched: Scheduler, *, tokens: int,
                 decode: int = 0, catch: int = 0) -> None:
        super().__init__(name, id_slot, sched, prefill=1, decode=decode)
        self.catch = catch
        self.left = tokens
        self.chunks: list[int] = []

    def chunk_kind(self) -> str:
        return "catch-up" if self.catch else "prompt"

    def take(self, budget: int) -> int:
        if self.catch:
            n = min(budget, self.catch)
            self.catch -= n
        else:
            n = min(budget, self.left)
            self.left -= n
        self.chunks.append(n)
        if self.catch or self.left:
            self.prefill += 1  # _step consumes one prefill unit per call
        return n


STEP = 1 / 64  # seconds of a decode round (binary fractions: the clock sums are exact)
TOKEN = 1 / 2048  # seconds per chunk token


class ChunkExecutor(FakeExecutor):
    """Advances the fake clock by what the work would take: STEP per decode round,
    TOKEN per chunk token (`prompt_cost` per prompt token when set) and, for a prompt
    chunk (a pass of the target), `pass_cost` more whatever its tokens; records the
    time of every decode step of each job."""

    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.clock = clock
        self.token_cost = TOKEN
        self.prompt_cost: float | None = None  # None: token_cost
        self.pass_cost = STEP  # a target pass's fixed part: what a decode step costs
        self.steps: dict[str, list[float]] = {}

    def unit(self, job: Job, budget: int) -> int:
        assert isinstance(job, FakeJob)
        if isinstance(job, ChunkJob) and job.prefill:
            cost = self.token_cost
            if job.chunk_kind() == "prompt" and self.prompt_cost is not None:
                cost = self.prompt_cost
            n = job.take(budget)
            fixed = self.pass_cost if job.chunk_kind() == "prompt" else 0.0
            self.clock.t += fixed + n * cost
            super().unit(job, budget)
            return n
        if not job.prefill:
            self.clock.t += STEP
            self.steps.setdefault(job.name, []).append(self.clock.t)
        super().unit(job, budget)
        return 0

    def step_batch(self, jobs: list[Job]) -> bool:
        self.clock.t += STEP
        for j in jobs:
            self.steps.setdefault(j.name, []).append(self.clock.t)  # type: ignore[attr-defined]
        return super().step_batch(jobs)


def make_chunked(ex: FakeExecutor, clock: Clock) -> Scheduler:
    return Scheduler(2, 8, 5.0, ex, clock=clock, wall=clock, chunk=512, shared_chunk=64)


def test_catch_up_next_to_a_decoding_stream_runs_in_short_chunks(clock: Clock) -> None:
    """A 4,000-token catch-up admitted while another slot decodes: every round runs one
    decode step and one chunk sized to half a step at the catch-up's measured cost per
    token (1 token first, then doubling up to 1/64 s / 2 / (1/2048 s) = 16), until the
    decoding stream ends; the rest goes in full 512-token chunks."""
    ex = ChunkExecutor(clock)
    s = make_chunked(ex, clock)
    dec = FakeJob("dec", 0, s, prefill=1, decode=10)
    submit(s, dec)
    step(s)  # dec's prompt
    catch = ChunkJob("catch", 1, s, tokens=0, catch=4000, decode=1)
    submit(s, catch)
    while s.active or s.waiting:
        step(s)
    assert ex.log[3:23] == [("unit", "dec"), ("unit", "catch")] * 10
    assert catch.chunks == [1, 2, 4, 8] + [16] * 6 + [512] * 7 + [4000 - 111 - 7 * 512]
    gaps = [b - a for a, b in zip(ex.steps["dec"], ex.steps["dec"][1:], strict=False)]
    assert max(gaps) == STEP + 16 * TOKEN == 1.5 * STEP  # one step and half a step of chunk
    assert ex.log[-1] == ("unit", "catch")  # its own decode step, alone


def test_shared_chunks_follow_the_chunk_speed_and_stay_bounded(clock: Clock) -> None:
    """A prompt's chunks next to a decoding stream are sized by their cost per token
    (a chunk's time less its pass's fixed part): they double from one token while
    half a step holds more, shrink when tokens get dearer (a longer context to attend
    to) and grow again, doubling, up to shared_chunk when they get cheaper."""
    ex = ChunkExecutor(clock)
    s = make_chunked(ex, clock)
    submit(s, FakeJob("dec", 0, s, prefill=0, decode=8))
    catch = ChunkJob("catch", 1, s, tokens=4000)
    submit(s, catch)
    step(s)
    step(s)
    ex.token_cost = 2 * TOKEN
    step(s)
    step(s)  # 8 = half a step at 2 TOKEN per token
    ex.token_cost = TOKEN / 16
    for _ in range(4):
        step(s)
    assert catch.chunks == [1, 2, 4, 8, 8, 16, 32, 64]


def test_a_prompt_next_to_decoding_streams_is_sized_without_its_pass_cost(
        clock: Clock) -> None:
    """A chunk whose time is mostly its pass's own (a target pass costs a decode step
    whatever its tokens) measures a low speed; sized by that speed, each next chunk
    would shrink (8, 3, then 1 token a pass: 33 passes for a 42-token prompt, each as
    long as a decode step). Its pass's fixed part is not charged to its tokens: the
    chunks double from one token, the prompt is in after 6 rounds, then the newcomer
    decodes in the same batch as the others."""
    ex = ChunkExecutor(clock)
    s = Scheduler(3, 8, 5.0, ex, clock=clock, wall=clock, chunk=512, shared_chunk=64)
    submit(s, FakeJob("a", 0, s, prefill=0, decode=10), FakeJob("b", 1, s, prefill=0, decode=10))
    step(s)
    late = ChunkJob("late", 2, s, tokens=42, decode=3)
    submit(s, late)
    while s.active or s.waiting:
        step(s)
    assert late.chunks == [1, 2, 4, 8, 16, 11]
    assert ex.log[3:] == ([("begin", "late", 2)] + [("batch", ["a", "b"]), ("unit", "late")] * 6
                          + [("batch", ["a", "b", "late"])] * 3)


def test_prompt_chunks_are_full_size_while_nobody_decodes(clock: Clock) -> None:
    ex = ChunkExecutor(clock)
    s = make_chunked(ex, clock)
    a = ChunkJob("a", 0, s, tokens=1100, decode=2)
    b = ChunkJob("b", 1, s, tokens=700, decode=1)
    submit(s, a, b)
    while s.active or s.waiting:
        step(s)
    # both prefill at full size until b decodes; next to b's step a's chunk is sized
    # from its measured cost per token (half of 1/64 s at 1/2048 s a token: 16); alone
    # again, a full chunk
    assert b.chunks == [512, 188]
    assert a.chunks == [512, 512, 16, 60]
    assert ex.log[2:] == [("unit", "a"), ("unit", "b"), ("unit", "a"), ("unit", "b"),
                          ("unit", "b"), ("unit", "a"), ("unit", "a"), ("unit", "a"),
                          ("unit", "a")]


def test_prompt_after_a_catch_up_is_sized_from_its_own_speed(clock: Clock) -> None:
    """A catch-up (the draft: fast) then a prompt continuing the long context (the
    target: 64x slower per token) next to a decoding stream: the prompt's first
    chunk is one token, not the 16 the catch-up's cost allows, and the next ones
    follow the prompt's own cost; no decode round waits for more than half a step
    of catch-up, or one prompt pass of one token."""
    ex = ChunkExecutor(clock)
    ex.prompt_cost = 64 * TOKEN  # 1 / 32 s: two decode steps per prompt token
    s = make_chunked(ex, clock)
    submit(s, FakeJob("dec", 0, s, prefill=0, decode=12))
    catch = ChunkJob("catch", 1, s, catch=40, tokens=3, decode=1)
    submit(s, catch)
    while s.active or s.waiting:
        step(s)
    # catch-up: doubling up to 16; prompt: 1 token per unit (half a step holds a
    # quarter of a prompt token's 1/32 s, at least 1)
    assert catch.chunks == [1, 2, 4, 8, 16, 9, 1, 1, 1]
    assert set(catch.chunk_last) == {"catch-up", "prompt"}
    assert ex.log[2:20] == [("unit", "dec"), ("unit", "catch")] * 9
    gaps = [b - a for a, b in zip(ex.steps["dec"], ex.steps["dec"][1:], strict=False)]
    assert gaps[:5] == [STEP + n * TOKEN for n in (1, 2, 4, 8, 16)]
    assert max(gaps) == 2 * STEP + 64 * TOKEN  # a step and a pass of one prompt token


def test_generation_names_the_kind_of_its_next_chunk() -> None:
    """A speculative generation's chunks are draft catch-up while its draft lags (or
    the lag is not known yet), then prompt; a target-only one's are prompt."""
    spec = GenerateParams((1, 2, 3), 4, 0, True, SamplingParams(), None, SpecParams(n_max=4))
    job = GenJob(spec, 0.0, None, None)
    job.draft_lag = -1
    assert job.chunk_kind() == "catch-up"
    job.draft_lag = 100
    assert job.chunk_kind() == "catch-up"
    job.draft_lag = 0
    assert job.chunk_kind() == "prompt"
    plain = GenJob(GenerateParams((1, 2, 3), 4, 0, True, SamplingParams(), None, None),
                   0.0, None, None)
    plain.draft_lag = 0
    assert plain.chunk_kind() == "prompt"
