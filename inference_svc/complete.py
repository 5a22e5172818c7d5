"""Streamed greedy completion of a prompt from the command line, with speeds.

    python -m inference_svc.complete --model models/target.gguf --prompt "def f(x):"
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from inference_svc.core import Context, CoreError, Model, StreamDecoder

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "models" / "target.gguf"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m inference_svc.complete", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="GGUF model file")
    p.add_argument("--prompt", default="def fibonacci(n):", help="text to complete")
    p.add_argument("--max-tokens", type=int, default=96, help="tokens to generate")
    p.add_argument("--threads", type=int, default=2, help="decoding threads")
    p.add_argument("--ctx", type=int, default=None, help="context size (default: the model's)")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> None:
    with Model.load(args.model) as model, \
            Context(model, n_slots=1, n_ctx=args.ctx, n_threads=args.threads) as ctx:
        tok = model.tokenizer
        prompt = (tok.encode(args.prompt, add_bos=True)
                  or [tok.bos_id if tok.bos_id is not None else 0])
        if len(prompt) + args.max_tokens > ctx.n_ctx:
            raise CoreError(f"prompt of {len(prompt)} tokens plus {args.max_tokens} new ones "
                            f"exceed the context of {ctx.n_ctx}")
        out = sys.stdout
        out.write(args.prompt)
        out.flush()
        t0 = time.perf_counter()
        logits = ctx.decode(0, prompt)
        t1 = time.perf_counter()
        stream = StreamDecoder(tok)
        n_gen = 0
        for _ in range(args.max_tokens):
            nxt = int(np.argmax(logits))
            if nxt == tok.eos_id:
                break
            out.write(stream.push(nxt))
            out.flush()
            n_gen += 1
            logits = ctx.decode(0, [nxt])
        t2 = time.perf_counter()
        out.write(stream.flush() + "\n")
        pf, dc = t1 - t0, t2 - t1
        print(f"\nprefill: {len(prompt)} tokens in {pf * 1e3:.1f} ms "
              f"({len(prompt) / pf:.1f} tokens/s)", file=sys.stderr)
        if n_gen:
            print(f"decode:  {n_gen} tokens in {dc * 1e3:.1f} ms ({n_gen / dc:.1f} tokens/s)",
                  file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        run(args)
    except CoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
