"""The decoding core before and after a change, measured side by side.

    .venv/bin/python bench/core_ab.py --before REV [--reps 7] [--threads 2]
    .venv/bin/python bench/core_ab.py --before REV --model PATH [--reps 16] [--threads 1]

Checks REV out into a temporary git worktree, builds its native core there (with
this venv), then measures both trees. Prints a table and, last, one JSON line with
the medians and the after/before ratios. Absolute rates on a shared 2-core machine
move between runs; the ratios of one interleaved run are the figure to quote.

Without --model: the same probe alternately in fresh processes of the two trees
(before, after, after, before, ...): a 512-token prefill, 128 decode steps after a
128-token prompt, a 4000-token prefill and 64 decode steps at 4000 tokens of context,
on the bundled target (rates, tokens/s).

With --model (any GGUF): one process per tree, each with the model loaded and warmed
for the whole run, and the same calls sent to both in lockstep, alternating which
goes first: a decode step and 2-, 3- and 5-token verifications (every token's logits)
after a 512-token prompt, each rolled back, and a 512-token prefill (times, ms). A process's
memory layout moves its speed by several per cent, a neighbour's load moves it from
minute to minute; lockstep calls in two long-lived processes cancel the second.

Both trees run the build WARMSLOT_NATIVE names (release by default; avx2 measures the
AVX2 kernels on an AVX-512 machine).
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


WORKER = r'''
import random, sys, time
sys.path.insert(0, sys.argv[1])
from inference_svc.core.model import Context, Model
m = Model.load(sys.argv[2])
rnd = random.Random(1)
toks = [rnd.randrange(m.n_vocab) for _ in range(620)]
c = Context(m, n_slots=1, n_ctx=640, n_threads=int(sys.argv[3]), n_batch=512)
c.decode(0, toks[:512])
n = c.n_tokens(0)
def after_prompt(k):
    t = time.perf_counter()
    c.decode(0, toks[600:600 + k], logits_all=True)
    d = time.perf_counter() - t
    c.truncate(0, n)
    return d
def prefill():
    c.truncate(0, 0)
    t = time.perf_counter()
    c.decode(0, toks[:512])
    return time.perf_counter() - t
calls = {"decode_ms": lambda: after_prompt(1), "verify2_ms": lambda: after_prompt(2),
         "verify3_ms": lambda: after_prompt(3), "verify5_ms": lambda: after_prompt(5),
         "prefill_512_ms": prefill}
print("ready", flush=True)
for line in sys.stdin:
    print(1e3 * calls[line.strip()](), flush=True)
'''
CALLS = ("decode_ms", "verify2_ms", "verify3_ms", "verify5_ms", "prefill_512_ms")


def lockstep(trees: dict[str, Path], model: Path, threads: int,
             reps: int) -> dict[str, list[dict[str, float]]]:
    """Each call of CALLS sent to both trees' workers in turn, reps times."""
    procs = {k: subprocess.Popen([sys.executable, "-c", WORKER, str(t), str(model), str(threads)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for k, t in trees.items()}
    try:
        for k, p in procs.items():
            assert p.stdout is not None
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError(f"the {k} worker did not start")
        runs: dict[str, list[dict[str, float]]] = {k: [] for k in trees}
        for rep in range(reps):
            row: dict[str, dict[str, float]] = {k: {} for k in trees}
            for call in CALLS:
                for k in (("before", "after") if rep % 2 == 0 else ("after", "before")):
                    p = procs[k]
                    assert p.stdin is not None and p.stdout is not None
                    p.stdin.write(call + "\n")
                    p.stdin.flush()
                    row[k][call] = float(p.stdout.readline())
            for k in trees:
                runs[k].append(row[k])
        return runs
    finally:
        for p in procs.values():
            if p.stdin:
                p.stdin.close()
            p.wait(timeout=60)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", default="HEAD~1", help="git revision to compare against")
    ap.add_argument("--model", type=Path, help="a GGUF: lockstep calls (see above)")
    ap.add_argument("--reps", type=int, default=None, help="default 7, with --model 16")
    ap.add_argument("--threads", type=int, default=None, help="default 2, with --model 1")
    a = ap.parse_args()
    reps = a.reps or (16 if a.model else 7)
    threads = a.threads or (1 if a.model else 2)
    rev = subprocess.run(["git", "rev-parse", "--short", a.before], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout.strip()
    tmp = Path(tempfile.mkdtemp(prefix="warmslot-ab-"))
    before = tmp / "tree"
    subprocess.run(["git", "worktree", "add", "--detach", str(before), rev], cwd=ROOT,
                   check=True, capture_output=True)
    try:
        # the tree's own build script and sources, this venv's compiler toolchain; the
        # build WARMSLOT_NATIVE selects (both workers inherit it), release by default
        variant = os.environ.get("WARMSLOT_NATIVE", "release")
        subprocess.run([sys.executable, "native/build_ffi.py", "--variant", variant],
                       cwd=before, check=True, capture_output=True,
                       env={**os.environ, "PYTHONPATH": str(before)})
        trees = {"before": before, "after": ROOT}
        if a.model:
            runs = lockstep(trees, a.model.resolve(), threads, reps)
        else:
            runs = {k: [] for k in trees}
            for rep in range(reps):
                for k in (("before", "after") if rep % 2 == 0 else ("after", "before")):
                    runs[k].append(probe(trees[k], threads))
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(before)], cwd=ROOT,
                       capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
    med = {k: {m: statistics.median(r[m] for r in v) for m in v[0]} for k, v in runs.items()}
    ratio = {m: round(med["after"][m] / med["before"][m], 3) for m in med["after"]}
    for m in med["after"]:
        print(f"{m:18s} before {med['before'][m]:9.1f}  after {med['after'][m]:9.1f}  "
              f"{ratio[m]:.3f}x")
    print(json.dumps({"bench": "core_ab", "before": rev, "model": str(a.model or "target.gguf"),
                      "build": os.environ.get("WARMSLOT_NATIVE", "release"),
                      "loadavg_1m": round(os.getloadavg()[0], 2),
                      "reps": reps, "threads": threads,
                      "median": {k: {m: round(x, 2) for m, x in v.items()}
                                 for k, v in med.items()},
                      "after_vs_before": ratio,
                      "samples": {k: v for k, v in runs.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
