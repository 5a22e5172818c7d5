"""Builds the cffi (API, out-of-line) extension for the decoding core.

    python native/build_ffi.py [--variant release|asan|portable]

The declarations come from the one public header, native/warmslot.h, with the
preprocessor lines removed; the compiled module lands in inference_svc/core/.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import sys
from pathlib import Path

from cffi import FFI

ROOT = Path(__file__).resolve().parent.parent
NATIVE = ROOT / "native"
PACKAGE_DIR = ROOT / "inference_svc" / "core"

WARN = ["-std=c11", "-Wall", "-Wextra", "-Werror", "-Wno-unused-parameter"]
# No fast-math and no contraction: the order of every float operation is the
# one written in the source, which is what makes the logits batch-invariant.
NUMERIC = ["-ffp-contract=off", "-fno-fast-math"]
VARIANTS = {
    "release": {"module": "_native", "cflags": ["-O3"], "ldflags": []},
    # the scalar path (no -march): the tests check that it gives the release build's bits
    "portable": {"module": "_native_portable", "cflags": ["-O3"], "ldflags": [],
                 "march": "none"},
    # AVX2 + FMA without AVX-512: on an AVX-512 machine, the tests check it too
    "avx2": {"module": "_native_avx2", "cflags": ["-O3"], "ldflags": [],
             "march": "x86-64-v3"},
    "asan": {
        "module": "_native_asan",
        "cflags": ["-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
                   "-fno-sanitize-recover=undefined"],
        "ldflags": ["-fsanitize=address,undefined"],
    },
}


def arch_flags(forced: str | None = None) -> list[str]:
    """x86-64-v4 (AVX-512) or x86-64-v3 (AVX2 + FMA) when the CPU has it; the C code has
    a scalar path otherwise.

    WARMSLOT_MARCH overrides the choice (an image built for other machines sets it):
    a -march value such as `x86-64-v3`, or `none` for the compiler's default. The
    results are the same bits either way (the scalar path uses fmaf), only slower.
    """
    forced = os.environ.get("WARMSLOT_MARCH") if forced is None else forced
    if forced is not None:
        return [] if forced in ("", "none") else [f"-march={forced}"]
    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    if all(f" {f}" in flags for f in ("avx512f", "avx512bw", "avx512dq", "avx512vl")):
        # VNNI: the 8-bit-activation product's vpdpbusd (exact integer sums, so the
        # bits of the AVX2 and scalar paths)
        return ["-march=x86-64-v4"] + (["-mavx512vnni"] if " avx512_vnni" in flags else [])
    if all(f" {f}" in flags for f in ("avx2", "fma")):
        return ["-march=x86-64-v3"]
    return []


def cdef_from_header(header: Path) -> str:
    """The header without the C++ linkage wrapper and preprocessor lines, except the
    integer constants (`#define WS_X 16`), which cffi understands without suffixes."""
    out = []
    for line in header.read_text().splitlines():
        stripped = line.strip()
        const = re.match(r"#define (WS_\w+)\s+(0x[0-9a-fA-F]+|[0-9]+)u?\b", stripped)
        if const:
            out.append(f"#define {const.group(1)} {const.group(2)}")
            continue
        if stripped.startswith("#") or stripped in ('extern "C" {', "}"):
            continue
        out.append(line)
    return "\n".join(out)


def build(variant: str) -> Path:
    spec = VARIANTS[variant]
    module = f"inference_svc.core.{spec['module']}"
    ffi = FFI()
    ffi.cdef(cdef_from_header(NATIVE / "warmslot.h"))
    ffi.set_source(
        module,
        '#include "warmslot.h"',
        sources=[str(NATIVE / "warmslot.c"), str(NATIVE / "quant.c"),
                 str(NATIVE / "speculative.c"), str(NATIVE / "spm.c")],
        include_dirs=[str(NATIVE)],
        extra_compile_args=WARN + NUMERIC + arch_flags(spec.get("march")) + spec["cflags"],
        extra_link_args=spec["ldflags"],
        libraries=["m", "pthread"],
    )
    tmp = ROOT / "build" / f"ffi-{variant}"
    built = Path(ffi.compile(tmpdir=str(tmp), verbose=False))
    target = PACKAGE_DIR / built.name
    # a new inode, renamed over the old one: processes that have the old library
    # mapped keep it intact (copying over it in place crashes them)
    tmp_target = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    shutil.copy2(built, tmp_target)
    os.replace(tmp_target, target)
    return target


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="release")
    args = parser.parse_args(argv)
    print(f"built {build(args.variant).relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
