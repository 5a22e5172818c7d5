"""Stop benchmark: how long SIGTERM takes, and where the live sessions end up, with the
snapshot service up, down (its process gone) and hung (SIGSTOP).

    .venv/bin/python bench/stop.py [--slots 4] [--tokens 3000] [--reps 1] [-- extra flags]

For each case the inference service (bundled models, `--ctx 4096`, the default
--shutdown-grace, --snapshot-timeout, --auto-save-timeout unless extra flags say
otherwise) holds one idle session of about `--tokens` tokens in every slot; then the
snapshot service is left running, terminated, or frozen, and the inference service
gets SIGTERM. Measured: seconds from SIGTERM to exit, the exit code, and the
`auto-save done` counts (saved in the store, written to the local fallback, lost).
With the store up and down the service is started again (the store still up / still
down) and the slots it restored are counted. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from snapshot_svc.testing import ServerProcess  # noqa: E402
from tests.resumekit import (  # noqa: E402
    DRAFT,
    TARGET,
    InferenceProcess,
    source_tokens,
    timed_turn,  # noqa: E402
)

CASES = ("up", "down", "hung")


def run_case(case: str, a: argparse.Namespace, work: Path) -> dict[str, Any]:
    data, fallback = work / f"snap-{case}", work / f"fallback-{case}"
    with ServerProcess(data) as snap:
        argv = ("--model", str(TARGET), "--draft", str(DRAFT), "--slots", str(a.slots),
                "--ctx", "4096", "--threads", "2", "--instance-id", f"stop-{case}",
                "--snapshot-addr", snap.address, "--fallback-save-path", str(fallback),
                *a.extra)
        with InferenceProcess(*argv) as p:
            prompt = source_tokens(p, a.tokens)
            for slot in range(a.slots):  # each slot its own session (a distinct suffix)
                timed_turn(p, prompt[slot:], 4, 0, 0.0, slot=slot)
            held = [s.n_tokens for s in p.client.slots()]
            if case == "down":
                snap.terminate()
            elif case == "hung":
                os.kill(snap.proc.pid, signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                rc = p.stop(timeout=600)
                took = time.monotonic() - t0
            finally:
                if case == "hung":
                    os.kill(snap.proc.pid, signal.SIGCONT)
            done = p.records("auto-save done")
        out: dict[str, Any] = {
            "case": case, "stop_s": round(took, 2), "exit": rc, "slot_tokens": held,
            "auto_save": {k: done[0][k] for k in ("saved", "to_fallback", "failed")}
            if done else None,
            "fallback_files": sorted(f.name for f in (fallback / f"stop-{case}").iterdir())
            if (fallback / f"stop-{case}").exists() else []}
        if case in ("up", "down"):
            with InferenceProcess(*argv) as p2:
                rep = p2.records("auto-restore done")[0]
                out["restart"] = {"slot_tokens": [s.n_tokens for s in p2.client.slots()],
                                  "restored": rep["restored"],
                                  "from_fallback": rep["from_fallback"]}
                p2.kill()  # no second auto-save: the next case starts clean
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=3000, help="tokens per session (about)")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("extra", nargs="*", help="more inference-service flags (after --)")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="warmslot-stop-", dir=ROOT / "var"
                                 if (ROOT / "var").is_dir() else None))
    results = []
    try:
        for rep in range(a.reps):
            for case in a.cases.split(","):
                r = run_case(case, a, work / f"rep{rep}")
                results.append(r)
                print(f"{case:>5}: stop {r['stop_s']:6.2f} s  exit {r['exit']}  "
                      f"{r['auto_save']}  restart {r.get('restart')}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"bench": "stop", "slots": a.slots, "tokens": a.tokens,
                      "extra_flags": a.extra, "cpus": os.cpu_count(),
                      "loadavg_1m": round(os.getloadavg()[0], 2), "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
