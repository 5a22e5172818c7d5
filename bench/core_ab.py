"""The decoding core before and after a change, measured side by side.

    .venv/bin/python bench/core_ab.py --before REV [--reps 7] [--threads 2]

Checks REV out into a temporary git worktree, builds its native core there (with
this venv), then runs the same probe alternately in fresh processes of the two
trees (before, after, after, before, ...): a 512-token prefill, 128 decode steps
after a 128-token prompt, a 4000-token prefill and 64 decode steps at 4000 tokens of
context, on the bundled target. Prints a table and, last, one JSON line with the
medians and the after/before ratios. Absolute rates on a shared 2-core machine move
between runs; the ratios of one interleaved run are the figure to quote.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PROBE = r'''
import json, random, sys, time
sys.path.insert(0, sys.argv[1])
from inference_svc.core.model import Context, Model
threads = int(sys.argv[2])
m = Model.load(sys.argv[1] + "/models/target.gguf")
rnd = random.Random(1)
toks = [rnd.randrange(m.n_vocab) for _ in range(4000)]
out = {}
with Context(m, n_slots=1, n_ctx=4096, n_threads=threads) as c:
    t = time.perf_counter(); c.decode(0, toks[:512])
    out["prefill_512_tps"] = 512 / (time.perf_counter() - t)
    c.truncate(0, 128)
    t = time.perf_counter()
    for i in range(128):
        c.decode(0, [toks[600 + i]])
    out["decode_short_tps"] = 128 / (time.perf_counter() - t)
    c.clear(0)
    t = time.perf_counter(); c.decode(0, toks)
    out["prefill_4000_tps"] = 4000 / (time.perf_counter() - t)
    t = time.perf_counter()
    for i in range(64):
        c.decode(0, [toks[i]])
    out["decode_at_4k_tps"] = 64 / (time.perf_counter() - t)
print(json.dumps(out))
'''


def probe(tree: Path, threads: int) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", PROBE, str(tree), str(threads)], cwd=tree,
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", default="HEAD~1", help="git revision to compare against")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    rev = subprocess.run(["git", "rev-parse", "--short", a.before], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout.strip()
    tmp = Path(tempfile.mkdtemp(prefix="warmslot-ab-"))
    before = tmp / "tree"
    subprocess.run(["git", "worktree", "add", "--detach", str(before), rev], cwd=ROOT,
                   check=True, capture_output=True)
    try:
        # the tree's own build script and sources, this venv's compiler toolchain
        subprocess.run([sys.executable, "native/build_ffi.py", "--variant", "release"],
                       cwd=before, check=True, capture_output=True,
                       env={**os.environ, "PYTHONPATH": str(before)})
        trees = {"before": before, "after": ROOT}
        runs: dict[str, list[dict[str, float]]] = {k: [] for k in trees}
        for rep in range(a.reps):
            for k in (("before", "after") if rep % 2 == 0 else ("after", "before")):
                runs[k].append(probe(trees[k], a.threads))
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(before)], cwd=ROOT,
                       capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
    med = {k: {m: statistics.median(r[m] for r in v) for m in v[0]} for k, v in runs.items()}
    ratio = {m: round(med["after"][m] / med["before"][m], 3) for m in med["after"]}
    for m in med["after"]:
        print(f"{m:18s} before {med['before'][m]:9.0f}  after {med['after'][m]:9.0f}  "
              f"{ratio[m]:.2f}x")
    print(json.dumps({"bench": "core_ab", "before": rev, "reps": a.reps, "threads": a.threads,
                      "median": {k: {m: round(x, 1) for m, x in v.items()}
                                 for k, v in med.items()},
                      "after_vs_before": ratio,
                      "samples": {k: v for k, v in runs.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
