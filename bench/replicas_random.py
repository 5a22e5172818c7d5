"""Sessions on two replicas under random routing, restarts and a kill -9: which turns
survive (bench/replicas_random.py).

    .venv/bin/python bench/replicas_random.py [--sessions 16] [--turns 200] [--smollm2]
                                              [--ack-stored]

One snapshot service and two inference replicas (`python -m inference_svc`, one slot
each, write-through on) as processes on 127.0.0.1; the bundled toy models by default
(`--smollm2`: SmolLM2 and its draft). Every turn of a session (1-4 new tokens, 4
generated, greedy) goes to a random replica (seeded). A client moves a session to the
other replica only once the store holds the session's last acknowledged turn (it polls
Stat, at most --wait seconds). At a third of the turns replica a is stopped (SIGTERM)
and started again; at two thirds replica b is killed (SIGKILL) and started again.

Every turn's `cache_n` is compared with the tokens of the session's acknowledged turns:

- continued: equal (the turn continued exactly the acknowledged history);
- errors: the turn failed (its code is counted), e.g. the turns in flight at the kill;
- lost: `cache_n` shorter (acknowledged turns are missing: their write was in flight at
  the kill, or a move went wrong); the session then continues from what the turn found;
- wrong: anything else.

At the end a third replica reads every session from the store: its tokens must equal the
acknowledged history. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from service import Service  # noqa: E402

from inference_svc.client import InferenceClient, make_request  # noqa: E402
from snapshot_svc.client import SnapshotClient  # noqa: E402
from snapshot_svc.clientlib.errors import NotFound  # noqa: E402
from snapshot_svc.testing import ServerProcess  # noqa: E402

WORDS = ("the robot looked at a small red door and then it said that they went home "
         "after a while").split()


def stored_tokens(snap: SnapshotClient, name: str) -> int:
    try:
        return snap.stat(f"session~~{name}").target.meta.n_tokens
    except NotFound:
        return 0


class Replica:
    """One inference process and its client."""

    def __init__(self, args: argparse.Namespace, snap_addr: str, name: str,
                 scratch: Path) -> None:
        ns = argparse.Namespace(ctx=args.ctx, threads=1, n_max=4)
        self.svc = Service(ns, args.target, args.draft, extra=(
            "--slots", "1", "--snapshot-addr", snap_addr, "--instance-id", name,
            "--session-write-through",
            *(("--session-ack-stored",) if args.ack_stored else ()),
            # its own stop fallback, in the run's scratch directory
            "--fallback-save-path", str(scratch / f"fallback-{name}")))
        self.c = InferenceClient(f"127.0.0.1:{self.svc.port}", timeout=60)
        self.c.wait_ready(60)

    def stop(self, sig: int) -> None:
        self.c.close()
        self.svc.p.send_signal(sig)
        self.svc.p.wait(60)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--turns", type=int, default=200, help="turns per session")
    ap.add_argument("--smollm2", action="store_true")
    ap.add_argument("--ack-stored", action="store_true",
                    help="--session-ack-stored: a turn is answered once its state is stored")
    ap.add_argument("--seed", type=int, default=20261203)
    ap.add_argument("--wait", type=float, default=10.0,
                    help="seconds a move waits for the last turn to be stored")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--debug", action="store_true", help="print every turn on stderr")
    args = ap.parse_args()
    models = ROOT / "models"
    args.target, args.draft = ((models / "SmolLM2-135M-Instruct.Q4_1.gguf",
                                models / "smollm2-draft.gguf") if args.smollm2
                               else (models / "target.gguf", models / "draft.gguf"))
    rng = random.Random(args.seed)
    names = [f"r{i}" for i in range(args.sessions)]
    history = dict.fromkeys(names, 0)
    last = dict.fromkeys(names, "")
    counts: collections.Counter[str] = collections.Counter()
    total = args.sessions * args.turns
    events: list[str] = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="replicas-random-") as tmp:
        snap_proc = ServerProcess(Path(tmp) / "snap")
        snap = SnapshotClient(snap_proc.address, timeout=30)
        reps = {r: Replica(args, snap_proc.address, r, Path(tmp)) for r in ("a", "b")}
        vocab = reps["a"].c.tokenize(" ".join(WORDS))
        try:
            for step in range(total):
                if step in (total // 3, 2 * total // 3):
                    r, sig = ("a", signal.SIGTERM) if step == total // 3 else ("b",
                                                                               signal.SIGKILL)
                    reps[r].stop(sig)
                    events.append(f"step {step}: replica {r} {signal.Signals(sig).name}")
                    reps[r] = Replica(args, snap_proc.address, r, Path(tmp))
                name = rng.choice(names)
                r = rng.choice(("a", "b"))
                if last[name] not in ("", r):
                    end = time.monotonic() + args.wait
                    while (stored_tokens(snap, name) != history[name]
                           and time.monotonic() < end):
                        time.sleep(0.01)
                last[name] = r
                prompt = [rng.choice(vocab) for _ in range(rng.randint(1, 4))]
                req = make_request(prompt, max_tokens=4, temperature=0.0, session=name)
                try:
                    rs = list(reps[r].c.generate_stream(req, timeout=60))
                except grpc.RpcError as exc:
                    counts[f"error {exc.code().name}"] += 1
                    continue
                t = rs[-1].timings
                n_out = sum(len(x.tokens) for x in rs)
                if args.debug:
                    print(step, name, r, "cache_n", t.cache_n, "acked", history[name],
                          "tier", t.session_tier, file=sys.stderr)
                if t.cache_n == history[name]:
                    counts["continued"] += 1
                elif t.cache_n < history[name]:
                    counts["lost"] += 1
                else:
                    counts["wrong"] += 1
                history[name] = t.cache_n + len(prompt) + n_out
            for rep in reps.values():
                rep.stop(signal.SIGTERM)
            final = Replica(args, snap_proc.address, "c", Path(tmp))
            end_ok = 0
            for name in names:
                rs = list(final.c.generate_stream(make_request(
                    [vocab[0]], max_tokens=1, temperature=0.0, session=name), timeout=60))
                end_ok += rs[-1].timings.cache_n == history[name]
            final.stop(signal.SIGTERM)
        finally:
            snap.close()
            snap_proc.terminate()
    out = {"sessions": args.sessions, "turns": total, "seed": args.seed,
           "ack_stored": args.ack_stored,
           "models": [args.target.name, args.draft.name], "events": events,
           "outcomes": dict(counts), "sessions_equal_at_the_end": f"{end_ok}/{args.sessions}",
           "seconds": round(time.perf_counter() - t0, 1)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
