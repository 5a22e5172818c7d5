"""Watching and pausing a running engine in tests: which slots each batched decode step
covered, and the engine thread held while requests queue (so that they are admitted
together in one round)."""

from __future__ import annotations

import threading

import pytest

from inference_svc.core.params import SamplingParams, SpecParams, StepResult
from inference_svc.engine.executor import Engine


def record_step_batches(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """The slots of every step_batch call the engine's decoder makes from now on."""
    calls: list[list[int]] = []
    step_batch = engine.owner.step_batch

    def counted(slots: list[int], samplings: list[SamplingParams], specs: list[SpecParams],
                max_new: list[int]) -> list[StepResult]:
        calls.append(list(slots))
        return step_batch(slots, samplings, specs, max_new)

    monkeypatch.setattr(engine.owner, "step_batch", counted)
    return calls


class EngineHold:
    """Runs a call on the engine thread that waits until `release()`: meanwhile the
    engine admits nothing, so requests submitted now are admitted in one round."""

    def __init__(self, engine: Engine, timeout: float = 30.0) -> None:
        self._held, self._release = threading.Event(), threading.Event()
        self._timeout = timeout
        self._thread = threading.Thread(target=engine.call, args=(self._hold,))
        self._thread.start()
        assert self._held.wait(timeout), "the engine never ran the hold"

    def _hold(self) -> None:
        self._held.set()
        self._release.wait(self._timeout)

    def release(self) -> None:
        self._release.set()
        self._thread.join(self._timeout)
