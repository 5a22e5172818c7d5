"""How fast a model the service cannot load is refused.

    .venv/bin/python bench/model_check.py [--reps 3] [--work-dir DIR]

The file: a GGUF of architecture gemma3 with a Gemma-sized vocabulary (262144 tokens,
scores, types, 200000 merges) and one tiny tensor, written once into the work dir.
Interleaved in every repetition:
  - `header_check`: check_model_file, what the service runs before anything else
    (general.architecture from the header);
  - `full_reader`: constructing gguf's GGUFReader, which parses every metadata field
    (the vocabulary included): what had to run before the architecture could be read;
  - `process_to_error`: `python -m inference_svc --model FILE` from exec to its
    `cannot start` line, the time an operator waits;
  - `process_import_floor`: `python -c "import inference_svc.core"`, the interpreter
    and the imports the check needs (numpy, the cffi core): the floor of the above.
Each figure is the median over the repetitions, in seconds. The last line printed is
one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import gguf
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from inference_svc.core import ModelLoadError, check_model_file  # noqa: E402

N_VOCAB = 262144


def write_file(path: Path) -> None:
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_name("vocab-only-gemma3")
    w.add_tokenizer_model("llama")
    w.add_token_list([f"tok{i}" for i in range(N_VOCAB)])
    w.add_token_scores([float(-i) for i in range(N_VOCAB)])
    w.add_token_types([1] * N_VOCAB)
    w.add_token_merges([f"t{i} k{i}" for i in range(200000)])
    w.add_tensor("token_embd.weight", np.zeros((16, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def timed(fn: object) -> float:
    t0 = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - t0


def header_check(path: Path) -> None:
    try:
        check_model_file(path)
    except ModelLoadError:
        return
    raise AssertionError("the file was not refused")


def process_to_error(path: Path) -> float:
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "inference_svc", "--model", str(path),
                          "--draft", "none", "--port", "0", "--log-format", "json"],
                         cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                         text=True)
    assert p.stderr is not None
    took = None
    for line in p.stderr:
        if json.loads(line).get("msg") == "cannot start":
            took = time.perf_counter() - t0
            break
    p.wait(120)
    assert took is not None and p.returncode == 1
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--work-dir", type=Path, default=None)
    a = ap.parse_args()
    work = a.work_dir or Path(tempfile.mkdtemp(prefix="warmslot-model-check-"))
    work.mkdir(parents=True, exist_ok=True)
    path = work / "gemma3-vocab.gguf"
    if not path.exists():
        write_file(path)
    runs: dict[str, list[float]] = {k: [] for k in (
        "header_check", "full_reader", "process_to_error", "process_import_floor")}
    for _ in range(a.reps):
        runs["header_check"].append(timed(lambda: header_check(path)))
        runs["full_reader"].append(timed(lambda: gguf.GGUFReader(str(path), "r")))
        runs["process_to_error"].append(process_to_error(path))
        runs["process_import_floor"].append(timed(lambda: subprocess.run(
            [sys.executable, "-c", "import inference_svc.core"], cwd=ROOT, check=True)))
    med = {k: statistics.median(v) for k, v in runs.items()}
    print(json.dumps({
        "file_mb": round(path.stat().st_size / 1e6, 1), "n_vocab": N_VOCAB, "reps": a.reps,
        "median_s": {k: round(v, 4) for k, v in med.items()},
        "full_reader_vs_header_check": round(med["full_reader"] / med["header_check"]),
        "process_to_error_minus_import_floor_s": round(
            med["process_to_error"] - med["process_import_floor"], 3),
    }))


if __name__ == "__main__":
    main()
