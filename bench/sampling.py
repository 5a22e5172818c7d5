"""Sampling cost per token against top_k, on a model with a large vocabulary.

    python bench/sampling.py [--vocab 32000] [--tokens 64] [--reps 5]

Writes a small random llama model with `--vocab` tokens (the forward pass is cheap,
so the sampler's share of a step is what moves), then times target-only sampled
steps with top_k 40, n_vocab - 1 and n_vocab (off), interleaved repetition by
repetition, each after the same prefill. Reports the median microseconds per token
and each setting's ratio to top_k 40. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from inference_svc.core import Context, Model  # noqa: E402
from inference_svc.core.speculative import SamplingParams, SpecDecoder  # noqa: E402
from tests.factory import Shape, write_model  # noqa: E402


def step_time(dec: SpecDecoder, prompt: list[int], sp: SamplingParams, n: int) -> float:
    """Seconds per sampled token over n target-only steps after the same prefill."""
    dec.clear(0)
    dec.seed(0, 7)
    dec.prefill(0, prompt, sp)
    t0 = time.perf_counter()
    for _ in range(n):
        dec.step(0, sp, max_new=1)
    return (time.perf_counter() - t0) / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "wide.gguf"
        write_model(path, Shape(n_vocab=args.vocab, n_ctx=args.tokens + 64), seed=3)
        model = Model.load(path)
        ctx = Context(model, n_slots=1, n_ctx=args.tokens + 64, n_threads=1)
        dec = SpecDecoder(ctx)
        prompt = list(range(1, 17))
        settings = {"top_k_40": 40, "top_k_vocab_minus_1": args.vocab - 1, "top_k_off": 0}
        times: dict[str, list[float]] = {k: [] for k in settings}
        for rep in range(args.reps + 1):  # the first round warms up and is dropped
            for name, k in settings.items():
                t = step_time(dec, prompt, SamplingParams(temperature=0.8, top_k=k), args.tokens)
                if rep:
                    times[name].append(t)
        dec.close()
        ctx.close()
        model.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "vocab": args.vocab,
        "tokens": args.tokens,
        "reps": args.reps,
        "us_per_token": {k: round(v * 1e6, 1) for k, v in med.items()},
        "ratio_to_top_k_40": {k: round(v / med["top_k_40"], 3) for k, v in med.items()},
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
