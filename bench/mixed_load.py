"""Mixed load: requests with and without a session on few slots, counting failures.

    .venv/bin/python bench/mixed_load.py [--slots 4] [--clients 32] [--requests 4]
        [--gen 16] [--threads 2] [--waves 2]

SmolLM2-135M-Instruct with its draft (models/), speculative decoding at temperature 0,
the service a real process on 127.0.0.1. `--clients` threads start together and send
`--requests` short requests each, one after the other; the even-numbered clients have a
session of their own (each request continues it), the others none (each request
carries its whole prompt). Every prompt starts with the same chat-template text, so
requests without a session share a prefix with whatever a slot held before, sessions
included. `--waves` runs the whole load again on the same server.

Printed: one JSON object: per wave the requests sent, the failures by status code and
their first messages, and the wall time. A valid request must never fail because of
another: 0 failures expected.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from inference_svc.client import InferenceClient, make_request  # noqa: E402
from tests.resumekit import InferenceProcess  # noqa: E402

MODEL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
DRAFT = ROOT / "models" / "smollm2-draft.gguf"
HEAD = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
        "Hugging Face<|im_end|>\n<|im_start|>user\n")
QUESTIONS = ("What is the capital of France?", "Name a prime number.", "Say hello.",
             "What colour is the sky?", "Count to three.", "Give me a fruit.",
             "What is two plus two?", "Name an animal.")


def prompt(client: int, k: int, session: bool) -> str:
    q = QUESTIONS[(client + k) % len(QUESTIONS)]
    turn = f"{q}<|im_end|>\n<|im_start|>assistant\n"
    if session and k > 0:  # the session holds the conversation so far
        return f"<|im_end|>\n<|im_start|>user\n{turn}"
    return HEAD + turn


def wave(port: int, args: argparse.Namespace, tag: str) -> dict[str, Any]:
    failures: collections.Counter[str] = collections.Counter()
    messages: list[str] = []
    sent = 0
    lock = threading.Lock()
    start = threading.Barrier(args.clients)

    def client(i: int) -> None:
        nonlocal sent
        session = f"{tag}-c{i}" if i % 2 == 0 else None
        with InferenceClient(f"127.0.0.1:{port}", timeout=args.timeout) as c:
            start.wait(60)
            for k in range(args.requests):
                req = make_request(prompt(i, k, session is not None), max_tokens=args.gen,
                                   temperature=0.0, session=session)
                try:
                    list(c.generate_stream(req))
                    code = "OK"
                except grpc.RpcError as exc:
                    code = exc.code().name
                    with lock:
                        if len(messages) < 5:
                            messages.append(f"{code}: {exc.details()}")
                with lock:
                    sent += 1
                    if code != "OK":
                        failures[code] += 1

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(args.timeout * args.requests + 60)
    return {"requests": sent, "failed": sum(failures.values()), "by_code": dict(failures),
            "messages": messages, "seconds": round(time.perf_counter() - t0, 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--gen", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--waves", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=300.0, help="deadline of each request")
    args = ap.parse_args()
    proc = InferenceProcess("--model", str(MODEL), "--draft", str(DRAFT), "--slots",
                            str(args.slots), "--threads", str(args.threads), "--ctx", "1024",
                            "--max-queue", str(4 * args.clients), "--max-queue-wait",
                            str(args.timeout))
    try:
        waves = [wave(proc.port, args, f"w{w}") for w in range(args.waves)]
    finally:
        rc = proc.stop()
    print(json.dumps({"slots": args.slots, "clients": args.clients,
                      "requests_per_client": args.requests, "gen": args.gen,
                      "waves": waves, "server_exit": rc}))
    return 0 if all(w["failed"] == 0 for w in waves) else 1


if __name__ == "__main__":
    sys.exit(main())
