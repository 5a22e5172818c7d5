#!/usr/bin/env python3
"""Runs llama.cpp's own server test suite (tools/server/tests) against this server's
HTTP door, from outside: the suite starts tools/llama_server_shim.py in place of
llama-server and talks to it over HTTP, as it talks to llama-server.

The suite comes pinned from PyPI: the sdist of llama-cpp-python 0.3.36 vendors
llama.cpp with its server tests; it is downloaded (`pip download --no-deps
--no-binary`), its SHA-256 checked, and unpacked under --work. The suite's own two
imports this venv lacks (wget, filelock) are installed there with `pip install
--target`. Nothing of it enters the repository.

    .venv/bin/python tools/llama_server_suite.py --work /tmp/llama-suite [--adapt] \\
        --out docs/results/llama-server-suite.json [pytest selection ...]

Prints and writes one JSON object: the sdist, the command, and every test's outcome
with the first line of its failure. Which tests apply, and why the rest do not, is in
docs/http-api.md.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path

from fetch_model import sha256_file  # run as a script: tools/ is first on the path

ROOT = Path(__file__).resolve().parent.parent
SDIST = "llama_cpp_python-0.3.36.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
TESTS = "llama_cpp_python-0.3.36/vendor/llama.cpp/tools/server/tests"
SUITE_DEPS = ("wget==3.2", "filelock==3.16.1")
# the files of the suite about the OpenAI-compatible API, its response shapes,
# streaming, usage, stop, keys and errors
DEFAULT_SELECTION = ("unit/test_chat_completion.py", "unit/test_security.py",
                     "unit/test_basic.py", "unit/test_completion.py")


def fetch_suite(work: Path) -> Path:
    """The suite's directory under `work`, downloaded, checked and unpacked once."""
    sdist = work / SDIST
    if not sdist.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                        ":all:", "llama-cpp-python==0.3.36", "-d", str(work)], check=True)
    got = sha256_file(sdist)
    if got != SDIST_SHA256:
        raise SystemExit(f"{sdist}: SHA-256 {got}, expected {SDIST_SHA256}")
    tests = work / TESTS
    if not tests.is_dir():
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(TESTS + "/")]
            tar.extractall(work, members=members, filter="data")
    deps = work / "pydeps"
    if not deps.is_dir():
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--target",
                        str(deps), *SUITE_DEPS], check=True)
    return tests


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def outcomes(junit: Path) -> list[dict[str, str]]:
    """Each test case of a JUnit XML report: its id, outcome and first message line."""
    out = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (node.get("message") or "").splitlines()[0][:300] if (
                    node.get("message")) else ""
                break
        name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        out.append({"test": name, "outcome": outcome, "message": message})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, required=True, help="download and scratch directory")
    ap.add_argument("--out", type=Path, help="JSON file to write")
    ap.add_argument("--adapt", action="store_true",
                    help="replace every request's model with the served one "
                         "(tools/llama_suite_adapter.py)")
    ap.add_argument("selection", nargs="*", default=list(DEFAULT_SELECTION),
                    help="pytest selection inside the suite (default: the OpenAI API files)")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    tests = fetch_suite(args.work)
    junit = args.work / "junit.xml"
    env = {**os.environ, "LLAMA_SERVER_BIN_PATH": str(ROOT / "tools" / "llama_server_shim.py"),
           "PORT": str(free_port()),
           "PYTHONPATH": os.pathsep.join([str(args.work / "pydeps"), str(ROOT)])}
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--timeout", "120",
           f"--junitxml={junit}", *args.selection]
    if args.adapt:
        cmd[3:3] = ["-p", "tools.llama_suite_adapter"]
    proc = subprocess.run(cmd, cwd=tests, env=env, stdout=subprocess.DEVNULL)
    results = outcomes(junit)
    summary: dict[str, object] = {
        "suite": f"llama.cpp tools/server/tests as vendored in {SDIST} (sha256 {SDIST_SHA256})",
        "selection": args.selection, "adapted": args.adapt, "pytest_exit": proc.returncode,
        "counts": {k: sum(r["outcome"] == k for r in results)
                   for k in ("passed", "failed", "error", "skipped")},
        "tests": results}
    text = json.dumps(summary, indent=1)
    if args.out is not None:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
