"""What speculation costs where the draft is useless, counted in instructions.

    WARMSLOT_NATIVE=avx2 valgrind --tool=callgrind --callgrind-out-file=OUT \\
        .venv/bin/python bench/spec_overhead.py --mode {target_only,speculative} \\
        [--new-tokens 64] [--text random|chat]

One greedy request through an in-process engine (the path the gRPC handlers take;
1 thread each, so no spinning worker pool adds instructions), speculative with the
server's defaults (speculation on, adaptive draft length, n_max, n_min, p_min of
Config) or target-only. --text random (default) is text where the draft is
useless: a prompt of seeded random token ids (no special tokens), whose greedy
continuation the draft does not predict; --text chat is a held-out chat question.
Run under callgrind for each mode, and with --new-tokens 0 for each mode (model
load and prompt only): the difference of the two differences is what decoding
with the draft loaded and the adaptive controller costs over target-only for the
same tokens, independent of machine load (WARMSLOT_NATIVE=avx2: valgrind cannot
run the AVX-512 of a release build). Prints the tokens, the draft's proposals and
acceptances as JSON (both modes must print the same tokens).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "bench"))

from prompts import chat_prompts  # noqa: E402

from inference_svc.config import Config  # noqa: E402
from inference_svc.core import Model, Tokenizer  # noqa: E402
from inference_svc.core.speculative import SamplingParams, SpecParams  # noqa: E402
from inference_svc.engine import Engine  # noqa: E402
from inference_svc.metrics import Metrics  # noqa: E402
from inference_svc.types import GenerateParams  # noqa: E402


def random_prompt(tok: Tokenizer, n: int, seed: int = 1) -> list[int]:
    """n token ids drawn uniformly (seeded) from the vocabulary without its special
    tokens: text the draft was never trained on."""
    special = set(tok.special_tokens.values())
    ids = [i for i in range(tok.n_vocab) if i not in special]
    rng = random.Random(seed)
    return [rng.choice(ids) for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("target_only", "speculative"), required=True)
    ap.add_argument("--model", type=Path,
                    default=ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--draft", type=Path, default=ROOT / "models" / "smollm2-draft.gguf")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--text", choices=("random", "chat"), default="random")
    ap.add_argument("--prompt-tokens", type=int, default=64, help="--text random")
    ap.add_argument("--question", type=int, default=0, help="--text chat")
    args = ap.parse_args()
    tm, dm = Model.load(args.model), Model.load(args.draft)
    cfg = Config(model=args.model, draft=args.draft, slots=1, ctx=256, threads=1,
                 draft_threads=1, seed=1, log_level="warning", log_format="text")
    engine = Engine(cfg, tm, dm, Metrics())
    sc = cfg.speculative
    spec = SpecParams(sc.n_max, sc.n_min, sc.p_min) if args.mode == "speculative" else None
    if args.text == "chat":
        prompt = chat_prompts(tm.tokenizer, args.question + 1)[args.question]
    else:
        prompt = random_prompt(tm.tokenizer, args.prompt_tokens)
    job = engine.generate(GenerateParams(tuple(prompt), args.new_tokens, 0, False,
                                         SamplingParams(), None, spec))
    toks, timings = job.collect(timeout=3600)
    engine.close()
    print(json.dumps({"mode": args.mode, "new_tokens": args.new_tokens, "tokens": toks,
                      "text": args.text, "prompt_tokens": len(prompt),
                      "draft_n": timings.draft_n,
                      "draft_n_accepted": timings.draft_n_accepted, "n_steps": timings.n_steps,
                      "draft_prompt_n": timings.draft_prompt_n}))


if __name__ == "__main__":
    main()
