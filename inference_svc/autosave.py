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
from inference_svc.slots import SlotManager


def auto_name(instance_id: str, slot: int) -> str:
    return f"auto-{instance_id}-slot{slot}"


@dataclass(frozen=True)
class AutoRestoreReport:
    restored: int  # slots restored
    cold: int  # slots without a usable snapshot
    store_unreachable: bool


def restore_all(slots: SlotManager, instance_id: str, restore_timeout: float) -> AutoRestoreReport:
    """Restores each slot N from auto-<instance>-slot<N> where one exists."""
    logger = log.get()
    deadline = time.monotonic() + restore_timeout
    restored = cold = 0
    unreachable = False
    for slot in range(slots.engine.n_slots):
        name = auto_name(instance_id, slot)
        delay = 0.2
        while True:
            try:
                if unreachable:
                    raise Unavailable("the store was unreachable for an earlier slot")
                res = slots.restore(slot, name, log_failure=False)  # logged here
            except NotFound:
                cold += 1
                break
            except Unavailable as exc:
                left = deadline - time.monotonic()
                if not unreachable and left > 0:  # retried until the deadline, not before it
                    pause = min(delay, left)
                    logger.info("slot store unreachable, retrying", extra=log.fields(
                        slot=slot, filename=name, retry_in_s=round(pause, 3), error=str(exc)))
                    time.sleep(pause)
                    delay = min(delay * 2, 5.0)
                    continue
                if not unreachable:
                    logger.warning("slot store unreachable: starting cold", extra=log.fields(
                        store=slots.store.describe() if slots.store else None,
                        waited_s=restore_timeout, error=str(exc)))
                unreachable = True
                cold += 1
                break
            except Exception as exc:  # anything that does not fit: never a failed start
                logger.warning("auto-restore skipped: cold start of the slot", extra=log.fields(
                    slot=slot, filename=name, error=str(exc)))
                cold += 1
                break
            restored += 1  # slots.restore logged tokens, bytes, draft policy and ms
            if res.draft_note:
                logger.warning("auto-restore: draft not restored from its sidecar",
                               extra=log.fields(slot=slot, filename=name,
                                                draft_policy=res.draft_policy.label,
                                                reason=res.draft_note))
            break
    return AutoRestoreReport(restored, cold, unreachable)


def save_all(slots: SlotManager, instance_id: str) -> bool:
    """Saves every non-empty slot and deletes the auto-save of every empty one (an
    earlier stop's, or one restored and then erased), so the next start restores
    exactly what the slots hold now; True when every save and delete succeeded."""
    logger = log.get()
    ok = True
    for slot in range(slots.engine.n_slots):
        name = auto_name(instance_id, slot)
        try:
            res = slots.save_on_engine(slot, name)
            if res is None and slots.store is not None and slots.store.delete(name):
                logger.info("auto-save of an empty slot deleted", extra=log.fields(
                    slot=slot, filename=name))
        except Exception as exc:  # one failed slot must not cost the others
            logger.error("auto-save failed", extra=log.fields(
                slot=slot, filename=name, error=str(exc)))
            ok = False
            continue
        # slots.save_on_engine logs each save (tokens, bytes, draft, ms)
        del res
    return ok
