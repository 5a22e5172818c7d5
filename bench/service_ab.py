"""The inference service before and after a change, measured side by side in lockstep.

    .venv/bin/python bench/service_ab.py --before REV [--after-tree DIR] [--reps 9]
        [--gen 128] [--threads 1] [--model PATH] [--draft PATH|none] [--out FILE]

Checks REV out into a temporary git worktree, builds its native core there (with this
venv) and generates its gRPC stubs; the after side is --after-tree (default: this
checkout, as it is). Each tree's service runs as its own process (`python -m
inference_svc`, cwd and PYTHONPATH its tree) on 127.0.0.1, a free port each, with the
same flags: the model, the draft, 4 slots, --threads, no slot store, no auto-save;
everything else (speculation, the feature head, the context) at each tree's default.

Both are warmed up, then each repetition sends the same work to one service, waits for
it to end, then to the other, alternating which goes first (before/after, after/before,
...); the idle one waits for requests, so only one works at a time:

- one stream: a fixed held-out prompt (bench/prompts.py, --domain, tokenized once here
  and sent as token ids), greedy, --gen tokens, slot 0, no prompt reuse;
- four streams: four concurrent clients, each a different prompt on its own slot.

Per request: the wall time as the client sees it (sending to the last response) and the
service's own timings (prompt_ms, predicted_per_second; the mean over the streams for
four). Both services must generate the same tokens for every request (greedy): if not,
the change altered behaviour and the benchmark fails. Reported: the medians of each side
and the median of the per-pair ratios after/before (wall: below 1 is faster). Two
long-lived processes measured in lockstep see the same load from neighbours, which on a
shared machine moves absolute rates from minute to minute; quote the ratios. The last
line printed is one JSON object.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))  # corpus, for the prompts

import argparse  # noqa: E402
import os  # noqa: E402
import shlex  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from typing import Any  # noqa: E402

from machine import cpu_class, cpu_model, emit  # noqa: E402
from prompts import DOMAINS, domain_prompts  # noqa: E402
from service import SLOTS, Service, together  # noqa: E402

from inference_svc.client import InferenceClient, make_request  # noqa: E402
from inference_svc.core import Model  # noqa: E402

SIDES = ("before", "after")


def git(tree: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=tree, check=True, capture_output=True,
                          text=True).stdout.strip()


@contextmanager
def checkout(rev: str) -> Iterator[Path]:
    """REV in a temporary worktree of this repository, its native core built (the build
    WARMSLOT_NATIVE names, release by default) and its gRPC stubs generated; removed
    at the end."""
    tmp = Path(tempfile.mkdtemp(prefix="warmslot-service-ab-"))
    tree = tmp / "tree"
    git(ROOT, "worktree", "add", "--detach", str(tree), rev)
    try:
        env = {**os.environ, "PYTHONPATH": str(tree)}
        variant = os.environ.get("WARMSLOT_NATIVE", "release")
        for step in (["native/build_ffi.py", "--variant", variant], ["tools/gen_proto.py"]):
            subprocess.run([sys.executable, *step], cwd=tree, env=env, check=True,
                           capture_output=True)
        yield tree
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT,
                       capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)


def request(c: InferenceClient, prompt: list[int], n: int, slot: int) -> dict[str, Any]:
    """One greedy streamed request without prompt reuse, speculation at the server's
    default: its tokens, wall seconds and the server's timings."""
    req = make_request(prompt, max_tokens=n, id_slot=slot, cache_prompt=False,
                       temperature=0.0)
    tokens: list[int] = []
    last = None
    t0 = time.perf_counter()
    for r in c.generate_stream(req):
        tokens += r.tokens
        last = r
    wall = time.perf_counter() - t0
    assert last is not None and last.done, "the stream ended without its last response"
    return {"tokens": tokens, "wall_s": wall, "prompt_ms": last.timings.prompt_ms,
            "predicted_per_second": last.timings.predicted_per_second}


def streams(c: InferenceClient, ps: list[list[int]], n: int) -> dict[str, Any]:
    """len(ps) requests at once, one per slot: the wall seconds until all have ended, the
    server's timings (mean over the requests) and each request's tokens."""
    out: list[dict[str, Any]] = [{} for _ in ps]

    def one(i: int) -> None:
        out[i] = request(c, ps[i], n, i)

    wall = together(len(ps), one)
    return {"tokens": [r["tokens"] for r in out], "wall_s": wall,
            "prompt_ms": statistics.fmean(r["prompt_ms"] for r in out),
            "predicted_per_second": statistics.fmean(r["predicted_per_second"] for r in out)}


def tree_commit(tree: Path) -> dict[str, Any]:
    dirty = bool(git(tree, "status", "--porcelain", "--untracked-files=no"))
    return {"commit": git(tree, "rev-parse", "HEAD"), "dirty": dirty}


def summary(rows: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Each side's medians and the medians of the per-pair ratios after/before."""
    keys = ("wall_s", "prompt_ms", "predicted_per_second")
    out: dict[str, Any] = {side: {k: round(statistics.median(r[side][k] for r in rows), 4)
                                  for k in keys} for side in SIDES}
    for k in keys:
        out[f"{k}_after_vs_before"] = round(statistics.median(
            r["after"][k] / r["before"][k] for r in rows), 4)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="git revision of the before side")
    ap.add_argument("--after-tree", type=Path, default=ROOT,
                    help="checkout of the after side (default: this one)")
    ap.add_argument("--model", type=Path,
                    default=ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--draft", default=str(ROOT / "models" / "smollm2-draft.gguf"),
                    help="draft model, or 'none' (the server's default draft is the "
                         "bundled toy pair's, which fits no other target)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--gen", type=int, default=128, help="tokens generated per request")
    ap.add_argument("--domain", choices=DOMAINS, default="code")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    a = ap.parse_args()
    after = a.after_tree.resolve()
    model = a.model.resolve()
    draft = "none" if a.draft == "none" else str(Path(a.draft).resolve())
    with Model.load(model) as m:
        ps = domain_prompts(m.tokenizer, a.domain, SLOTS, a.prompt_tokens)
    if len(ps) < SLOTS:
        raise SystemExit(f"fewer than {SLOTS} {a.domain} prompts of {a.prompt_tokens} tokens")
    flags = ("--model", str(model), "--draft", draft, "--slots", str(SLOTS),
             "--threads", str(a.threads), "--no-auto-save")
    load_before = os.getloadavg()
    with checkout(a.before) as before:
        trees = {"before": before, "after": after}
        commits = {k: tree_commit(t) for k, t in trees.items()}
        svcs: dict[str, Service] = {}
        clients: dict[str, InferenceClient] = {}
        try:
            for k, t in trees.items():
                svcs[k] = Service.of_tree(t, flags)
                clients[k] = InferenceClient(f"127.0.0.1:{svcs[k].port}", timeout=600)
            work = {"one_stream": lambda c: request(c, ps[0], a.gen, 0),
                    "four_streams": lambda c: streams(c, ps, a.gen)}
            for c in clients.values():  # warm-up
                for case in work.values():
                    case(c)
            rows: dict[str, list[dict[str, dict[str, Any]]]] = {case: [] for case in work}
            for rep in range(a.reps):
                for case, run in work.items():
                    row = {k: run(clients[k]) for k in (SIDES if rep % 2 == 0 else SIDES[::-1])}
                    if row["before"]["tokens"] != row["after"]["tokens"]:
                        raise SystemExit(f"{case}, repetition {rep}: before and after generated "
                                         "different tokens (the change altered behaviour)")
                    rows[case].append(row)
        finally:
            for c in clients.values():
                c.close()
            for svc in svcs.values():
                svc.stop()
    result: dict[str, Any] = {
        "bench": "service_ab", "command": shlex.join([sys.executable, *sys.argv]),
        "cpu": cpu_model(), "cpu_class": cpu_class(),
        "kernels": os.environ.get("WARMSLOT_NATIVE", "release"),
        "load_average": {"start": load_before, "end": os.getloadavg()},
        "before": {"rev": a.before, **commits["before"]},
        "after": {"tree": str(after), **commits["after"]},
        "model": model.name, "draft": Path(draft).name, "threads": a.threads,
        "domain": a.domain, "prompt_tokens": [len(p) for p in ps], "gen": a.gen,
        "reps": a.reps, "tokens_equal": True,
        "tokens_generated": {"one_stream": len(rows["one_stream"][0]["after"]["tokens"]),
                             "four_streams": sum(len(t) for t in
                                                 rows["four_streams"][0]["after"]["tokens"])},
    }
    for case, rs in rows.items():
        result[case] = summary(rs)
        s = result[case]
        print(f"{case:12s} wall before {s['before']['wall_s']:.3f} s  after "
              f"{s['after']['wall_s']:.3f} s  after/before {s['wall_s_after_vs_before']:.3f}")
    result["samples"] = {case: [{k: {m: v for m, v in r[k].items() if m != "tokens"}
                                 for k in SIDES} for r in rs] for case, rs in rows.items()}
    emit(result, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
