"""`make demo`: a long session survives a restart of the inference service.

    .venv/bin/python tools/demo.py [--turns 4] [--turn-new 850] [--next-new 100]
                                   [--max-tokens 100] [--work-dir var] [--keep]

What it does, all on 127.0.0.1 with free ports and the bundled models (--ctx 4096):

1. starts the snapshot service (data in a fresh directory under --work-dir) and the
   inference service wired to it (`--snapshot-addr`, `--instance-id demo`);
2. builds a session of about 3800 tokens on slot 0 over a few turns (this
   repository's own Python sources as the user's text, speculative decoding at
   temperature 0, each turn's answer kept in the conversation);
3. restarts the inference service: SIGTERM (it saves the slot into the snapshot
   service and exits 0), then starts it again (it restores the slot before SERVING);
4. runs the next turn (the conversation so far plus about 100 new tokens);
5. as the control, starts a third inference service cold, with no store, and sends
   it the same turn: it has to prefill the whole conversation. That is the
   "without restore" row, and its output is the reference for "identical output";
6. prints the before/after table.

Time to first token is measured by the client, from sending the request to the
first streamed token. Every process is stopped on exit, on Ctrl-C and on SIGTERM;
the data directory is removed unless --keep.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from snapshot_svc.testing import ServerProcess  # noqa: E402
from tests.resumekit import (  # noqa: E402
    DRAFT,
    TARGET,
    InferenceProcess,
    Session,
    source_tokens,
    timed_turn,
)

N_CTX = 4096
INSTANCE = "demo"
STOP_TIMEOUT = 60.0


class Stack:
    """The processes this demo started; stopped gracefully (SIGTERM, then SIGKILL)."""

    def __init__(self) -> None:
        self.procs: list[tuple[str, Any]] = []  # (name, subprocess.Popen)

    def add(self, name: str, popen: Any) -> None:
        self.procs.append((name, popen))

    def stop_all(self) -> None:
        # a service interrupted while it was starting was never registered: it goes first
        # (our own children by pid), while the snapshot service it may be reading from runs
        known = {popen.pid for _, popen in self.procs}
        for pid in own_children():
            if pid not in known:
                stop_pid(pid)
        for name, popen in reversed(self.procs):  # inference first, snapshot service last
            if popen.poll() is not None:
                continue
            try:
                popen.send_signal(signal.SIGTERM)
                popen.wait(STOP_TIMEOUT)
            except Exception:
                print(f"  {name} (pid {popen.pid}) did not stop: killing it", file=sys.stderr)
                popen.kill()
                popen.wait(10)


def stop_pid(pid: int) -> None:
    """SIGTERM to a child of ours, SIGKILL after STOP_TIMEOUT; reaps it."""
    try:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return
            time.sleep(0.05)
    except (ProcessLookupError, ChildProcessError):
        pass


def own_children() -> list[int]:
    """The pids of this process's children (Linux /proc; empty elsewhere)."""
    me, out = os.getpid(), []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        if int(fields[1]) == me and fields[0] != "Z":
            out.append(int(entry.name))
    return out


def start_inference(stack: Stack, name: str, *args: str) -> tuple[InferenceProcess, float]:
    t0 = time.perf_counter()
    proc = InferenceProcess("--model", str(TARGET), "--draft", str(DRAFT), "--slots", "1",
                            "--ctx", str(N_CTX), "--threads", str(os.cpu_count() or 2),
                            "--shutdown-grace", "30", *args)
    stack.add(name, proc.proc)
    return proc, 1e3 * (time.perf_counter() - t0)


def stop_inference(proc: InferenceProcess) -> tuple[int, float]:
    t0 = time.perf_counter()
    rc = proc.stop(signal.SIGTERM, timeout=STOP_TIMEOUT)
    return rc, 1e3 * (time.perf_counter() - t0)


def acceptance(t: Any) -> str:
    if not t.draft_n:
        return "-"
    return f"{t.draft_n_accepted}/{t.draft_n} = {t.draft_n_accepted / t.draft_n:.0%}"


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for n, r in enumerate(rows):
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths, strict=True))))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def run(a: argparse.Namespace, work: Path, stack: Stack) -> int:
    def say(msg: str) -> None:
        print(msg, flush=True)

    say(f"data directory: {work}")
    snap = ServerProcess(work / "snapshots")
    stack.add("snapshot service", snap.proc)
    say(f"snapshot service  on {snap.address} (pid {snap.proc.pid})")
    store = ("--snapshot-addr", snap.address, "--instance-id", INSTANCE)

    first, start_ms = start_inference(stack, "inference service (first)", *store)
    say(f"inference service on 127.0.0.1:{first.port} (pid {first.proc.pid}), "
        f"SERVING after {start_ms:.0f} ms")
    text = source_tokens(first, a.turns * a.turn_new + a.next_new)
    turns = [text[i * a.turn_new:(i + 1) * a.turn_new] for i in range(a.turns)]
    next_new = text[a.turns * a.turn_new:]
    session = Session(slot=0, max_tokens=a.max_tokens, n_max=a.n_max, p_min=a.p_min)
    for i, new in enumerate(turns, 1):
        t = session.turn(first, new).timings
        say(f"  turn {i}: {t.prompt_n:4d} new prompt tokens ({t.cache_n} cached), "
            f"{t.predicted_n} generated, draft {acceptance(t)}; "
            f"session {len(session.history)} tokens")
    if len(session.history) + a.next_new + a.max_tokens > N_CTX:
        raise SystemExit(f"the session ({len(session.history)} tokens) leaves no room for the "
                         f"next turn in {N_CTX}: use fewer --turns or a smaller --turn-new")

    say("restart: SIGTERM to the inference service ...")
    rc, stop_ms = stop_inference(first)
    saved = first.records("slot saved")
    if rc != 0 or not saved:
        raise SystemExit(f"the inference service exited {rc} and saved {saved}")
    s = saved[0]
    say(f"  saved {s['filename']}: {s['n_tokens']} tokens, {s['bytes'] / 1e6:.1f} MB "
        f"(target + draft) in {s['ms']:.0f} ms; exit code {rc} after {stop_ms:.0f} ms")
    second, start_ms = start_inference(stack, "inference service (restarted)", *store)
    restored = second.records("slot restored")
    if not restored:
        raise SystemExit(f"nothing was restored: {second.lines[-5:]}")
    r = restored[0]
    say(f"  started again: restored {r['n_tokens']} tokens, {r['bytes'] / 1e6:.1f} MB in "
        f"{r['ms']:.0f} ms (draft: {r['draft_policy']}); SERVING after {start_ms:.0f} ms")

    say(f"next turn: the {len(session.history)}-token conversation + {len(next_new)} new tokens")
    warm = timed_turn(second, session.history + next_new, a.max_tokens, a.n_max, a.p_min)
    stop_inference(second)  # saves the longer session: harmless, the data is the demo's

    say("control: a cold inference service with no store re-prefills the conversation ...")
    control, _ = start_inference(stack, "inference service (control)", "--no-auto-save")
    cold = timed_turn(control, session.history + next_new, a.max_tokens, a.n_max, a.p_min)
    stop_inference(control)

    same = warm.tokens == cold.tokens
    rows = [["next turn, after a restart", "prompt tokens", "cached", "draft prefill",
             "first token", "prefill", "acceptance", "identical"]]
    for label, res, ident in (("without restore (re-prefill)", cold, "reference"),
                              ("with restore", warm, "yes" if same else "NO")):
        t = res.timings
        rows.append([label, str(t.prompt_n), str(t.cache_n), str(t.draft_prompt_n),
                     f"{res.ttft_ms:.0f} ms", f"{t.prompt_ms:.0f} ms", acceptance(t), ident])
    say("")
    say(table(rows))
    say("prompt tokens: processed by the target (draft prefill: by the draft); first token: "
        "client side,\nrequest sent to first streamed token; prefill: the server's prompt_ms; "
        "acceptance: drafted\ntokens the target accepted; identical: output tokens equal to "
        "the re-prefill's.")
    say("")
    speedup = cold.ttft_ms / warm.ttft_ms if warm.ttft_ms else float("inf")
    say(f"time to first token: {speedup:.1f}x faster with restore "
        f"({cold.ttft_ms:.0f} ms -> {warm.ttft_ms:.0f} ms);\nthe restore itself took "
        f"{r['ms']:.0f} ms at start-up, before SERVING.")
    problems = []
    if warm.timings.prompt_n != len(next_new):
        problems.append(f"prompt_n after the restore is {warm.timings.prompt_n}, expected "
                        f"{len(next_new)} (the new tokens only)")
    if not same:
        n = next((i for i, (x, y) in enumerate(zip(warm.tokens, cold.tokens, strict=False))
                  if x != y), min(len(warm.tokens), len(cold.tokens)))
        problems.append(f"the outputs differ from token {n} "
                        f"({len(warm.tokens)} vs {len(cold.tokens)} tokens)")
    for p in problems:
        say(f"PROBLEM: {p}")
    return 1 if problems else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=4, help="turns that build the session")
    ap.add_argument("--turn-new", type=int, default=850, help="new prompt tokens per turn")
    ap.add_argument("--next-new", type=int, default=100,
                    help="new prompt tokens of the turn after the restart")
    ap.add_argument("--max-tokens", type=int, default=100, help="tokens generated per turn")
    ap.add_argument("--n-max", type=int, default=8, help="tokens drafted per step")
    ap.add_argument("--p-min", type=float, default=0.75,
                    help="draft confidence below which drafting stops (the service's default)")
    ap.add_argument("--work-dir", type=Path, default=ROOT / "var",
                    help="parent of the demo's data directory")
    ap.add_argument("--keep", action="store_true", help="keep the data directory")
    a = ap.parse_args()
    for path in (TARGET, DRAFT):
        if not path.exists():
            print(f"missing {path.relative_to(ROOT)}: the bundled models are needed",
                  file=sys.stderr)
            return 2
    a.work_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="demo-", dir=a.work_dir))
    stack = Stack()

    interrupted: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        interrupted.append(signum)
        raise KeyboardInterrupt

    # Ctrl-C also reaches the services (one process group): they stop by themselves, and
    # a call in flight may fail before the KeyboardInterrupt gets here
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    rc = 1
    try:
        rc = run(a, work, stack)
    except KeyboardInterrupt:
        interrupted.append(signal.SIGINT)
    except Exception:
        if not interrupted:  # a real failure: its traceback, after the clean-up
            raise
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C: keep cleaning up
            signal.signal(sig, signal.SIG_IGN)
        stack.stop_all()
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"kept {work}")
    if interrupted:
        print("\ninterrupted: the services were stopped", file=sys.stderr)
        return 130
    return rc


if __name__ == "__main__":
    sys.exit(main())
