"""Limits that keep one client from starving the others: streams per API key (the
shared StreamLimit) and the idle timeout of a Put's request stream."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any

from snapshot_svc.clientlib.streams import StreamLimit
from snapshot_svc.errors import DeadlineExceeded

__all__ = ["StreamLimit", "until_idle"]

_END = object()
_POLL_S = 0.5  # how often a blocked reader looks whether the handler gave up


def until_idle(requests: Iterator[Any], idle_s: float, what: str) -> Iterator[Any]:
    """The messages of a request stream, read by a helper thread; raises
    DeadlineExceeded once none has arrived for `idle_s` seconds (the handler then
    gives up the call, its thread and its disk reservation). The helper ends with the
    call: gRPC ends a request stream when the call is over."""
    box: queue.Queue[Any] = queue.Queue(maxsize=2)  # at most two chunks read ahead
    done = threading.Event()  # the handler stopped reading

    def hand_over(item: Any) -> None:
        while not done.is_set():
            try:
                box.put(item, timeout=_POLL_S)
                return
            except queue.Full:
                continue

    def pump() -> None:
        try:
            for msg in requests:
                hand_over(msg)
                if done.is_set():
                    return
        except Exception as exc:  # noqa: BLE001 - handed to the handler's thread
            hand_over(exc)
            return
        hand_over(_END)

    threading.Thread(target=pump, name="stream-reader", daemon=True).start()
    try:
        while True:
            try:
                msg = box.get(timeout=idle_s)
            except queue.Empty:
                raise DeadlineExceeded(f"{what}: no data for {idle_s:g} s, the stream is "
                                       "cancelled (--stream-idle-timeout)") from None
            if msg is _END:
                return
            if isinstance(msg, Exception):
                raise msg
            yield msg
    finally:
        done.set()
