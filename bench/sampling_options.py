"""Cost per token of logprobs and penalties, on SmolLM2-135M-Instruct (49,152 tokens).

    python bench/sampling_options.py [--model PATH] [--tokens 64] [--reps 5]
    valgrind --tool=callgrind --toggle-collect=ws_spec_step \
        .venv/bin/python bench/sampling_options.py --random-vocab 49152 --only logprobs_20 \
        --reps 1 --tokens 16

Times target-only sampled steps (temperature 0.8, top_k 40, the same seed and the same
chat prompt) with nothing else, with logprobs 20, and with penalties over the last 64
and the last 4,096 tokens, interleaved repetition by repetition (the first round warms
up and is dropped); every setting decodes the same number of tokens at the same
context lengths. Reports median microseconds per token and each setting's ratio to
the plain one. --random-vocab N: a small random model with an N-token vocabulary and
a fixed prompt instead (the sampler's share of a step is then what moves); --only NAME:
that setting alone (for an instruction count under callgrind). The last line printed
is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from sampling import step_time  # noqa: E402

from inference_svc.chat import Message, load_template, require  # noqa: E402
from inference_svc.core import Context, Model  # noqa: E402
from inference_svc.core.speculative import SamplingParams, SpecDecoder  # noqa: E402
from tests.factory import Shape, write_model  # noqa: E402

BASE = dict(temperature=0.8, top_k=40)
PENALTIES = dict(repeat_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5)
SETTINGS = {
    "plain": SamplingParams(**BASE),  # type: ignore[arg-type]
    "logprobs_20": SamplingParams(**BASE, logprobs=20),  # type: ignore[arg-type]
    "penalties_64": SamplingParams(**BASE, **PENALTIES, repeat_last_n=64),  # type: ignore[arg-type]
    "penalties_4096": SamplingParams(**BASE, **PENALTIES, repeat_last_n=4096),  # type: ignore[arg-type]
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path,
                   default=ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--random-vocab", type=int, default=0)
    p.add_argument("--only", choices=sorted(SETTINGS))
    args = p.parse_args()
    tmp = tempfile.TemporaryDirectory()
    if args.random_vocab:
        args.model = Path(tmp.name) / "wide.gguf"
        write_model(args.model, Shape(n_vocab=args.random_vocab, n_ctx=1024), seed=3)
    model = Model.load(args.model)
    ctx = Context(model, n_slots=1, n_ctx=1024, n_threads=1)
    dec = SpecDecoder(ctx)
    if args.random_vocab:
        prompt = list(range(1, 29))
    else:
        template = require(load_template(None, model.tokenizer))
        prompt = template.tokens([Message("system", "You are a helpful assistant."),
                                  Message("user", "Write a short story about a lighthouse.")],
                                 True)
    settings = {args.only: SETTINGS[args.only]} if args.only else SETTINGS
    times: dict[str, list[float]] = {k: [] for k in settings}
    for rep in range(args.reps + 1):
        for name, sp in settings.items():
            t = step_time(dec, prompt, sp, args.tokens)
            if rep:
                times[name].append(t)
    dec.close()
    ctx.close()
    model.close()
    tmp.cleanup()
    med = {k: statistics.median(v) for k, v in times.items()}
    print(json.dumps({
        "model": args.model.name, "prompt_tokens": len(prompt), "tokens": args.tokens,
        "reps": args.reps,
        "us_per_token": {k: round(v * 1e6, 1) for k, v in med.items()},
        "ratio_to_plain": ({k: round(v / med["plain"], 3) for k, v in med.items()}
                           if "plain" in med else {}),
    }))


if __name__ == "__main__":
    main()
