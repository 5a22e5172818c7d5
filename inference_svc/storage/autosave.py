"""Restart-resume: every non-empty slot saved as `auto-<instance>-slot<N>` on stop (and
the auto-save of every empty slot deleted), and restored from there at start-up, before
the service reports SERVING.

A snapshot that does not fit (another model, a context too small, a corrupt file,
a newer format) is one warning and a cold start of that slot, never a failed
start. An unreachable store is retried with backoff for `restore_timeout` seconds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from inference_svc import log
from inference_svc.errors import NotFound, Unavailable
from inference_svc.storage.fallback import Fallback
from inference_svc.storage.slots import SlotManager


def auto_name(instance_id: str, slot: int) -> str:
    return f"auto-{instance_id}-slot{slot}"


@dataclass(frozen=True)
class AutoRestoreReport:
    restored: int  # slots restored
    cold: int  # slots without a usable snapshot
    store_unreachable: bool
    from_fallback: int = 0  # of `restored`: read from the local fallback


@dataclass(frozen=True)
class AutoSaveReport:
    saved: int  # slots saved in the store
    to_fallback: int  # slots written to the local fallback instead
    failed: int  # slots saved nowhere

    @property
    def ok(self) -> bool:
        return self.failed == 0


def restore_all(slots: SlotManager, instance_id: str, restore_timeout: float,
                fallback: Fallback | None = None) -> AutoRestoreReport:
    """Restores each slot N from auto-<instance>-slot<N> where one exists. Every call
    to a remote store is given the same deadline, `restore_timeout` seconds from now:
    an unreachable store is retried with backoff until then, never after (0: the
    snapshot service is not waited for at all; a local directory is read regardless).

    With a `fallback`, its files (written by a stop that could not reach the store)
    are uploaded to the store first, within the same deadline; a slot whose file is
    still there after that (the store is down) is restored from it."""
    logger = log.get()
    start = time.monotonic()
    deadline = start + restore_timeout
    if fallback is not None and slots.store is not None and fallback.pending():
        fallback.upload(slots.store, deadline)
    restored = cold = from_fallback = 0
    unreachable = False
    for slot in range(slots.engine.n_slots):
        name = auto_name(instance_id, slot)
        local = fallback is not None and fallback.has(name)
        delay = 0.2
        while True:
            try:
                if local:
                    assert fallback is not None
                    res = slots.restore(slot, name, log_failure=False, store=fallback.store)
                elif unreachable:
                    raise Unavailable("the store was unreachable for an earlier slot")
                else:
                    res = slots.restore(slot, name, log_failure=False,  # logged here
                                        store_deadline=deadline)
            except NotFound:
                cold += 1
                break
            except Unavailable as exc:
                left = deadline - time.monotonic()
                # the store is retried until the deadline, not past it
                if not unreachable and not local and left > 0:
                    pause = delay if delay < left else 0.0  # else: one last try, at once
                    logger.info("slot store unreachable, retrying", extra=log.fields(
                        slot=slot, filename=name, retry_in_s=round(pause, 3), error=str(exc)))
                    time.sleep(pause)
                    delay = min(delay * 2, 5.0)
                    continue
                if local:  # the fallback directory itself failed: not the store
                    logger.warning("auto-restore skipped: cold start of the slot",
                                   extra=log.fields(slot=slot, filename=name, error=str(exc)))
                    cold += 1
                    break
                if not unreachable:
                    logger.warning("slot store unreachable: starting cold", extra=log.fields(
                        store=slots.store.describe() if slots.store else None,
                        waited_s=round(time.monotonic() - start, 3), error=str(exc)))
                unreachable = True
                cold += 1
                break
            except Exception as exc:  # anything that does not fit: never a failed start
                logger.warning("auto-restore skipped: cold start of the slot", extra=log.fields(
                    slot=slot, filename=name, error=str(exc)))
                cold += 1
                break
            restored += 1  # slots.restore logged tokens, bytes, draft policy and ms
            if local:
                from_fallback += 1
                logger.info("auto-restore from the local fallback", extra=log.fields(
                    slot=slot, filename=name, fallback=fallback.describe() if fallback else None))
            if res.draft_note:
                logger.warning("auto-restore: draft not restored from its sidecar",
                               extra=log.fields(slot=slot, filename=name,
                                                draft_policy=res.draft_policy.label,
                                                reason=res.draft_note))
            break
    return AutoRestoreReport(restored, cold, unreachable, from_fallback)


def save_all(slots: SlotManager, instance_id: str, deadline: float | None = None,
             fallback: Fallback | None = None) -> AutoSaveReport:
    """Saves every non-empty slot in the store, each call ending by `deadline`
    (time.monotonic()). With a `fallback`, a slot the store did not take is written
    there instead, and once the store is found unreachable (or the deadline has
    passed) the remaining slots go straight there; a name saved in the store or whose
    slot is empty has its fallback file removed (it is older than the stop). The
    auto-save of every empty slot is deleted from the store (an earlier stop's, or one
    restored and then erased), so the next start restores exactly what the slots hold."""
    logger = log.get()
    saved = to_fallback = failed = 0
    store_down = False
    for slot in range(slots.engine.n_slots):
        name = auto_name(instance_id, slot)
        error: Exception | None = None
        if store_down or (deadline is not None and time.monotonic() >= deadline):
            error = Unavailable("the store did not answer an earlier save of this stop, or "
                                "its time is up")
        else:
            try:
                res = slots.save_on_engine(slot, name, deadline=deadline)
            except Exception as exc:  # one failed slot must not cost the others
                error = exc
                store_down = isinstance(exc, Unavailable)
            else:  # saved (slots.save_on_engine logged it), or the slot is empty
                saved += res is not None
                if fallback is not None:
                    fallback.discard(name)
                if res is None and slots.store is not None:
                    _delete_stale(slots, slot, name, deadline)
                continue
        if fallback is None:
            logger.error("auto-save failed", extra=log.fields(
                slot=slot, filename=name, error=str(error)))
            failed += 1
            continue
        try:
            res = slots.save_on_engine(slot, name, store=fallback.store)
        except Exception as exc:
            logger.error("auto-save failed, also to the local fallback", extra=log.fields(
                slot=slot, filename=name, error=str(error), fallback_error=str(exc)))
            failed += 1
            continue
        if res is None:
            fallback.discard(name)
            continue
        to_fallback += 1
        logger.warning("auto-save: the store did not take the slot, kept in the local "
                       "fallback", extra=log.fields(slot=slot, filename=name,
                                                    fallback=fallback.describe(),
                                                    error=str(error)))
    return AutoSaveReport(saved, to_fallback, failed)


def _delete_stale(slots: SlotManager, slot: int, name: str, deadline: float | None) -> None:
    """Deletes the auto-save of an empty slot; a failure is logged, not raised (the
    stale copy then comes back at the next start, as an unreachable store's would)."""
    logger = log.get()
    try:
        if slots.store is not None and slots.store.delete(name, deadline=deadline):
            logger.info("auto-save of an empty slot deleted", extra=log.fields(
                slot=slot, filename=name))
    except Exception as exc:
        logger.error("auto-save of an empty slot could not be deleted", extra=log.fields(
            slot=slot, filename=name, error=str(exc)))
