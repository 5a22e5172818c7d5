"""Generates the gRPC stubs of each service's API into its package.

    python tools/gen_proto.py

proto/warmslot/inference/v1/*.proto -> inference_svc/pb/
proto/warmslot/snapshot/v1/*.proto  -> snapshot_svc/pb/

Each service owns the stubs of its own API; a client imports them from there
(the inference service's snapshot client uses snapshot_svc.pb). grpc_tools
writes absolute imports (`import x_pb2`), rewritten here to relative ones.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
TARGETS = {
    ROOT / "proto" / "warmslot" / "inference" / "v1": ROOT / "inference_svc" / "pb",
    ROOT / "proto" / "warmslot" / "snapshot" / "v1": ROOT / "snapshot_svc" / "pb",
}


def generate(src: Path, out: Path) -> list[Path]:
    protos = sorted(src.glob("*.proto"))
    if not protos:
        return []
    out.mkdir(parents=True, exist_ok=True)
    include = str(Path(protoc.__file__).parent / "_proto")
    args = ["protoc", f"-I{src}", f"-I{include}", f"--python_out={out}", f"--pyi_out={out}",
            f"--grpc_python_out={out}"] + [str(p) for p in protos]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed for {src}")
    names = [p.stem for p in protos]
    for py in out.glob("*_pb2*.py*"):
        text = py.read_text()
        for n in names:
            text = re.sub(rf"^import {n}_pb2 as", f"from . import {n}_pb2 as", text, flags=re.M)
        py.write_text(text)
    (out / "__init__.py").write_text('"""Generated gRPC stubs (tools/gen_proto.py)."""\n')
    return protos


def main() -> int:
    for src, out in TARGETS.items():
        for p in generate(src, out):
            print(f"generated {out.relative_to(ROOT)} from {p.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
