"""Auto-save on stop and auto-restore on start, with everything that must not fit
(issue 7, item 2): each is one warning and a cold start, never a failed start."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import pytest

from snapshot_svc.testing import ServerProcess, free_port
from tests.fixtures.servicekit import model_pair
from tests.resumekit import InferenceProcess, Session

pytestmark = pytest.mark.slow


def args(target: Path, draft: Path | None, *extra: str) -> tuple[str, ...]:
    return ("--model", str(target), "--draft", str(draft) if draft else "none", "--slots", "2",
            "--ctx", "256", "--threads", "1", "--instance-id", "t1", "--shutdown-grace", "5",
            *extra)


@pytest.fixture()
def pairs(tmp_path_factory: pytest.TempPathFactory) -> tuple[tuple[Path, Path], tuple[Path, Path]]:
    base = tmp_path_factory.getbasetemp()
    return model_pair(base), model_pair(base, "other", seed=11)


def saved_session(target: Path, draft: Path, store: Path) -> int:
    """Builds a 2-turn session on slot 0 and stops the service (auto-save)."""
    with InferenceProcess(*args(target, draft, "--slot-save-path", str(store))) as p:
        s = Session(max_tokens=10)
        s.turn(p, list(range(1, 40)))
        s.turn(p, list(range(40, 60)))
        assert p.stop() == 0
        return len(s.history)


def warnings(p: InferenceProcess) -> list[str]:
    return [str(r.get("msg")) for r in p.lines if r.get("level") == "warning"]


def slot_tokens(p: InferenceProcess) -> list[int]:
    return [s.n_tokens for s in p.client.slots()]


def test_restores_after_restart_and_keeps_serving(pairs: tuple, tmp_path: Path) -> None:
    (target, draft), _ = pairs
    n = saved_session(target, draft, tmp_path)
    assert (tmp_path / "auto-t1-slot0").is_file() and (tmp_path / "auto-t1-slot0.drft").is_file()
    assert not (tmp_path / "auto-t1-slot1").exists()  # empty slots are not saved
    with InferenceProcess(*args(target, draft, "--slot-save-path", str(tmp_path))) as p:
        assert slot_tokens(p) == [n, 0]
        assert warnings(p) == []
        assert p.stop() == 0


@pytest.mark.parametrize("store", ["local", "snapshot"])
def test_an_erased_session_stays_erased_after_restarts(pairs: tuple, tmp_path: Path,
                                                       store: str) -> None:
    """Save slot 0 (stop), restart, EraseSlot(0), restart: slot 0 is empty, its old
    auto-save deleted at the second stop, and it stays empty at the third start."""
    (target, draft), _ = pairs
    with contextlib.ExitStack() as stack:
        if store == "local":
            files = tmp_path / "slots"
            store_args: tuple[str, ...] = ("--slot-save-path", str(files))
        else:
            files = tmp_path / "snapshots"
            snap = stack.enter_context(ServerProcess(files))
            store_args = ("--snapshot-addr", snap.address)
        with InferenceProcess(*args(target, draft, *store_args)) as p:
            s = Session(max_tokens=10)
            s.turn(p, list(range(1, 35)))
            assert p.stop() == 0
        n = len(s.history)
        with InferenceProcess(*args(target, draft, *store_args)) as p:
            assert slot_tokens(p) == [n, 0]
            assert p.client.erase(0).n_erased == n
            assert p.stop() == 0
            assert [r["filename"] for r in p.records("auto-save of an empty slot deleted")] \
                == ["auto-t1-slot0"]
            assert p.records("auto-save failed") == []
        if store == "local":
            assert sorted(f.name for f in files.iterdir()) == []
        with InferenceProcess(*args(target, draft, *store_args)) as p:
            assert slot_tokens(p) == [0, 0]
            assert p.records("auto-restore done")[0]["restored"] == 0
            assert p.stop() == 0


def test_other_model_is_a_cold_start(pairs: tuple, tmp_path: Path) -> None:
    (target, draft), (other_t, other_d) = pairs
    saved_session(target, draft, tmp_path)
    with InferenceProcess(*args(other_t, other_d, "--slot-save-path", str(tmp_path))) as p:
        assert slot_tokens(p) == [0, 0]
        assert warnings(p) == ["auto-restore skipped: cold start of the slot"]
        rec = next(r for r in p.lines if r.get("level") == "warning")
        assert "fingerprint" in rec["error"] or "another model" in rec["error"]
        Session(max_tokens=3).turn(p, [5, 6, 7])  # serving
        assert p.stop() == 0


def test_context_too_small_is_a_cold_start(pairs: tuple, tmp_path: Path) -> None:
    (target, draft), _ = pairs
    n = saved_session(target, draft, tmp_path)
    small = list(args(target, draft, "--slot-save-path", str(tmp_path)))
    small[small.index("--ctx") + 1] = str(n - 1)
    with InferenceProcess(*small) as p:
        assert slot_tokens(p) == [0, 0]
        assert warnings(p) == ["auto-restore skipped: cold start of the slot"]


def test_corrupt_file_is_a_cold_start(pairs: tuple, tmp_path: Path) -> None:
    (target, draft), _ = pairs
    saved_session(target, draft, tmp_path)
    f = tmp_path / "auto-t1-slot0"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    with InferenceProcess(*args(target, draft, "--slot-save-path", str(tmp_path))) as p:
        assert slot_tokens(p) == [0, 0]
        assert warnings(p) == ["auto-restore skipped: cold start of the slot"]


def test_draft_from_another_draft_model(pairs: tuple, tmp_path: Path) -> None:
    (target, draft), (_, other_d) = pairs
    n = saved_session(target, draft, tmp_path)
    with InferenceProcess(*args(target, other_d, "--slot-save-path", str(tmp_path))) as p:
        assert slot_tokens(p) == [n, 0]
        assert warnings(p) == ["auto-restore: draft not restored from its sidecar"]
        rec = p.records("slot restored")[0]
        assert rec["draft_policy"] == "reprefill"


def test_unreachable_snapshot_service_starts_cold(pairs: tuple) -> None:
    (target, draft), _ = pairs
    addr = f"127.0.0.1:{free_port()}"  # nothing listens there
    t0 = time.monotonic()
    with InferenceProcess(*args(target, draft, "--snapshot-addr", addr,
                                "--restore-timeout", "6")) as p:
        waited = time.monotonic() - t0
        assert warnings(p) == ["slot store unreachable: starting cold"]
        assert p.records("auto-restore done")[0]["store_unreachable"] is True
        # each attempt is the client's own UNAVAILABLE retries (~3 s), then backoff
        assert len(p.records("slot store unreachable, retrying")) >= 1
        assert 6 <= waited < 30
        # the restore gave up at its deadline, not a whole attempt (~3 s) after it
        given_up = next(r for r in p.lines if r.get("msg") == "slot store unreachable: "
                        "starting cold")
        assert 6.0 <= given_up["waited_s"] < 6.5, given_up
        assert slot_tokens(p) == [0, 0]


def test_no_auto_save_flag(pairs: tuple, tmp_path: Path) -> None:
    (target, draft), _ = pairs
    with InferenceProcess(*args(target, draft, "--slot-save-path", str(tmp_path),
                                "--no-auto-save")) as p:
        Session(max_tokens=3).turn(p, [5, 6, 7])
        assert p.stop() == 0
    assert list(tmp_path.iterdir()) == []


def test_sigterm_while_waiting_for_the_store_stops_at_once(pairs: tuple) -> None:
    """A stop during start-up (here: retrying an unreachable snapshot service) does not
    wait for --restore-timeout."""
    import signal
    import subprocess
    import sys

    from tests.resumekit import ROOT

    (target, draft), _ = pairs
    addr = f"127.0.0.1:{free_port()}"
    proc = subprocess.Popen([sys.executable, "-m", "inference_svc", "--port", "0",
                             "--log-format", "json",
                             *args(target, draft, "--snapshot-addr", addr,
                                   "--restore-timeout", "120")],
                            cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            text=True)
    assert proc.stderr is not None
    for line in proc.stderr:
        if "slot store unreachable, retrying" in line:
            break
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    assert time.monotonic() - t0 < 10
    assert "stopped during start-up" in proc.stderr.read()


class _Clock:
    """Stands in for the time module in autosave: sleeping moves the clock."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


def _unreachable_store(monkeypatch: pytest.MonkeyPatch, cost: float
                       ) -> tuple[_Clock, list[tuple[float, float | None]], object]:
    """A fake clock in autosave and slots whose every restore costs `cost` seconds of
    it, cut at the store deadline it is given (as the snapshot client does), and
    ends Unavailable."""
    from types import SimpleNamespace

    from inference_svc.errors import Unavailable
    from inference_svc.storage import autosave

    clock = _Clock()
    monkeypatch.setattr(autosave, "time", clock)
    attempts: list[tuple[float, float | None]] = []

    def restore(slot: int, name: str, log_failure: bool,
                store_deadline: float | None = None) -> None:
        attempts.append((round(clock.now, 3), store_deadline))
        end = clock.now + cost
        clock.now = end if store_deadline is None else min(end, store_deadline)
        raise Unavailable("connection refused")

    slots = SimpleNamespace(engine=SimpleNamespace(n_slots=2), restore=restore,
                            store=SimpleNamespace(describe=lambda: "snapshot service"))
    return clock, attempts, slots


def test_an_unreachable_store_is_retried_until_the_restore_timeout(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each attempt costs 2.75 s (the client's own retries). After the second (5.7 s)
    the next pause (0.4 s) would pass the 6 s deadline: the last attempt runs at once,
    with the 0.3 s left, and the wait ends at 6 s, not a whole attempt later."""
    from inference_svc.storage import autosave

    clock, attempts, slots = _unreachable_store(monkeypatch, 2.75)
    rep = autosave.restore_all(slots, "t1", 6.0)  # type: ignore[arg-type]
    assert attempts == [(0.0, 6.0), (2.95, 6.0), (5.7, 6.0)]  # slot 1 is not tried
    assert round(clock.now, 3) == 6.0
    assert (rep.restored, rep.cold, rep.store_unreachable) == (0, 2, True)


def test_restore_timeout_0_does_not_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    from inference_svc.storage import autosave

    clock, attempts, slots = _unreachable_store(monkeypatch, 2.75)
    rep = autosave.restore_all(slots, "t1", 0.0)  # type: ignore[arg-type]
    assert attempts == [(0.0, 0.0)]  # told that no time is left
    assert clock.now == 0.0
    assert (rep.restored, rep.cold, rep.store_unreachable) == (0, 2, True)
