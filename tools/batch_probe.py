"""One batch shape of the core run many times, for a sampling profiler.

    perf record -o OUT .venv/bin/python tools/batch_probe.py --model GGUF --tokens K \\
        [--context 512] [--reps 300] [--threads 1] [--last-logits]
    perf report -i OUT --stdio

Loads the model, fills a slot with a --context-token prompt, then --reps times runs a
K-token batch after it with every token's logits (K = 1: a decode step; K = 5: a
speculative verification; with --last-logits only the last token's, as a prefill does)
and rolls it back, so every repetition does the same work.
Prints the mean time of a batch. The profile's shares of the kernels, times that time,
give each kernel's cost per batch; their growth from K = 1 to K = 5 is the per-token part.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from inference_svc.core.model import Context, Model  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--last-logits", action="store_true",
                    help="only the last token's logits (a prefill), not every token's")
    a = ap.parse_args()
    rnd = random.Random(1)
    with Model.load(a.model) as m, Context(m, n_slots=1, n_ctx=a.context + a.tokens + 8,
                                           n_threads=a.threads, n_batch=512) as c:
        ids = [rnd.randrange(m.n_vocab) for _ in range(a.context + a.tokens)]
        c.decode(0, ids[:a.context])
        n = c.n_tokens(0)
        t0 = time.perf_counter()
        for _ in range(a.reps):
            c.decode(0, ids[a.context:], logits_all=not a.last_logits)
            c.truncate(0, n)
        print(f"{1e3 * (time.perf_counter() - t0) / a.reps:.3f} ms per {a.tokens}-token batch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
