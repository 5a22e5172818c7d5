"""Sessions: named conversations that outlive their slot, in three tiers.

A session is *resident* while it is bound to a slot (the scheduler binds it,
inference_svc.engine.scheduler). When another job needs that slot, the engine captures
the session's whole state (target KV, draft KV, speculative state and RNG) into
the host-memory tier (`--session-ram-mb`). The tier never holds more bytes than its
bound: before a session goes in, the least recently used ones are written to the slot
store (local directory or snapshot service) under `session~<owner>~<name>`
(inference_svc.sessions.names) until it fits, or the session goes to the store itself
when it cannot fit; every session goes to the store at stop.
A session's next turn restores it from whichever tier holds it, so the turn
processes only its new tokens. A session found in the store is read and checked
(model fingerprint, digests, fit, as RestoreSlot) on the request's own thread
before the request queues, so the engine thread only applies checked state.

Without a store the host-memory tier is the last one: a session pushed out of it
is dropped (logged, counted as `dropped`).

A session also keeps its chat conversation: the messages of its Chats and their
replies (`conversation`), which an `append` Chat continues. It goes with the session's
state to the store (the slot file's CHAT section, inference_svc.sessions.chat_record) and comes
back with it; the tokens stay the truth of what the slot holds (a Chat's prompt keeps
only the tokens it shares with them).

A conversation never silently goes back in time. Each state of a session has a version;
the host knows which version the store holds. When a turn fails and its slot is emptied
(or a displaced session's state cannot be captured), the session continues from the
store only if the store holds the very state the turn started from; otherwise its state
is lost: the older copy in the store is removed, and the session's next turn gets
DATA_LOSS naming it (after which the name starts a new conversation).

Replicas sharing one snapshot service share sessions by the store's generations
(a snapshot service with conditional writes). Each replica remembers the generation of
the state it last read or wrote per session and writes only over that generation: a
write that finds another replica's newer one writes nothing (the conversation is not
sent back in time). Before a turn continues this replica's own copy (in a slot or in
RAM), the store's generation is checked (Stat): when another replica moved the session
on, the own copy is dropped and the store's is read; if the own copy also held turns
the store does not have, the turn gets ABORTED naming the session and both
generations, and the next one continues from the store's copy. With write-through
(`--session-write-through`, on by default with a store), each turn's end state is
written in the background right after the turn, so another replica finds it and a
killed replica loses only the turns whose write was still in flight.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from inference_svc import log
from inference_svc.chat import Message
from inference_svc.engine.executor import Engine, GenJob
from inference_svc.engine.scheduler import Job
from inference_svc.errors import (
    Aborted,
    DataLoss,
    FailedPrecondition,
    GenerationConflict,
    NotFound,
)
from inference_svc.metrics import Metrics
from inference_svc.sessions import chat_record, turn_mark
from inference_svc.sessions.listing import (
    TIER_LABEL,
    TIER_NEW,
    TIER_RAM,
    TIER_SLOT,
    TIER_STORE,
    SessionRow,
    list_stored,
)
from inference_svc.sessions.names import (
    SESSION_PREFIX,
    SessionKey,
    check_session_name,
    from_store_name,
)
from inference_svc.storage.fallback import Fallback
from inference_svc.storage.slots import SlotManager
from inference_svc.storage.snapshots import (
    EncodedSlot,
    PreparedRestore,
    encode_slot,
    prepare_restore,
)
from inference_svc.storage.store import SlotStore
from snapshot_svc.clientlib import auth

SPILL_RETRY_S = 1.0  # pause after a failed write to the store before the next attempt
STORE_WRITE_S = 5.0  # bound of one write of a session to the store by the writer
LIST_STAT_S = 5.0  # bound of the store generations one ListSessions asks, together
_KEY_LOCKS = 64  # striped locks that order store loads and deletions per session


def _before(kept: tuple[Message, ...], mark: turn_mark.TurnMark | None,
            turn_id: str) -> tuple[Message, ...]:
    """The conversation `kept` before the turn `turn_id` when `mark` is that turn."""
    return kept[:mark.chat] if turn_id and mark is not None and mark.id == turn_id else kept


def owner_of(principal: auth.Principal | None) -> str:
    """The sessions' owner of a caller: a `user` key's id; "" without keys or for
    admin keys."""
    if principal is None or principal.is_admin:
        return ""
    return principal.key_id


def caller_key(name: str) -> SessionKey:
    """The session `name` of the caller of the call being served; `name` was checked
    where the request came in (types.session_from_pb, delete_key)."""
    return SessionKey(owner_of(auth.CURRENT.get()), name)


@dataclass(eq=False)
class Held:
    """A session's state in the host-memory tier."""

    key: str  # store name
    parts: tuple[bytes | memoryview, ...]  # SlotOwner.apply target parts
    draft: bytes | memoryview | None  # draft state; None: the draft restore policy applies
    draft_note: str
    n_tokens: int
    size: int  # bytes held
    last_used_ms: int
    origin: int  # TIER_RAM (captured from a slot) or TIER_STORE (read from the store)
    version: int = 0  # the session's state version it holds
    raw_target: memoryview | None = None  # captured WSKV state, to encode for the store
    in_store: bool = False  # the store holds this very state: nothing to write
    writing: bool = False  # the writer is storing it
    # displaced from its slot when the tier had no room: waits outside the tier (in
    # _staged, where a turn of it finds it) until the writer has made room or stored it
    awaiting: bool = False
    deleted: bool = False  # DeleteSession removed it (a write in flight is undone)
    chat: tuple[Message, ...] | None = None  # its chat conversation, written with it
    turn: turn_mark.TurnMark | None = None  # its last turn's id, written with it
    # answers held back until this state is stored (--session-ack-stored)
    then: list[Callable[[], None]] = field(default_factory=list)


@dataclass(frozen=True)
class Turn:
    """What a running turn of a session started from."""

    job: weakref.ref[Job]
    version: int  # the state's version at the turn's start (0: empty)
    n_tokens: int  # its tokens
    # set once the turn is marked (mark_turn): the conversation and the mark it replaced,
    # put back if the turn fails and the session continues from its previous state
    marked: bool = False
    chat: tuple[Message, ...] | None = None
    mark: turn_mark.TurnMark | None = None


class SessionHost:
    """The tiers below the slots and the moves between them. `enter`, `evict` and the
    list of resident sessions run on the engine thread; `prepare`, `delete`, `list`
    and `save_all` on the caller's."""

    def __init__(self, engine: Engine, slots: SlotManager, ram_bytes: int,
                 metrics: Metrics, fallback: Fallback | None = None,
                 write_through: bool = False, ack_stored: bool = False) -> None:
        self.engine = engine
        self.owner = engine.owner  # the slots' content, changed on the engine thread only
        self.slots = slots
        self.store: SlotStore | None = slots.store
        # where the stop puts the sessions the store does not take (and finds them again)
        self.fallback = fallback if slots.store is not None else None
        self.ram_bytes = ram_bytes
        self.metrics = metrics
        self.log = log.get()
        self._lock = threading.Condition()
        self._ram: dict[str, Held] = {}  # the RAM tier
        self._ram_used = 0  # its bytes: at most ram_bytes (see _put for the one exception)
        # read from the store (or written there while a turn of it waited) for a waiting
        # turn: held for that turn only, outside the tier's bound
        self._staged: dict[str, Held] = {}
        self._awaiting: collections.deque[Held] = collections.deque()  # for _make_room
        self._reserved: collections.Counter[str] = collections.Counter()  # jobs per session
        self._reserving: set[int] = set()  # id() of the jobs holding a reservation
        self._in_store: set[str] = set()  # store names of sessions this replica knows there
        self._key_locks = [threading.Lock() for _ in range(_KEY_LOCKS)]
        self._versions = itertools.count(1)
        self._ver: dict[str, int] = {}  # the version of each session's newest state
        self._store_ver: dict[str, tuple[int, int]] = {}  # the store's copy: version, tokens
        self._turns: dict[str, Turn] = {}  # each session's running (or last) turn
        self._writing: set[str] = set()  # sessions being written: one write at a time each
        self._checking: set[str] = set()  # sessions whose store generation is being asked
        self._lost: dict[str, str] = {}  # sessions whose state was lost: the report
        # each session's chat conversation (its Chats' messages and replies), whatever
        # tier holds its state
        self._chats: dict[str, tuple[Message, ...]] = {}
        # each session's last turn that its caller named (turn_id), whatever tier holds it
        self._marks: dict[str, turn_mark.TurnMark] = {}
        # a session's state `conversation` read from the store for its coming turn, and
        # the milliseconds that took: `prepare` takes it instead of reading it again
        self._peeked: dict[str, tuple[PreparedRestore, float]] = {}
        self._stale: set[str] = set()  # of those, the ones whose older store copy remains
        self._write_failed: float | None = None  # time.monotonic() of the last failed write
        # each turn's end state goes to the store in the background (needs a store)
        self.write_through = write_through and slots.store is not None
        # a turn's last message waits until its end state is stored (or the write failed)
        self.ack_stored = ack_stored and self.write_through
        self._through: dict[str, Held] = {}  # a session's newest state waiting to be written
        # the store's generation of the state this replica last read or wrote, per session
        self._gen: dict[str, int] = {}
        self._conflicts: dict[str, str] = {}  # sessions another replica moved on: the report
        self._conditional: bool | None = None  # the store has generations (asked once)
        self._closed = False
        self._writer = threading.Thread(target=self._write_loop, name="warmslot-sessions",
                                        daemon=True)
        self._writer.start()

    def _key_lock(self, key: str) -> threading.Lock:
        return self._key_locks[hash(key) % _KEY_LOCKS]

    # ------------------------------------------------------------ request thread

    def prepare(self, job: GenJob, name: str, deadline: float | None) -> None:
        """Names the job's session (the caller's), reserves it (its state stays in RAM
        until the job is admitted or fails) and, when neither a slot nor the RAM tier
        holds it, reads it from the store, checked, for the job. A session found
        nowhere is a new one; one whose state was lost gets DataLoss (once)."""
        key = caller_key(name)
        job.session, job.session_name = key.store_name, key.name
        k = key.store_name
        if job.params.conversation:
            job.on_finish = self._keep_reply
        with self._key_lock(k):
            with self._lock:
                self._reserved[k] += 1
                self._reserving.add(id(job))
            try:
                self._report_loss(k, deadline)
                self._report_conflict(k)
                if self.store is None:
                    return
                if ((self.engine.session_resident(k) or self._held(k))
                        and not self._moved_on(k, deadline)):
                    return
                t0 = time.perf_counter()
                with self._lock:
                    peeked = self._peeked.pop(k, None)
                if peeked is not None:
                    prepared, ms = peeked
                    t0 -= ms / 1e3
                else:
                    try:
                        prepared = self._read_stored(k, deadline)
                    except NotFound:
                        return
                with self._lock:
                    self._set_chat(k, prepared.chat)
                    self._set_mark(k, prepared.turn)
                    v = next(self._versions)
                    self._staged[k] = Held(
                        k, prepared.target_parts, prepared.draft_state, prepared.draft_note,
                        prepared.n_tokens, prepared.n_read, int(time.time() * 1000),
                        TIER_STORE, version=v, in_store=True)
                    self._ver[k] = v
                    self._store_ver[k] = (v, prepared.n_tokens)
                    self._in_store.add(k)
                    self._gen[k] = prepared.generation
                if self.fallback is not None and self.fallback.has(k) and self._conditional_store():
                    # a stop's copy continues whatever the store holds: it goes over that
                    gen = self.store.generation(k, deadline=deadline)
                    with self._lock:
                        self._gen[k] = gen
                # the read and checks count in the turn's restore time
                job.timings.session_restore_ms = 1e3 * (time.perf_counter() - t0)
            except BaseException:
                self.release(job)
                raise

    def _report_loss(self, k: str, deadline: float | None) -> None:
        """DataLoss for a session whose state was lost, once its older store copy is
        removed (removed here when the writer has not yet; while that fails, every
        turn gets DataLoss, so the copy is never continued)."""
        with self._lock:
            msg = self._lost.get(k)
            stale = k in self._stale
        if msg is None:
            return
        if stale:
            try:
                self._delete_stored(k, deadline)
            except Exception as exc:  # noqa: BLE001 - reported with the loss
                raise DataLoss(f"{msg}; its older copy could not be removed from the store "
                               f"yet ({exc})") from exc
            with self._lock:
                self._stale.discard(k)
        with self._lock:
            self._lost.pop(k, None)
        raise DataLoss(msg)

    def _report_conflict(self, k: str) -> None:
        """Aborted, once, for a session whose write met another replica's newer state."""
        with self._lock:
            msg = self._conflicts.pop(k, None)
        if msg is not None:
            raise Aborted(msg)

    def _conditional_store(self) -> bool:
        """Whether the store keeps generations (asked once; False while unreachable)."""
        if self._conditional is None and self.store is not None:
            try:
                self._conditional = self.store.conditional()
            except Exception:  # noqa: BLE001 - asked again on the next call
                return False
        return bool(self._conditional)

    def _moved_on(self, k: str, deadline: float | None) -> bool:
        """Whether another replica wrote session `k` after the state this replica last
        read or wrote (Stat on the store): then this replica's copy (in a slot or in
        RAM) is dropped and True returned, so the store's is read. Aborted, naming both
        generations, when the dropped copy held turns the store does not have."""
        if not self._conditional_store():
            return False
        assert self.store is not None
        with self._lock:
            # a write of it in flight here (write-through) is this replica's own move:
            # its generation is known once it ends (within its own deadline); none starts
            # while the store is asked
            while k in self._writing or k in self._checking:
                self._lock.wait()
            self._checking.add(k)
        try:
            stored = self.store.generation(k, deadline=deadline)
        finally:
            with self._lock:
                self._checking.discard(k)
                self._lock.notify_all()
        with self._lock:
            known = self._gen.get(k, 0)
        if stored == known:
            return False
        try:
            self.engine.unbind_session(k)
        except FailedPrecondition:
            return False  # a turn of it runs here: its write meets the newer state
        with self._lock:
            sv = self._store_ver.get(k)
            unsaved = sv is None or sv[0] != self._ver.get(k)
            self._drop_local(k)
        name = self._display(k)
        if unsaved:
            msg = (f"session {name!r} was continued by another replica: the store holds "
                   f"generation {stored}, this replica's copy continued generation {known} "
                   "with turns the store does not have; they are dropped and the next turn "
                   "continues from the store's copy (this turn was not run)")
            self.log.error("session conflict: own turns dropped", extra=log.fields(
                session=name, stored_generation=stored, own_generation=known))
            self.metrics.session_store_writes.labels("conflict").inc()
            raise Aborted(msg)
        self.log.info("session moved on by another replica: continuing from the store",
                      extra=log.fields(session=name, stored_generation=stored,
                                       own_generation=known))
        return True

    def _drop_local(self, k: str) -> None:
        """Under the lock: forgets this replica's copy of session `k` in RAM and what it
        knew of its versions (its slot is unbound by the caller)."""
        for tier in (self._ram, self._staged):
            held = tier.pop(k, None)
            if held is not None:
                if tier is self._ram:
                    self._ram_used -= held.size
                held.deleted = held.writing
        self._answer(self._through.pop(k, None))
        for d in (self._ver, self._store_ver, self._gen, self._chats, self._marks):
            d.pop(k, None)  # type: ignore[attr-defined]
        self._lock.notify_all()

    @staticmethod
    def _display(k: str) -> str:
        key = from_store_name(k)
        return key.name if key is not None else k

    def conversation(self, name: str, deadline: float | None,
                     turn_id: str = "") -> tuple[Message, ...]:
        """The chat conversation the caller's session `name` keeps (empty for a new
        session, or one whose turns were all Generates); when `turn_id` is the session's
        last turn, the conversation before it (the turn is sent again to replace it). A
        session only in the store is read from there, checked, and kept for its coming
        turn's `prepare`, until `forget_read`."""
        k = caller_key(name).store_name
        with self._key_lock(k):  # ordered with deletions, as prepare's reads
            with self._lock:
                kept = self._chats.get(k)
                mark = self._marks.get(k)
                known = (k in self._ver or k in self._ram or k in self._staged
                         or k in self._lost)
            if (kept is not None or known or self.store is None
                    or self.engine.session_resident(k)):
                return _before(kept or (), mark, turn_id)
            t0 = time.perf_counter()
            try:
                prepared = self._read_stored(k, deadline)
            except NotFound:
                return ()
            with self._lock:
                self._peeked[k] = (prepared, 1e3 * (time.perf_counter() - t0))
        return _before(prepared.chat or (), prepared.turn, turn_id)

    def forget_read(self, name: str) -> None:
        """Lets go of what `conversation` read for the turn of `name` (once the turn
        was submitted, or failed before)."""
        with self._lock:
            self._peeked.pop(caller_key(name).store_name, None)

    def _read_stored(self, k: str, deadline: float | None) -> PreparedRestore:
        """Session `k` read from the store, checked (NotFound when absent)."""
        # a copy a stop left in the local fallback is newer than the store's
        source = (self.fallback.store if self.fallback is not None and self.fallback.has(k)
                  else self.store)
        assert source is not None
        return prepare_restore(source, k, self.slots.target_spec, self.slots.draft_spec,
                               deadline)

    def continues(self, k: str, history: tuple[Message, ...],
                  replaces: turn_mark.TurnMark | None = None) -> bool:
        """True when session `k` still keeps the conversation `history` (what an
        `append` Chat's messages were rendered after): before the turn it `replaces`,
        when it replaces one."""
        with self._lock:
            kept = self._chats.get(k, ())
            return (kept[:replaces.chat] if replaces is not None else kept) == history

    def turn_start(self, k: str, turn_id: str,
                   prompt: Sequence[int]) -> turn_mark.TurnMark | None:
        """At a session turn's start (engine thread): the mark of the turn it replaces,
        when `turn_id` names session `k`'s last turn (the request was sent again);
        None otherwise. FailedPrecondition when that turn had another prompt: an id
        names one turn, and replacing it with another would drop it silently."""
        if not turn_id:
            return None
        with self._lock:
            mark = self._marks.get(k)
        if mark is None or mark.id != turn_id:
            return None
        if mark.prompt != turn_mark.prompt_digest(prompt):
            raise FailedPrecondition(
                f"turn_id {turn_id!r} names the last turn of session {self._display(k)!r}, "
                "which had another prompt: an id names one turn (send a new turn with a "
                "new id)")
        return mark

    def mark_turn(self, k: str, turn_id: str, n_tokens: int,
                  replaces: turn_mark.TurnMark | None, prompt: Sequence[int]) -> None:
        """Once a session turn is admitted (engine thread): the turn it replaces is
        dropped from the conversation, and the turn is marked as starting from the
        first `n_tokens` tokens (no mark without an id: such a turn is not replaced).
        The running turn's record keeps what this replaced, for `release`."""
        with self._lock:
            running = self._turns.get(k)
            if running is not None:
                self._turns[k] = dataclasses.replace(
                    running, marked=True, chat=self._chats.get(k), mark=self._marks.get(k))
            if replaces is not None:
                self._set_chat(k, self._chats.get(k, ())[:replaces.chat])
            chat = len(self._chats.get(k, ()))
            self._set_mark(k, turn_mark.TurnMark(turn_id, n_tokens, chat,
                                                 turn_mark.prompt_digest(prompt))
                           if turn_id else None)

    def _set_chat(self, k: str, messages: tuple[Message, ...] | None) -> None:
        """Under the lock: the conversation session `k` keeps (None: none)."""
        if messages:
            self._chats[k] = messages
        else:
            self._chats.pop(k, None)

    def _set_mark(self, k: str, mark: turn_mark.TurnMark | None) -> None:
        """Under the lock: session `k`'s last named turn (None: none)."""
        if mark is not None:
            self._marks[k] = mark
        else:
            self._marks.pop(k, None)

    def _drop_record(self, k: str) -> None:
        """Under the lock: session `k`'s conversation and turn mark, gone with its
        state."""
        self._chats.pop(k, None)
        self._marks.pop(k, None)

    def _keep_reply(self, job: GenJob, reply: str) -> None:
        """At the end of a session's Chat (engine thread): the session keeps the Chat's
        conversation and, after a generation prompt, the reply as the assistant's."""
        p = job.params
        if job.session is None:
            return
        messages = p.messages + ((Message("assistant", reply),) if p.chat_reply else ())
        with self._lock:
            self._set_chat(job.session, messages)

    def release(self, job: Job) -> None:
        """Ends the job's reservation of its session (idempotent). Called when the job
        fails: a turn whose failure emptied its slot leaves the session at the state
        the store holds when that is the state the turn started from; otherwise the
        session's state is lost (see `_state_lost`)."""
        self._unreserve(job)
        k = job.session
        if k is None:
            return
        with self._lock:
            turn = self._turns.get(k)
            if turn is None or turn.job() is not job:
                return
            del self._turns[k]
        if self.engine.session_resident(k):
            if isinstance(job, GenJob) and job.timings.prompt_n == 0:
                # refused before it touched the slot (too long for the context): the
                # session still holds the state the turn started from
                with self._lock:
                    if self._turns.get(k) is None:
                        self._ver[k] = turn.version
        elif not self._held(k):
            self._state_lost(k, turn.version, turn.n_tokens,
                             f"a turn of it failed in slot {job.slot} and emptied the slot",
                             turn)

    def _unreserve(self, job: Job) -> None:
        with self._lock:
            if id(job) in self._reserving and job.session is not None:
                self._reserving.discard(id(job))
                self._reserved[job.session] -= 1
                if self._reserved[job.session] <= 0:
                    del self._reserved[job.session]
                    staged = self._staged.get(job.session)
                    if staged is not None and not staged.writing and not staged.awaiting:
                        del self._staged[job.session]  # the store holds it
                self._lock.notify_all()

    def _held(self, key: str) -> bool:
        with self._lock:
            return key in self._ram or key in self._staged

    def _state_lost(self, k: str, version: int, n_tokens: int, what: str,
                    turn: Turn | None = None) -> None:
        """Session `k`'s state of `version` (n_tokens) is gone from its slot. The store's
        copy is then its newest valid state if it is that very version (with the
        conversation and turn mark the failed `turn` found); otherwise the conversation
        cannot continue: the older copy is removed (by the writer, or by the next turn)
        and the next turn gets DataLoss naming the session."""
        key = from_store_name(k)
        name = key.name if key is not None else k
        with self._lock:
            stored = self._store_ver.get(k)
            if version == 0 or (stored is not None and stored[0] == version):
                # it held nothing yet, or the store holds the state the turn started from
                if version == 0:
                    self._ver.pop(k, None)
                else:
                    self._ver[k] = version
                if turn is not None and turn.marked:
                    self._set_chat(k, turn.chat)
                    self._set_mark(k, turn.mark)
                lost = False
            else:
                self._ver.pop(k, None)
                self._store_ver.pop(k, None)
                self._drop_record(k)
                older = (f"the store held an older state of {stored[1]} tokens, removed "
                         "rather than continued" if stored is not None
                         else "no other copy of it was kept")
                msg = (f"session {name!r} lost its state of {n_tokens} tokens: {what}, "
                       f"and {older}; the conversation must start again (this turn was "
                       "not run; the next one starts a new session of that name)")
                self._lost[k] = msg
                if self.store is not None:
                    self._stale.add(k)
                self._lock.notify_all()
                lost = True
        if lost:
            self.log.error("session state lost", extra=log.fields(
                session=name, n_tokens=n_tokens, reason=what))
        else:
            self.log.warning("session turn failed: it continues from its previous state",
                             extra=log.fields(session=name, n_tokens=n_tokens, reason=what))

    # ------------------------------------------------------------ engine thread

    def enter(self, job: Job) -> None:
        """At a job's start, on the engine thread: moves the displaced session to the
        RAM tier, then brings the job's own session into the slot (from RAM, or read
        from the store by `prepare`; a new session starts empty). Sets the job's
        session timings. DataLoss for a session whose state was lost."""
        t0 = time.perf_counter()
        slot = job.slot
        if job.evict is not None:
            displaced = job.evict
            try:
                self.evict(slot, displaced)
            except Exception as exc:
                self._state_lost(displaced, self._ver.get(displaced, 0),
                                 self.owner.n_tokens(slot),
                                 f"moving it out of slot {slot} failed ({exc})")
                raise
            if job.session is None:
                # the slot goes to a request without a session: nothing of the displaced
                # session may stay there
                self.owner.clear(slot)
        if job.session is None:
            return
        k = job.session
        try:
            if job.resident:
                tier = TIER_SLOT
                with self._lock:
                    v0 = self._ver.get(k, 0)
                n0 = self.owner.n_tokens(slot)
            else:
                with self._lock:
                    msg = self._lost.get(k)
                    if msg is not None and k not in self._stale:
                        del self._lost[k]  # reported now
                if msg is not None:
                    raise DataLoss(msg)
                with self._lock:
                    held = self._ram.pop(k, None)
                    if held is not None:
                        self._ram_used -= held.size
                    else:
                        held = self._staged.pop(k, None)
                v0 = held.version if held is not None else 0
                n0 = held.n_tokens if held is not None else 0
            with self._lock:  # from here on the slot holds the turn's state
                self._ver[k] = next(self._versions)
                self._turns[k] = Turn(weakref.ref(job), v0, n0)
            if not job.resident:
                if held is None:
                    self.owner.clear(slot)
                    tier = TIER_NEW
                    with self._lock:
                        self._drop_record(k)
                else:
                    self.slots.load(slot, PreparedRestore(
                        held.parts, held.n_tokens, held.draft, held.draft_note, held.size))
                    tier = held.origin
        finally:
            self._unreserve(job)
        assert isinstance(job, GenJob)
        tm = job.timings
        tm.session_tier = tier
        tm.session_restore_ms += 1e3 * (time.perf_counter() - t0)
        ms = tm.session_restore_ms
        if tier in (TIER_RAM, TIER_STORE):
            label = TIER_LABEL[tier]
            self.metrics.session_restores.labels(label).inc()
            self.metrics.session_restore_seconds.labels(label).observe(ms / 1e3)
        self._gauges()

    def after_turn(self, slot: int, key: str,
                   then: Callable[[], None] | None = None) -> bool:
        """At the end of a session's successful turn (engine thread): with write-through,
        its state is captured for the writer, which stores it in the background (a newer
        turn's state replaces one still waiting, and takes over its held answers).
        `then` (--session-ack-stored): called once that state's write has ended (stored,
        or failed); True when it will be, False when the caller answers at once."""
        if not self.write_through:
            return False
        held = self._capture(slot, key)
        if held is None or held.in_store:
            return False
        with self._lock:
            if self._closed:
                return False
            old = self._through.get(key)
            if old is not None and not old.writing:
                held.then.extend(old.then)  # the newer state holds theirs too
                old.then.clear()
            if then is not None:
                held.then.append(then)
            self._through[key] = held
            self._lock.notify_all()
        return then is not None

    @staticmethod
    def _answer(held: Held | None) -> None:
        """Sends the answers held back for a state (its write ended, or it was dropped)."""
        if held is None:
            return
        thens, held.then = held.then, []
        for fn in thens:
            fn()

    def evict(self, slot: int, key: str) -> None:
        """Captures the slot's state as session `key` into the RAM tier (engine thread).
        An empty slot holds nothing to keep."""
        held = self._capture(slot, key)
        if held is not None:
            self._put(held)
            self.metrics.session_evictions.labels("slot_to_ram").inc()

    def _capture(self, slot: int, key: str) -> Held | None:
        """The slot's state as session `key` (engine thread); None when it is empty."""
        owner = self.owner
        if owner.n_tokens(slot) == 0:
            return None
        state = owner.capture(slot)
        size = len(state.target) + (len(state.draft) if state.draft is not None else 0)
        with self._lock:
            version = self._ver.get(key, 0)
            chat = self._chats.get(key)
            turn = self._marks.get(key)
            stored = version != 0 and self._store_ver.get(key, (0, 0))[0] == version
        return Held(key, state.target_parts(), state.draft, "", state.n_tokens,
                    size, self.engine.slot_last_used_ms(slot), TIER_RAM, version=version,
                    raw_target=state.target, chat=chat, turn=turn, in_store=stored)

    def _put(self, held: Held) -> None:
        """Puts a session captured from its slot (engine thread) into the RAM tier when it
        fits. When it does not, it waits outside the tier, where a turn of it finds it,
        and the writer makes room (`_make_room`): the least recently used sessions there
        go to the store first, then it comes in; when that cannot make room, it goes to
        the store itself. So the tier never holds more than its bound, and the engine
        thread neither encodes nor waits for the store: the other slots keep decoding
        while the writer works."""
        with self._lock:
            old = self._ram.pop(held.key, None)
            if old is not None:
                self._ram_used -= old.size
                old.deleted = old.writing  # an older write in flight must not land last
            if self._ram_used + held.size <= self.ram_bytes:
                self._ram[held.key] = held
                self._ram_used += held.size
            else:
                held.awaiting = True
                self._staged[held.key] = held
                self._awaiting.append(held)
            self._lock.notify_all()
        self._gauges()

    def _make_room(self, held: Held) -> bool:
        """On the writer: brings a session that waits outside the tier in, after writing
        the least recently used sessions there (none a waiting turn needs) to the store
        until it fits; when they cannot make room (or the store failed a write less than
        SPILL_RETRY_S ago), it is written to the store itself. Only when the store does
        not take it is it kept in the tier beyond the bound (logged; retried), rather
        than lost. False when a write failed."""
        deadline = time.monotonic() + STORE_WRITE_S
        with self._lock:
            if self._staged.get(held.key) is not held:  # a turn took it, or it was deleted
                held.awaiting = False
                self._lock.notify_all()
                return True
            need = self._ram_used + held.size - self.ram_bytes
            victims: list[Held] = []
            if need > 0 and held.size <= self.ram_bytes and not self._store_failing():
                free = sorted((h for h in self._ram.values()
                               if not h.writing and self._reserved[h.key] <= 0),
                              key=lambda h: h.last_used_ms)
                for h in free:
                    if need <= 0:
                        break
                    victims.append(h)
                    need -= h.size
                if need > 0:
                    victims = []  # they would not make room: the session goes down itself
            for h in victims:
                h.writing = True
        ok = all([self._spill(h, deadline) for h in victims])
        with self._lock:
            if self._staged.get(held.key) is not held:
                held.awaiting = False
                self._lock.notify_all()
                return ok
            fits = self._ram_used + held.size <= self.ram_bytes
            direct = not fits and not self._store_failing()
            if fits or not direct:
                held.awaiting = False
                del self._staged[held.key]
                self._ram[held.key] = held  # beyond the bound when it does not fit
                self._ram_used += held.size
            else:
                held.writing = True  # still awaiting: the stop saves it if it must
            self._lock.notify_all()
        kept = not fits and not direct
        if direct:
            stored = self._spill(held, deadline)
            with self._lock:
                held.awaiting = False
                kept = not stored and self._staged.get(held.key) is held  # no turn took it
                if kept:
                    del self._staged[held.key]
                    self._ram[held.key] = held
                    self._ram_used += held.size
                self._lock.notify_all()
            ok = ok and stored
        if kept:
            self.log.warning("session kept in RAM beyond --session-ram-mb: the store did "
                             "not take it", extra=log.fields(
                                 session=held.key, ram_used=self._ram_used,
                                 ram_bytes=self.ram_bytes))
        self._gauges()
        return ok

    def settle(self, timeout: float) -> bool:
        """Waits until no displaced session waits outside the RAM tier (the writer has
        brought each in, or stored it); False when `timeout` seconds passed first."""
        end = time.monotonic() + timeout
        with self._lock:
            while self._awaiting or any(h.awaiting for h in self._staged.values()):
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(left)
        return True

    def _store_failing(self) -> bool:
        """Under the lock: the store failed a write less than SPILL_RETRY_S ago."""
        return (self._write_failed is not None
                and time.monotonic() - self._write_failed < SPILL_RETRY_S)

    # ------------------------------------------------------------ the writer

    def _spill(self, held: Held, deadline: float | None) -> bool:
        """Writes a session of the RAM tier (or one staged because it did not fit) to the
        store and lets go of it, unless a waiting turn needs it (then it stays staged
        for that turn). False (logged) when the store did not take it: it stays."""
        ok = held.in_store or self._write(held, deadline)
        k = held.key
        with self._lock:
            held.writing = False
            if ok:
                wanted = self._reserved[k] > 0 and self.store is not None
                if self._ram.get(k) is held:
                    del self._ram[k]
                    self._ram_used -= held.size
                    if wanted:
                        self._staged[k] = held
                elif self._staged.get(k) is held and not wanted:
                    del self._staged[k]
                held.in_store = self.store is not None
            self._lock.notify_all()
        if ok:
            self.metrics.session_evictions.labels(
                "ram_to_store" if self.store is not None else "dropped").inc()
        self._gauges()
        return ok

    def _next_to_write(self) -> Held | None:
        """Under the lock: the least recently used session held beyond the tier's bound
        (kept there because the store did not take it), None when there is none."""
        if self._ram_used <= self.ram_bytes:
            return None
        writing = sum(h.size for h in self._ram.values() if h.writing)
        if self._ram_used - writing <= self.ram_bytes:
            return None
        free = [h for h in self._ram.values()
                if not h.writing and self._reserved[h.key] <= 0]
        return min(free, key=lambda h: h.last_used_ms, default=None)

    def _count_stored(self) -> None:
        """The sessions the store holds at start (the store gauge), listed off the start's
        path: an unreachable store must not hold the start up."""
        if self.store is None:
            return
        try:
            found = {r.key.store_name for r in list_stored(self.store)}
        except Exception as exc:  # noqa: BLE001 - a count only
            self.log.info("sessions in the store not counted", extra=log.fields(
                error=str(exc)))
            return
        with self._lock:
            self._in_store |= found
        self._gauges()
        if not self.store.describe().startswith("local:") and not self._conditional_store():
            self.log.warning(
                f"the store {self.store.describe()} keeps no generations (an older snapshot "
                "service, or a store without conditional writes): replicas sharing it can "
                "overwrite each other's sessions", extra=log.fields(store=self.store.describe()))

    def _write_loop(self) -> None:
        """Moves the sessions a stop left in the local fallback to the store (retried
        while it is down), removes the older store copies of sessions whose state was
        lost, and retries the sessions the store did not take."""
        self._count_stored()
        fallback_left = not self._upload_fallback()
        while True:
            with self._lock:
                if self._closed:
                    return
                stale = next(iter(self._stale), None)
                failing = self._store_failing()  # then its pause is kept
                # a session waiting outside the tier first: it is beyond the bound
                awaiting = (self._awaiting.popleft() if stale is None and self._awaiting
                            else None)
                through = (next(iter(self._through.values()), None)
                           if stale is None and awaiting is None and not failing else None)
                if through is not None:
                    through.writing = True
                held = (self._next_to_write() if stale is None and not failing
                        and awaiting is None and through is None else None)
                if held is not None:
                    held.writing = True
                elif stale is None and awaiting is None and through is None:
                    self._lock.wait(SPILL_RETRY_S if fallback_left or failing else None)
                    if fallback_left and not self._closed:
                        fallback_left = not self._upload_fallback()
                    continue
            if stale is not None:
                ok = self._remove_stale(stale, None)
            elif awaiting is not None:
                ok = self._make_room(awaiting)
            elif through is not None:
                ok = self._write_through(through)
            else:
                assert held is not None
                ok = self._spill(held, None)
            if not ok:  # a pause, but for a session waiting for room (kept at once)
                until = time.monotonic() + SPILL_RETRY_S
                with self._lock:
                    while (not self._closed and not self._awaiting
                           and (left := until - time.monotonic()) > 0):
                        self._lock.wait(left)

    def _write_through(self, held: Held) -> bool:
        """Stores a turn's end state captured by `after_turn`; it stays waiting (for a
        retry) when the store did not take it and no newer state replaced it."""
        ok = self._write(held, time.monotonic() + STORE_WRITE_S)
        with self._lock:
            held.writing = False
            if ok and self._through.get(held.key) is held:
                del self._through[held.key]
            self._lock.notify_all()
        self._answer(held)  # stored, or not this time: the turn's answer goes out
        if ok:
            self.metrics.session_store_writes.labels("write_through").inc()
        return ok

    def _upload_fallback(self) -> bool:
        """Copies each session the local fallback holds into the store and removes it
        there; True when none is left to copy. One this replica has taken up meanwhile
        (read, resident, held, lost) is left alone: its newer state replaces both
        copies when it is written to the store."""
        fb, store = self.fallback, self.store
        if fb is None or store is None:
            return True
        try:
            names = [i.name for i in fb.store.list(SESSION_PREFIX)]
        except Exception as exc:  # noqa: BLE001 - retried
            self.log.warning("local fallback of the sessions not readable", extra=log.fields(
                fallback=fb.describe(), error=str(exc)))
            return False
        for k in names:
            if from_store_name(k) is None:
                continue
            with self._key_lock(k):  # no turn reads it while it moves
                with self._lock:
                    if self._closed:
                        return True
                    taken = (k in self._ver or k in self._ram or k in self._staged
                             or k in self._lost)
                if taken or self.engine.session_resident(k):
                    continue
                try:
                    stored = fb.store.load(k)
                    store.save(k, stored.target, stored.draft)
                except Exception as exc:  # noqa: BLE001 - kept locally, retried
                    self.log.info("session fallback upload failed, kept locally",
                                  extra=log.fields(session=k, fallback=fb.describe(),
                                                   error=str(exc)))
                    return False
                fb.discard(k)
                with self._lock:
                    self._in_store.add(k)
            self.log.info("session fallback uploaded", extra=log.fields(
                session=k, store=store.describe()))
        return True

    def _remove_stale(self, k: str, deadline: float | None) -> bool:
        """Deletes the older store copy of a session whose state was lost."""
        try:
            self._delete_stored(k, deadline)
        except Exception as exc:  # noqa: BLE001 - retried; turns get DataLoss meanwhile
            self.log.warning("older copy of a lost session not removed from the store",
                             extra=log.fields(session=k, error=str(exc)))
            return False
        with self._lock:
            self._stale.discard(k)
        return True

    def _write(self, held: Held, deadline: float | None) -> bool:
        """Stores a session held in RAM; False (logged) when the store did not take it.
        Without a store the session is dropped (True). One write of a session at a
        time, and never one older than the store's copy, so the newest lands last."""
        store = self.store
        if store is None:
            self.log.warning("session dropped: the RAM tier is full and no store is "
                             "configured", extra=log.fields(session=held.key,
                                                            n_tokens=held.n_tokens))
            with self._lock:
                self._drop_record(held.key)  # gone with its state
            return True
        assert held.raw_target is not None
        k = held.key
        with self._lock:
            while k in self._writing or k in self._checking:
                self._lock.wait()
            if self._store_ver.get(k, (0, 0))[0] >= held.version > 0:
                # this state, or a newer one, is there already: writing it again would
                # only move the generation on under another replica's read
                held.in_store = True
                return True
            self._writing.add(k)
        gen: int | None = None
        written = False
        try:
            enc = self._encode(held)
            if self._conditional_store():
                with self._lock:
                    expected = self._gen.get(k, 0)
                gen = store.save_if(k, enc.target, enc.draft, expected,
                                    target_sha256=enc.target_sha256, deadline=deadline)
            else:
                store.save(k, enc.target, enc.draft, target_sha256=enc.target_sha256,
                           deadline=deadline)
            written = True
        except GenerationConflict as exc:
            self._lost_race(held, exc)
            return True  # never written over the newer state: nothing to retry
        except Exception as exc:  # noqa: BLE001 - kept in RAM, retried
            self.log.warning("session not written to the store", extra=log.fields(
                session=k, error=str(exc)))
            with self._lock:
                self._write_failed = time.monotonic()
            return False
        finally:
            with self._lock:
                if written:  # what this replica knows of the store, before it may look
                    self._write_failed = None
                    self._in_store.add(k)
                    if not held.deleted:
                        self._store_ver[k] = (held.version, held.n_tokens)
                        if gen is not None:
                            self._gen[k] = gen
                self._writing.discard(k)
                self._lock.notify_all()
        if self.fallback is not None:
            self.fallback.discard(k)  # older than what the store now holds
        with self._lock:
            undo = held.deleted
        if undo:  # deleted while it was being written: it must not come back
            self._delete_stored(k, deadline)
        return True

    def _lost_race(self, held: Held, exc: GenerationConflict) -> None:
        """A write of session `held.key` found another replica's newer state in the store:
        nothing was written over it. This replica's copy is dropped (the store's is the
        session's from now on); its next turn here gets Aborted naming both generations,
        unless the copy held nothing the store lacks."""
        k = held.key
        name = self._display(k)
        with self._lock:
            sv = self._store_ver.get(k)
            unsaved = held.version != 0 and (sv is None or sv[0] != held.version)
            if self._ram.get(k) is held or self._staged.get(k) is held or \
                    self._through.get(k) is held:
                self._drop_local(k)
            else:
                self._gen.pop(k, None)
            if unsaved:
                self._conflicts[k] = (
                    f"session {name!r} was continued by another replica: writing this "
                    f"replica's state of {held.n_tokens} tokens over generation {exc.expected} "
                    f"found generation {exc.stored} in the store; this replica's turns since "
                    f"generation {exc.expected} are dropped and the next turn continues from "
                    "the store's copy (this turn was not run)")
        self.log.log(logging.ERROR if unsaved else logging.INFO,
                     "session not written: another replica moved it on" + (
                         "; this replica's turns since are dropped" if unsaved else ""),
                     extra=log.fields(session=name, expected_generation=exc.expected,
                                      stored_generation=exc.stored, n_tokens=held.n_tokens))
        self.metrics.session_store_writes.labels("conflict").inc()

    def _encode(self, held: Held) -> EncodedSlot:
        """The slot files of a session's captured state, with its conversation and
        last turn's mark."""
        assert held.raw_target is not None
        extra = (((chat_record.pack(held.chat),) if held.chat else ())
                 + ((turn_mark.pack(held.turn),) if held.turn is not None else ()))
        return encode_slot(held.raw_target, held.draft, self.slots.target_spec,
                           self.slots.draft_spec, extra)

    def _delete_stored(self, key: str, deadline: float | None) -> bool:
        """Removes the session's copies from the store and the local fallback (in that
        order: a store that fails leaves both, for the retry)."""
        if self.store is None:
            return False
        removed = self.store.delete(key, deadline=deadline)
        if self.fallback is not None:
            removed = self.fallback.discard(key) or removed
        with self._lock:
            self._in_store.discard(key)
            self._store_ver.pop(key, None)
            self._gen.pop(key, None)
        return removed

    # ------------------------------------------------------------ list, delete

    def list(self, owner: str | None) -> list[SessionRow]:
        """Every session (of `owner` only, unless None) with its newest tier."""
        rows: dict[SessionKey, SessionRow] = {}
        prefix = SESSION_PREFIX if owner is None else SessionKey(owner, "x").store_name[:-1]
        if self.store is not None:
            for r in list_stored(self.store, prefix):
                rows[r.key] = r
        if self.fallback is not None:  # newer than the store's copies
            for r in list_stored(self.fallback.store, prefix):
                rows[r.key] = r
        with self._lock:
            ram = [(h.key, h.n_tokens, h.last_used_ms) for h in self._ram.values()]
            ram += [(h.key, h.n_tokens, h.last_used_ms) for h in self._staged.values()
                    if h.awaiting]
            lost = set(self._lost)
        for k in lost:  # its older store copy is no state of it
            key = from_store_name(k)
            if key is not None:
                rows.pop(key, None)
        resident = [r for r in self.engine.resident_sessions() if r[0].startswith(prefix)]
        ram = [r for r in ram if r[0].startswith(prefix)]
        # a copy here that another replica has moved on from is no state of the session
        moved = self._moved_elsewhere({r[0] for r in ram} | {r[0] for r in resident})
        for k, n, last in ram:
            key = from_store_name(k)
            if key is not None and k not in moved:
                rows[key] = SessionRow(key, n, TIER_RAM, last)
        for k, n, slot, busy, last in resident:
            key = from_store_name(k)
            if key is not None and k not in moved:
                rows[key] = SessionRow(key, n, TIER_SLOT, last, slot, busy)
        return sorted(rows.values(), key=lambda r: r.key)

    def _moved_elsewhere(self, keys: set[str]) -> set[str]:
        """Of the sessions this replica holds in a slot or in RAM, those another replica
        has written since the state this replica last read or wrote (the store's
        generation, asked with Stat, is another one): the store's copy is then the
        session's, and the next turn here takes it (`_moved_on`). A session this replica
        is writing now, or one the store cannot tell, keeps its row here."""
        if not keys or not self._conditional_store():
            return set()
        assert self.store is not None
        moved = set()
        deadline = time.monotonic() + LIST_STAT_S  # one bound for the listing, not per session
        for k in keys:
            with self._lock:
                if k in self._writing:
                    continue
                known = self._gen.get(k, 0)
            try:
                stored = self.store.generation(k, deadline=deadline)
            except Exception:  # noqa: BLE001 - listed as this replica holds it
                continue
            if stored not in (0, known):
                moved.add(k)
        return moved

    def delete(self, key: SessionKey, deadline: float | None) -> tuple[int, list[int]]:
        """Removes the session from every tier: (tokens of its newest state, the tiers
        it was in). NotFound when it is in none; FailedPrecondition while a turn of it
        runs or waits."""
        k = key.store_name
        with self._key_lock(k):
            n_slot = self.engine.unbind_session(k)  # None: not resident
            tiers: list[int] = []
            n = 0
            if n_slot is not None:
                tiers.append(TIER_SLOT)
                n = n_slot
            with self._lock:
                held = self._ram.pop(k, None)
                if held is not None:
                    self._ram_used -= held.size
                    held.deleted = True
                    tiers.append(TIER_RAM)
                    n = n or held.n_tokens
                staged = self._staged.pop(k, None)
                if staged is not None:
                    staged.deleted = True
                through = self._through.pop(k, None)
                if through is not None:
                    through.deleted = True  # a write in flight is undone
                    self._answer(through)
                self._conflicts.pop(k, None)
                was_lost = self._lost.pop(k, None) is not None
                self._stale.discard(k)
                self._ver.pop(k, None)
                self._drop_record(k)
                self._peeked.pop(k, None)  # read for a turn: it must not come back
                self._turns.pop(k, None)
            if self.store is not None:
                stored = 0
                if not n:  # the fallback's copy is the newer one
                    stores = [self.fallback.store] if self.fallback is not None else []
                    stored = next((r.n_tokens for s in (*stores, self.store)
                                   for r in list_stored(s, k) if r.key == key), 0)
                if self._delete_stored(k, deadline):
                    tiers.append(TIER_STORE)
                    n = n or stored
        self._gauges()
        if not tiers and not was_lost:
            raise NotFound(f"no session {key.name!r}")
        self.log.info("session deleted", extra=log.fields(
            session=key.name, owner=key.owner or None, n_tokens=n,
            tiers=[TIER_LABEL[t] for t in tiers]))
        return n, tiers

    # ------------------------------------------------------------ stop

    def save_all(self, deadline: float | None) -> tuple[int, int]:
        """At stop, once no request runs: every session in a slot or in RAM goes to the
        store (a slot's is then erased, so its auto-save does not keep it too), each
        write ending by `deadline`; one the store does not take goes to the local
        fallback, and once the store failed (or the time is up) the rest go straight
        there. (saved, failed): saved in the store or the fallback; without a store,
        (0, 0): sessions end with the process."""
        with self._lock:
            self._closed = True
            through = list(self._through.values())
            self._through.clear()  # the slots and the RAM tier hold these states, or newer
            self._lock.notify_all()
        for held in through:
            self._answer(held)
        self._writer.join(timeout=30)
        if self.store is None:
            return 0, 0
        saved = failed = to_fallback = 0
        store_down = False

        def save(held: Held) -> None:
            nonlocal saved, failed, to_fallback, store_down
            if deadline is not None and time.monotonic() >= deadline:
                store_down = True
            if not store_down and self._write(held, deadline):
                saved += 1
                return
            store_down = True
            if self._write_fallback(held):
                saved += 1
                to_fallback += 1
            else:
                failed += 1

        with self._lock:
            stale = list(self._stale)
        for k in stale:  # never left to come back at the next start
            if not self._remove_stale(k, deadline):
                self.log.error("older copy of a lost session left in the store",
                               extra=log.fields(session=k))
        # one captured state at a time, outside the RAM tier
        for k, _n, slot, _busy, _last in self.engine.resident_sessions():
            try:
                held = self.engine.call(lambda s=slot, key=k: self._capture(s, key))
            except Exception as exc:  # noqa: BLE001 - one session must not cost the others
                self.log.error("session not saved at stop", extra=log.fields(
                    session=k, error=str(exc)))
                failed += 1
                continue
            if held is not None and not held.in_store:  # else the store holds this state
                save(held)
            self.engine.call(lambda s=slot: self.engine.unbind_slot(s))
        with self._lock:
            todo = [h for h in self._ram.values() if not h.in_store]
            # displaced while the tier was full, and not brought in before the stop
            todo += [h for h in self._staged.values() if h.awaiting and not h.in_store]
        for held in todo:
            save(held)
        self.log.info("sessions saved", extra=log.fields(
            saved=saved, to_fallback=to_fallback, failed=failed))
        return saved, failed

    def _write_fallback(self, held: Held) -> bool:
        """Writes a session to the local fallback at stop (the store did not take it)."""
        fb = self.fallback
        if fb is None:
            self.log.error("session not saved at stop: the store did not take it and "
                           "there is no local fallback", extra=log.fields(session=held.key))
            return False
        assert held.raw_target is not None
        try:
            enc = self._encode(held)
            fb.store.save(held.key, enc.target, enc.draft, target_sha256=enc.target_sha256)
        except Exception as exc:  # noqa: BLE001 - counted as failed
            self.log.error("session not saved at stop, also not to the local fallback",
                           extra=log.fields(session=held.key, fallback=fb.describe(),
                                            error=str(exc)))
            return False
        self.log.warning("session kept in the local fallback: the store did not take it",
                         extra=log.fields(session=held.key, fallback=fb.describe()))
        return True

    def close(self) -> None:
        with self._lock:
            self._closed = True
            through = list(self._through.values())
            self._through.clear()
            self._lock.notify_all()
        for held in through:
            self._answer(held)

    # ------------------------------------------------------------ metrics

    def _gauges(self) -> None:
        """Sessions by the tier of their newest state (the store's: those this replica
        wrote, read or found there at start)."""
        resident = self.engine.resident_keys()
        with self._lock:
            ram = (set(self._ram) | {k for k, h in self._staged.items() if h.awaiting}) - resident
            store = self._in_store - ram - resident
        m = self.metrics.sessions
        m.labels("slot").set(len(resident))
        m.labels("ram").set(len(ram))
        m.labels("store").set(len(store))


# ---------------------------------------------------------------- access

def visible_owner(principal: auth.Principal | None) -> str | None:
    """Whose sessions a caller lists: a user key its own; None (all) otherwise."""
    return None if principal is None or principal.is_admin else principal.key_id


def delete_key(name: str, owner: str, principal: auth.Principal | None) -> SessionKey:
    """The session a DeleteSession names: the caller's own, or for an admin key (or a
    server without keys) the one of `owner`. A user key naming another owner's
    session gets NotFound, as if there were none."""
    key = caller_key(check_session_name(name))
    if owner and owner != key.owner:
        if principal is not None and not principal.is_admin:
            raise NotFound(f"no session {name!r}")
        key = SessionKey(owner, key.name)
    return key
