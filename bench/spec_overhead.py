"""What speculation costs where the draft is useless, counted in instructions.

    valgrind --tool=callgrind --callgrind-out-file=OUT .venv/bin/python \\
        bench/spec_overhead.py --mode {target_only,speculative} [--new-tokens 32]

One greedy chat request through an in-process engine (1 thread each, so no
spinning worker pool adds instructions), speculative with the server's defaults
(adaptive draft length) or target-only. Run under callgrind for each mode, and
with --new-tokens 0 for each mode (model load and prompt only): the difference of
the two differences is what decoding with the draft loaded and the adaptive
controller costs over target-only for the same tokens, independent of machine
load. Prints the tokens as JSON (both modes must print the same).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "bench"))

from prompts import chat_prompts  # noqa: E402

from inference_svc.config import Config  # noqa: E402
from inference_svc.core import Model  # noqa: E402
from inference_svc.core.speculative import SamplingParams, SpecParams  # noqa: E402
from inference_svc.engine import Engine  # noqa: E402
from inference_svc.metrics import Metrics  # noqa: E402
from inference_svc.types import GenerateParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("target_only", "speculative"), required=True)
    ap.add_argument("--model", type=Path,
                    default=ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--draft", type=Path, default=ROOT / "models" / "smollm2-draft.gguf")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--question", type=int, default=0)
    args = ap.parse_args()
    tm, dm = Model.load(args.model), Model.load(args.draft)
    cfg = Config(model=args.model, draft=args.draft, slots=1, ctx=256, threads=1,
                 draft_threads=1, seed=1, log_level="warning", log_format="text")
    engine = Engine(cfg, tm, dm, Metrics())
    sc = cfg.speculative
    spec = SpecParams(sc.n_max, sc.n_min, sc.p_min) if args.mode == "speculative" else None
    prompt = chat_prompts(tm.tokenizer, args.question + 1)[args.question]
    job = engine.generate(GenerateParams(tuple(prompt), args.new_tokens, 0, False,
                                         SamplingParams(), None, spec))
    toks, timings = job.collect(timeout=3600)
    engine.close()
    print(json.dumps({"mode": args.mode, "new_tokens": args.new_tokens, "tokens": toks,
                      "draft_n": timings.draft_n, "n_steps": timings.n_steps,
                      "draft_prompt_n": timings.draft_prompt_n}))


if __name__ == "__main__":
    main()
