"""Restart-resume with real processes and real signals (issue 7).

A ~4000-token session is built over several turns on slot 0 with speculative
decoding at temperature 0; the service gets SIGTERM and saves it; a new process
restores it at start-up; the next turn must process only its new tokens (target
and draft) and produce exactly what a process that never restarted produces,
with the same speculative acceptance.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from snapshot_svc.testing import ServerProcess
from tests.resumekit import DRAFT, TARGET, InferenceProcess, Session, source_tokens

pytestmark = pytest.mark.slow

TURN_NEW = 850  # new prompt tokens per turn
TURNS = 4  # 4 x (850 + 100 generated) = ~3800 tokens, ~4000 after the next turn
FINAL_NEW = 100
COMMON = ("--model", str(TARGET), "--draft", str(DRAFT), "--slots", "2", "--ctx", "4096",
          "--threads", "2", "--instance-id", "resume-test", "--shutdown-grace", "30")


@pytest.fixture(scope="module")
def script() -> Iterator[tuple[list[list[int]], list[int], list[int], object]]:
    """The turns' new tokens, the control's final-turn output and timings (a process
    that never restarts and has no store)."""
    with InferenceProcess(*COMMON, "--no-auto-save") as control:
        toks = source_tokens(control, TURNS * TURN_NEW + FINAL_NEW)
        turns = [toks[i * TURN_NEW:(i + 1) * TURN_NEW] for i in range(TURNS)]
        final_new = toks[TURNS * TURN_NEW:]
        s = Session()
        outputs = [s.turn(control, new).tokens for new in turns]
        final = s.turn(control, final_new)
        assert 3700 <= len(s.history) - len(final.tokens) - FINAL_NEW <= 3800
        yield turns, final_new, final.tokens, final.timings, outputs


@pytest.mark.parametrize("store", ["local", "snapshot"])
def test_session_survives_a_restart(script: tuple, tmp_path: Path, store: str) -> None:
    turns, final_new, control_tokens, control_timings, control_outputs = script
    snap = None
    if store == "local":
        store_args: tuple[str, ...] = ("--slot-save-path", str(tmp_path / "slots"))
    else:
        snap = ServerProcess(tmp_path / "snapshots")
        store_args = ("--snapshot-addr", snap.address)
    try:
        s = Session()
        with InferenceProcess(*COMMON, *store_args) as first:
            outputs = [s.turn(first, new).tokens for new in turns]
            assert outputs == control_outputs
            n_session = len(s.history)
            assert first.stop() == 0  # SIGTERM: drain, save every slot, exit 0
            saved = first.records("slot saved")
            assert [(r["slot"], r["filename"], r["n_tokens"], r["draft_saved"])
                    for r in saved] == [(0, "auto-resume-test-slot0", n_session, True)]
        with InferenceProcess(*COMMON, *store_args) as second:
            restored = second.records("slot restored")
            assert [(r["slot"], r["n_tokens"], r["draft_policy"]) for r in restored] == [
                (0, n_session, "sidecar")]
            done = second.records("auto-restore done")[0]
            assert (done["restored"], done["cold"]) == (1, 1)
            final = s.turn(second, final_new)
            t = final.timings
            assert t.prompt_n == len(final_new)  # not the 4000 before them
            assert t.cache_n == n_session
            assert t.draft_prompt_n == len(final_new)
            assert final.tokens == control_tokens
            assert (t.draft_n, t.draft_n_accepted, t.n_steps) == (
                control_timings.draft_n, control_timings.draft_n_accepted,
                control_timings.n_steps)
            assert t.draft_n_accepted > 0
            assert second.stop() == 0
    finally:
        if snap is not None:
            snap.__exit__()


def test_no_store_no_auto_save(tmp_path: Path) -> None:
    with InferenceProcess(*COMMON) as p:
        Session(max_tokens=4).turn(p, [1, 2, 3])
        assert p.stop() == 0
        assert not p.records("slot saved")
        assert not p.has("auto-restore done")
