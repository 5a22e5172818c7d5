"""Slot save / restore / erase over the engine and a slot store.

The engine thread only captures or applies core state (fast); encoding,
digests and file I/O run on the caller's thread, so other slots keep
generating meanwhile.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from inference_svc import log
from inference_svc.core.errors import BadStateError
from inference_svc.errors import DataLoss, DeadlineExceeded, FailedPrecondition
from inference_svc.metrics import Metrics
from inference_svc.sessions.names import refuse_session_namespace
from inference_svc.storage.names import validate_name
from inference_svc.storage.slotfile import ModelSpec
from inference_svc.storage.snapshots import (
    PreparedRestore,
    SlotFileBuffers,
    model_spec,
    prepare_restore,
)
from inference_svc.storage.store import SlotStore
from inference_svc.types import DraftPolicy, RestoreResult, SaveResult, check_slot_id

if TYPE_CHECKING:
    from inference_svc.engine.executor import Engine
    from inference_svc.engine.slot_owner import SlotState


def _caller_waits(deadline: float | None, name: str) -> None:
    """Raises DeadlineExceeded once `deadline` has passed: a restore nobody waits for
    any more must not replace the slot's content."""
    if deadline is not None and time.monotonic() >= deadline:
        raise DeadlineExceeded(f"the restore of {name!r} ran past its caller's deadline; "
                               "the slot is unchanged")


class SlotManager:
    def __init__(self, engine: Engine, store: SlotStore | None, draft_policy: str,
                 metrics: Metrics) -> None:
        self.engine = engine
        owner = engine.owner
        kv_type = engine.cfg.kv_type
        self.target_spec: ModelSpec = model_spec(owner.target, owner.n_ctx, kv_type)
        # the sidecar's model: the draft model's, else the feature head's (its state)
        drafter = owner.draft if owner.draft is not None else owner.head
        self.draft_spec: ModelSpec | None = (model_spec(drafter, engine.n_ctx, kv_type)
                                             if drafter is not None else None)
        self.store = store
        self.draft_policy = DraftPolicy.EMPTY if draft_policy == "empty" else DraftPolicy.REPREFILL
        self.metrics = metrics
        self.log = log.get()

    def _need_store(self) -> SlotStore:
        if self.store is None:
            raise FailedPrecondition("no slot store is configured: start the server with "
                                     "--slot-save-path DIR or --snapshot-addr HOST:PORT")
        return self.store

    # ------------------------------------------------------------------ save

    def save(self, id_slot: int, filename: str, time_remaining: float | None = None) -> SaveResult:
        eng = self.engine
        check_slot_id(id_slot, eng.n_slots)
        name = validate_name(filename)
        refuse_session_namespace(name)
        self._need_store()
        t0 = time.perf_counter()
        files = SlotFileBuffers(self.target_spec)
        state = eng.slot_op(id_slot, lambda slot: eng.owner.capture(slot, files.target,
                                                                     files.draft),
                            time_remaining, keep_session=True)
        return self._persist(id_slot, name, files, state, t0)

    def save_on_engine(self, id_slot: int, name: str, *, deadline: float | None = None,
                       store: SlotStore | None = None) -> SaveResult | None:
        """Saves a slot whatever the engine's state (shutdown: it takes no jobs any more,
        but runs calls between units); None when the slot is empty. `store`: another
        store than the configured one (the stop's local fallback); `deadline`
        (time.monotonic()): when a remote store gives up."""
        t0 = time.perf_counter()
        eng = self.engine
        files = SlotFileBuffers(self.target_spec)
        owner = eng.owner
        state = eng.call(lambda: owner.capture(id_slot, files.target, files.draft)
                         if owner.n_tokens(id_slot) else None)
        if state is None:
            return None
        return self._persist(id_slot, validate_name(name), files, state, t0, store=store,
                             deadline=deadline)

    def _persist(self, id_slot: int, name: str, files: SlotFileBuffers, state: SlotState,
                 t0: float, *, store: SlotStore | None = None,
                 deadline: float | None = None) -> SaveResult:
        """Encodes the state captured into `files` in place and writes it (off the
        engine thread)."""
        store = store or self._need_store()
        try:
            enc = files.encode(state.target, state.draft, self.draft_spec)
            n_written = store.save(name, enc.target, enc.draft, target_sha256=enc.target_sha256,
                                   deadline=deadline)
        except BaseException as exc:
            self.metrics.saves.labels("error").inc()
            self.log.warning("slot save failed", extra=log.fields(
                slot=id_slot, filename=name, error=str(exc)))
            raise
        # a store that kept the target alone (a protocol-1 snapshot service) counts
        # only the target's bytes
        draft_saved = enc.draft is not None and n_written > len(enc.target)
        ms = 1e3 * (time.perf_counter() - t0)
        self.metrics.saves.labels("ok").inc()
        self.metrics.save_seconds.observe(ms / 1e3)
        self.metrics.save_bytes.inc(n_written)
        self.log.info("slot saved", extra=log.fields(
            slot=id_slot, filename=name, n_tokens=enc.n_tokens, bytes=n_written,
            draft_saved=draft_saved, store=store.describe(), ms=round(ms, 2)))
        return SaveResult(id_slot, name, enc.n_tokens, n_written, draft_saved, ms,
                          enc.target_sha256)

    # ------------------------------------------------------------------ restore

    def restore(self, id_slot: int, filename: str, time_remaining: float | None = None,
                log_failure: bool = True, store_deadline: float | None = None,
                store: SlotStore | None = None) -> RestoreResult:
        """Replaces the slot's content with the saved one. Every check (name, file found,
        digest, version, model, fit) runs before the slot is touched, so a failed check
        leaves the slot as it was; only a failure while applying leaves it empty. The
        caller waits `time_remaining` seconds: the store is given that long (and at most
        until `store_deadline`, time.monotonic()), and once it has passed the caller has
        given up, so the slot is left as it is (DeadlineExceeded). `store`: another store
        than the configured one (the local fallback)."""
        eng = self.engine
        check_slot_id(id_slot, eng.n_slots)
        t0 = time.perf_counter()
        deadline = None if time_remaining is None else time.monotonic() + time_remaining
        load_by = min((d for d in (deadline, store_deadline) if d is not None), default=None)
        name = filename
        try:
            name = validate_name(filename)
            refuse_session_namespace(name)
            prepared = prepare_restore(store or self._need_store(), name, self.target_spec,
                                       self.draft_spec, load_by)

            def apply(slot: int) -> tuple[DraftPolicy, str]:
                _caller_waits(deadline, name)  # on the engine thread, just before
                return self.load(slot, prepared)

            _caller_waits(deadline, name)
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            policy, note = eng.slot_op(id_slot, apply, left)
        except BaseException as exc:
            self.metrics.restores.labels("error", "").inc()
            if log_failure:
                self.log.warning("slot restore failed", extra=log.fields(
                    slot=id_slot, filename=name, error=str(exc)))
            raise
        ms = 1e3 * (time.perf_counter() - t0)
        m = self.metrics
        m.restores.labels("ok", policy.label).inc()
        m.restore_seconds.observe(ms / 1e3)
        m.restore_bytes.inc(prepared.n_read)
        self.log.info("slot restored", extra=log.fields(
            slot=id_slot, filename=name, n_tokens=prepared.n_tokens, bytes=prepared.n_read,
            draft_policy=policy.label, draft_note=note, ms=round(ms, 2)))
        return RestoreResult(id_slot, name, prepared.n_tokens, prepared.n_read,
                             policy is DraftPolicy.SIDECAR, policy, ms, note)

    def load(self, slot: int, prepared: PreparedRestore) -> tuple[DraftPolicy, str]:
        """On the engine thread: loads a checked state into the slot (a restore's, or a
        session's from the RAM tier or the store); the draft policy that applied and
        why the sidecar was not used ("" when it was)."""
        owner = self.engine.owner
        # without a usable sidecar the draft starts empty: at the end of the context
        # ("empty") or at 0, to be re-prefilled by the next speculative request
        offset = prepared.n_tokens if self.draft_policy is DraftPolicy.EMPTY else 0
        try:
            applied = owner.apply(slot, prepared.target_parts, prepared.draft_state, offset)
        except BadStateError as exc:
            raise DataLoss(f"slot file rejected by the decoding core: {exc}") from exc
        if not owner.has_draft and owner.head is None:
            return DraftPolicy.NONE, prepared.draft_note
        if applied.sidecar:
            return DraftPolicy.SIDECAR, ""
        note = (f"draft sidecar rejected by the decoding core: {applied.rejected}"
                if applied.rejected else prepared.draft_note)
        return self.draft_policy, note

    # ------------------------------------------------------------------ erase

    def erase(self, id_slot: int, time_remaining: float | None = None) -> int:
        eng = self.engine
        check_slot_id(id_slot, eng.n_slots)

        n = eng.slot_op(id_slot, eng.owner.clear, time_remaining)
        self.log.info("slot erased", extra=log.fields(slot=id_slot, n_tokens=n))
        return n
