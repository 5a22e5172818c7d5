#!/usr/bin/env python3
"""Starts the inference service as if it were llama.cpp's `llama-server`, so that
llama.cpp's own server test suite (tools/llama_server_suite.py) can drive the HTTP
door from outside: the suite runs `$LLAMA_SERVER_BIN_PATH --port P --host H ...`.

The flags the suite passes are mapped onto ours where they have a meaning here
(port, host, slots, context, sampling defaults, batch, API key); the model flags are
replaced by our default model and draft (or $WARMSLOT_SHIM_MODEL and
$WARMSLOT_SHIM_DRAFT), since the suite's models come
from a model hub this machine cannot reach; every other flag is ignored and named on
stderr. The gRPC port is any free one on 127.0.0.1.

SIGTERM (the suite's stop) is passed on to the service, which stops as it always does.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from types import FrameType

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_DRAFT = ROOT / "models" / "smollm2-draft.gguf"  # the pair `make run` serves
# the suite runs this file by its path (so under whichever python3 is first on PATH):
# the service runs in the project's venv
VENV_PYTHON = ROOT / ".venv" / "bin" / "python"


def llama_flags() -> argparse.ArgumentParser:
    """The llama-server flags that have a counterpart here."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--parallel", "-np", type=int, default=1)
    p.add_argument("--ctx-size", "-c", type=int, default=0)
    p.add_argument("--temp", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--n-predict", "-n", type=int)
    p.add_argument("--batch-size", "-b", type=int)
    p.add_argument("--threads", "-t", type=int)
    p.add_argument("--api-key")
    return p


def served_model() -> str:
    """The model file the service is started with."""
    return os.environ.get("WARMSLOT_SHIM_MODEL", str(DEFAULT_MODEL))


def warmslot_argv(ns: argparse.Namespace, keys_file: Path | None) -> list[str]:
    """The inference service's command line for the parsed llama-server flags."""
    model = served_model()
    draft = os.environ.get("WARMSLOT_SHIM_DRAFT", str(DEFAULT_DRAFT))
    python = str(VENV_PYTHON) if VENV_PYTHON.exists() else sys.executable
    argv = [python, "-m", "inference_svc", "--model", model, "--draft", draft,
            "--host", "127.0.0.1", "--port", "0",
            "--http-host", ns.host, "--http-port", str(ns.port),
            "--slots", str(max(1, ns.parallel)), "--log-level", "warning"]
    if ns.ctx_size > 0:  # llama.cpp's context is shared by its slots; ours is per slot
        argv += ["--ctx", str(max(1, ns.ctx_size // max(1, ns.parallel)))]
    # llama.cpp's -n -1 (or 0) is "until the context ends": our default bound stays
    n_predict = ns.n_predict if ns.n_predict is not None and ns.n_predict > 0 else None
    for value, flag in ((ns.temp, "--temperature"), (ns.seed, "--seed"),
                        (n_predict, "--default-max-tokens"), (ns.batch_size, "--batch"),
                        (ns.threads, "--threads")):
        if value is not None:
            argv += [flag, str(value)]
    if keys_file is not None:
        argv += ["--api-keys", str(keys_file)]
    return argv


def main() -> int:
    ns, ignored = llama_flags().parse_known_args()
    if ignored:
        print(f"llama_server_shim: ignored llama-server flags: {' '.join(ignored)}",
              file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="llama-shim-") as tmp:
        keys_file = None
        if ns.api_key:
            keys_file = Path(tmp) / "keys"
            keys_file.write_text(f"{ns.api_key} user\n")
        proc = subprocess.Popen(warmslot_argv(ns, keys_file), cwd=ROOT)

        def forward(signum: int, _frame: FrameType | None) -> None:
            proc.send_signal(signum)

        signal.signal(signal.SIGTERM, forward)
        signal.signal(signal.SIGINT, forward)
        return proc.wait()


if __name__ == "__main__":
    sys.exit(main())
