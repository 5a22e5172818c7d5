"""The local slot store's pair of files under crashes, and the names it keeps for itself.

A child process saves a pair over an earlier one and is killed (os._exit, no cleanup)
just before its k-th file-system change (rename or unlink), for every k: whatever
step the crash interrupted, the store then reads the old pair or the new one, never a
target with another save's sidecar, and keeps no leftover file."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from inference_svc.errors import InvalidArgument
from inference_svc.storage.store import LocalStore, _name_key

ROOT = Path(__file__).resolve().parent.parent
OLD = (b"T1" * 3000, b"D1" * 300)

CHILD = """
import os, sys
from pathlib import Path
from inference_svc.storage.store import LocalStore, _name_key

directory, crash_at, new_draft = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
store = LocalStore(directory)
store.save("s", b"T1" * 3000, b"D1" * 300)
changes = 0

def crashing(real):
    def change(*args, **kw):
        global changes
        changes += 1
        if changes == crash_at:
            os._exit(9)  # killed just before this change: nothing else runs
        return real(*args, **kw)
    return change

os.replace, os.rename, os.unlink = (crashing(f) for f in (os.replace, os.rename, os.unlink))
store.save("s", b"T2" * 3000, None if new_draft == "none" else new_draft.encode() * 300)
os._exit(0)
"""


def run_child(directory: Path, crash_at: int, new_draft: str) -> int:
    return subprocess.run([sys.executable, "-c", CHILD, str(directory), str(crash_at), new_draft],
                          cwd=ROOT, timeout=60).returncode


@pytest.mark.parametrize("new_draft", ["D2", "none"])
@pytest.mark.parametrize("reader", ["reopened", "open during the crash"])
def test_a_crash_at_any_step_leaves_one_whole_pair(tmp_path: Path, new_draft: str,
                                                   reader: str) -> None:
    new = (b"T2" * 3000, None if new_draft == "none" else new_draft.encode() * 300)
    seen = []
    for crash_at in range(1, 12):
        d = tmp_path / str(crash_at)
        d.mkdir()
        early = LocalStore(d)  # opened before the crash: load() must settle what it finds
        rc = run_child(d, crash_at, new_draft)
        store = LocalStore(d) if reader == "reopened" else early
        got = store.load("s")
        pair = (got.target, got.draft)
        assert pair in (OLD, new), f"crash before change {crash_at}: a mixed pair"
        seen.append(pair == new)
        # nothing pending once the store has read the name; temporary files of the
        # crashed save are swept at the next start-up
        files = sorted(os.listdir(d))
        if reader == "open during the crash":
            files = [f for f in files if not f.startswith(".tmp-")]
        assert files == (["s"] if pair[1] is None else ["s", "s.drft"])
        if rc == 0:
            break
        assert rc == 9
    else:
        pytest.fail("the save never completed")
    # the crash points cover both sides of the commit point
    assert seen[0] is False and seen[-1] is True and len(seen) >= 3


@pytest.mark.parametrize("name", [".tmp-keepme", ".pending-x", "good.drft", "a.drft"])
def test_names_of_the_store_own_files_are_refused(tmp_path: Path, name: str) -> None:
    store = LocalStore(tmp_path)
    store.save("good", b"T", b"D")
    for call in (lambda: store.save(name, b"X", b"Y"), lambda: store.load(name),
                 lambda: store.delete(name)):
        with pytest.raises(InvalidArgument, match="are the local store's own files"):
            call()
    assert sorted(os.listdir(tmp_path)) == ["good", "good.drft"]
    assert (store.load("good").target, store.load("good").draft) == (b"T", b"D")
    LocalStore(tmp_path)  # a restart keeps them
    assert sorted(os.listdir(tmp_path)) == ["good", "good.drft"]


def test_names_starting_with_a_dot_are_settled_at_start_up(tmp_path: Path) -> None:
    """A name starting with '.' that is not reserved is an ordinary name, also when a
    crash left its committed save pending (target renamed, sidecar not yet)."""
    store = LocalStore(tmp_path)
    store.save(".hidden", b"T1", b"D1")
    (tmp_path / ".hidden").write_bytes(b"T2")  # the new target is in place ...
    key = _name_key(".hidden")  # ... its sidecar still pending
    (tmp_path / f".pending-{key}-{hashlib.sha256(b'T2').hexdigest()}").write_bytes(b"D2")
    (tmp_path / f".pending-{key}-{hashlib.sha256(b'T3').hexdigest()}").write_bytes(b"D3")
    LocalStore(tmp_path)
    assert sorted(os.listdir(tmp_path)) == [".hidden", ".hidden.drft"]
    got = store.load(".hidden")
    assert (got.target, got.draft) == (b"T2", b"D2")
