"""The 8-bit-activation product (ws_tensor_matmul_q8) against the forward pass's F32-
activation product (ws_tensor_matmul) on the same matrix and the same activations.

    python bench/q8_product.py [--model PATH] [--tensor NAME] [--reps N]

Takes one weight matrix of a GGUF (default: SmolLM2's blk.0.ffn_down.weight, Q4_1),
random activations for 1, 5 and 64 tokens, and times both kernels alternately, each
repetition running every configuration once. Prints the medians and the q8/f32 time
ratios; the last line is one JSON object. Single-threaded (the kernel test entries).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from inference_svc.core.binding import ffi, lib  # noqa: E402
from inference_svc.core.gguf_file import load_gguf  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path,
                   default=ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("--tensor", default="blk.0.ffn_down.weight")
    p.add_argument("--reps", type=int, default=15)
    args = p.parse_args()
    content = load_gguf(args.model)
    t = content.tensors[args.tensor]
    raw = np.ascontiguousarray(t.data)
    rows, cols = t.shape
    c = ffi.new("ws_tensor *")
    buf = ffi.from_buffer("uint8_t[]", raw)
    c.data, c.type, c.rows, c.cols = buf, t.type, rows, cols
    rng = np.random.default_rng(0)
    times: dict[str, list[float]] = {}
    for _ in range(args.reps):
        for nt in (1, 5, 64):
            x = rng.standard_normal((nt, cols)).astype(np.float32)
            out = np.empty((nt, rows), np.float32)
            for kind, fn in (("f32", lib.ws_tensor_matmul), ("q8", lib.ws_tensor_matmul_q8)):
                inner = max(1, 64 // nt)
                t0 = time.perf_counter()
                for _ in range(inner):
                    assert fn(c, ffi.from_buffer("float[]", x), nt,
                              ffi.from_buffer("float[]", out), out.size) == 0
                times.setdefault(f"{kind}_{nt}", []).append((time.perf_counter() - t0) / inner)
    med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    result = {"model": args.model.name, "tensor": args.tensor, "type": t.type_name,
              "rows": rows, "cols": cols, "reps": args.reps, "median_us": med,
              "q8_over_f32": {nt: med[f"q8_{nt}"] / med[f"f32_{nt}"] for nt in (1, 5, 64)}}
    for nt in (1, 5, 64):
        print(f"{nt:3d} tokens: f32 {med[f'f32_{nt}']:9.1f} us  q8 {med[f'q8_{nt}']:9.1f} us",
              file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
