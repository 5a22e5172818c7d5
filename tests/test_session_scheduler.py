"""The scheduler's session decisions against a fake executor and a fake clock: which
slot a session's job gets, which session it displaces, that one session never runs in
two slots (its later jobs wait, in order, and expire past the queue wait), and what a
job without a session does to a session's slot. No threads, no sleeps."""

from __future__ import annotations

from inference_svc.engine.scheduler import Scheduler
from inference_svc.errors import Cancelled, ResourceExhausted
from tests.test_scheduler import Clock, FakeExecutor, FakeJob, make, step


def sjob(name: str, session: str | None, s: Scheduler, *, prefill: int = 1,
         id_slot: int = -1) -> FakeJob:
    j = FakeJob(name, id_slot, s, prefill=prefill)
    j.session, j.session_name = session, session or ""
    return j


def run_one_turn_each(s: Scheduler, clock: Clock, *sessions: str) -> None:
    """A one-unit turn of each session in turn, a second apart (A the least recent)."""
    for sess in sessions:
        s.submit(sjob(sess.lower(), sess, s))
        step(s)
        clock.t += 1


def bindings(s: Scheduler) -> list[str | None]:
    return [sl.session for sl in s.slots]


def test_a_session_runs_in_one_slot_and_its_next_turn_waits_for_it() -> None:
    clock, ex = Clock(), FakeExecutor()
    s = make(ex, clock, n_slots=2)
    a1, a2 = sjob("a1", "A", s, prefill=2), sjob("a2", "A", s)
    s.submit(a1)
    s.submit(a2)
    assert step(s) == ["a1"]  # a2 waits although slot 1 is idle
    assert (a1.slot, a1.resident, a1.evict) == (0, False, None)
    assert bindings(s) == ["A", None]
    assert step(s) == []  # a1's second unit ends it
    assert step(s) == ["a2"]
    assert (a2.slot, a2.resident, a2.evict) == (0, True, None)
    assert ex.log == [("begin", "a1", 0), ("unit", "a1"), ("unit", "a1"),
                      ("begin", "a2", 0), ("unit", "a2")]


def test_later_turns_of_a_session_keep_their_order_behind_a_waiting_one() -> None:
    clock, ex = Clock(), FakeExecutor()
    s = make(ex, clock, n_slots=1)
    b = sjob("b", "B", s, prefill=2)
    a1, a2 = sjob("a1", "A", s), sjob("a2", "A", s)
    for j in (b, a1, a2):
        s.submit(j)
    assert step(s) == ["b"]
    step(s)
    assert step(s) == ["a1"] and a1.evict == "B" and not a1.resident
    assert step(s) == ["a2"] and a2.resident and a2.evict is None


def test_a_new_session_takes_a_free_slot_before_displacing_the_lru_session() -> None:
    clock, ex = Clock(), FakeExecutor()
    s = make(ex, clock, n_slots=3)
    run_one_turn_each(s, clock, "A", "B")
    assert bindings(s) == ["A", "B", None]
    c = sjob("c", "C", s)
    s.submit(c)
    step(s)
    assert (c.slot, c.evict) == (2, None)
    clock.t += 1
    d = sjob("d", "D", s)
    s.submit(d)
    step(s)
    assert (d.slot, d.evict) == (0, "A")  # A is the least recently used
    assert bindings(s) == ["D", "B", "C"]


def test_a_session_with_a_turn_waiting_is_displaced_last() -> None:
    clock, ex = Clock(), FakeExecutor()
    s = make(ex, clock, n_slots=2)
    run_one_turn_each(s, clock, "A", "B")
    # A is the LRU session, but a turn of A waits (behind the new session C)
    c, a2 = sjob("c", "C", s), sjob("a2", "A", s)
    s.submit(c)
    s.submit(a2)
    assert step(s) == ["c", "a2"]
    assert (c.slot, c.evict) == (1, "B")
    assert (a2.slot, a2.resident) == (0, True)


def test_a_turn_waiting_for_its_busy_session_expires_with_resource_exhausted() -> None:
    clock, ex = Clock(), FakeExecutor()
    s = make(ex, clock, n_slots=2, max_queue_wait=5.0)
    a1, a2 = sjob("a1", "A", s, prefill=100), sjob("a2", "A", s)
    s.submit(a1)
    s.submit(a2)
    step(s)
    clock.t += 4.9
    step(s)
    assert a2.error is None and list(s.waiting) == [a2]
    clock.t += 0.1
    step(s)
    assert isinstance(a2.error, ResourceExhausted)
    assert "session 'A'" in a2.error.message and "5.0 s" in a2.error.message
    assert not s.waiting and bindings(s) == ["A", None]


def test_a_job_without_session_prefers_free_slots_then_displaces_a_session() -> None:
    clock, ex = Clock(), FakeExecutor()
    s = make(ex, clock, n_slots=2)
    s.submit(sjob("a", "A", s))
    step(s)
    clock.t += 1
    x = sjob("x", None, s)
    s.submit(x)
    step(s)
    assert (x.slot, x.evict) == (1, None)
    y = sjob("y", None, s, id_slot=0)  # a request for the session's slot by number
    s.submit(y)
    step(s)
    assert (y.slot, y.evict, y.resident) == (0, "A", False)
    assert bindings(s) == [None, None]


def test_a_job_that_only_reads_the_slot_leaves_its_session_bound() -> None:
    clock, ex = Clock(), FakeExecutor()
    s = make(ex, clock, n_slots=1)
    s.submit(sjob("a", "A", s))
    step(s)
    save = sjob("save", None, s, id_slot=0)
    save.keeps_session = True
    s.submit(save)
    step(s)
    assert (save.slot, save.evict) == (0, None)
    assert bindings(s) == ["A"]


def test_a_job_cancelled_at_admission_moves_no_session() -> None:
    clock, ex = Clock(), FakeExecutor()
    s = make(ex, clock, n_slots=1)
    s.submit(sjob("a", "A", s))
    step(s)
    b = sjob("b", "B", s)
    s.submit(b)
    admitted = s.admit()
    assert admitted == [b] and b.evict == "A" and bindings(s) == ["B"]
    b.cancel()
    s.run_round(admitted)
    assert isinstance(b.error, Cancelled)
    assert bindings(s) == ["A"]  # the executor never ran: the slot still holds A
    assert ("begin", "b", 0) not in ex.log


def test_a_failed_unit_unbinds_the_session_it_emptied() -> None:
    clock, ex = Clock(), FakeExecutor()
    s = make(ex, clock, n_slots=1)
    ex.raise_on = "a"
    a = sjob("a", "A", s, prefill=2)
    s.submit(a)
    step(s)
    assert isinstance(a.error, RuntimeError)
    assert ("reset", 0) in ex.log and bindings(s) == [None]
