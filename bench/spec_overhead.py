"""What speculation costs where the draft is useless, counted in instructions.

    WARMSLOT_NATIVE=avx2 valgrind --tool=callgrind --instr-atstart=no \\
        --callgrind-out-file=/tmp/cg.out .venv/bin/python bench/spec_overhead.py \\
        --callgrind-out /tmp/cg.out [--new-tokens 48] [--text random|chat]

Greedy requests through an in-process engine (the path the gRPC handlers take; 1
thread each, so no spinning worker pool adds instructions), speculative with the
server's defaults (speculation on, adaptive draft length, n_max, n_min, p_min of
Config) and target-only, with the draft loaded both ways. --text random (default)
is text where the draft is useless: a prompt of seeded random token ids (no
special tokens), whose greedy continuation the draft does not predict; --text chat
is a held-out chat question.

The models load and a warm-up request of each mode runs uninstrumented; then
each request runs alone with its instructions counted (callgrind client requests:
start instrumentation, zero, dump per request): for each mode the request with
--new-tokens and the same one with 0 new tokens (prompt only), so the difference
is the decoding, and the ratio of the two modes' differences is what decoding
with the adaptive draft costs over target-only for the same tokens, independent
of machine load. The prompt's draft prefill is reported apart.
WARMSLOT_NATIVE=avx2: valgrind cannot run the AVX-512 of a release build. Both
modes must generate the same tokens (checked). Without valgrind it runs the same
requests and reports no counts. The last line printed
is one JSON object.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import random
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "bench"))

from prompts import chat_prompts  # noqa: E402

from inference_svc.config import Config  # noqa: E402
from inference_svc.core import Model, Tokenizer  # noqa: E402
from inference_svc.core.params import SamplingParams  # noqa: E402
from inference_svc.engine.executor import Engine  # noqa: E402
from inference_svc.engine.slot_owner import SlotOwner  # noqa: E402
from inference_svc.metrics import Metrics  # noqa: E402
from inference_svc.pb import inference_pb2 as pb  # noqa: E402
from inference_svc.types import GenerateParams, speculative_from_pb  # noqa: E402

# callgrind's client requests (no-ops outside valgrind), compiled at start
HOOKS = r"""
#include <valgrind/callgrind.h>
void cg_start(void) { CALLGRIND_START_INSTRUMENTATION; }
void cg_zero(void) { CALLGRIND_ZERO_STATS; }
void cg_dump(const char *label) { CALLGRIND_DUMP_STATS_AT(label); }
"""


def load_hooks(directory: Path) -> ctypes.CDLL:
    src, lib = directory / "cg_hooks.c", directory / "cg_hooks.so"
    src.write_text(HOOKS)
    subprocess.run(["cc", "-O1", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    return ctypes.CDLL(str(lib))


def random_prompt(tok: Tokenizer, n: int, seed: int = 1) -> list[int]:
    """n token ids drawn uniformly (seeded) from the vocabulary without its special
    tokens: text the draft was never trained on."""
    special = set(tok.special_tokens.values())
    ids = [i for i in range(tok.n_vocab) if i not in special]
    rng = random.Random(seed)
    return [rng.choice(ids) for _ in range(n)]


def dumped_counts(out: Path) -> dict[str, int]:
    """Instructions of each labelled dump callgrind wrote as OUT.N."""
    counts: dict[str, int] = {}
    for f in out.parent.glob(out.name + ".*"):
        text = f.read_text(errors="replace")
        label = re.search(r"^desc: Trigger: Client Request: (.+)$", text, re.M)
        total = re.search(r"^(?:totals|summary): (\d+)", text, re.M)
        if label and total:
            counts[label.group(1).strip()] = int(total.group(1))
    return counts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path,
                    default=ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--draft", type=Path, default=ROOT / "models" / "smollm2-draft.gguf")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--text", choices=("random", "chat"), default="random")
    ap.add_argument("--prompt-tokens", type=int, default=16, help="--text random")
    ap.add_argument("--question", type=int, default=0, help="--text chat")
    ap.add_argument("--callgrind-out", type=Path, default=None,
                    help="the --callgrind-out-file given to valgrind (to read the dumps)")
    args = ap.parse_args()
    tmp = tempfile.TemporaryDirectory()
    hooks = load_hooks(Path(tmp.name))
    tm, dm = Model.load(args.model), Model.load(args.draft)
    cfg = Config(model=args.model, draft=args.draft, slots=1, ctx=256, threads=1,
                 draft_threads=1, seed=1, log_level="warning", log_format="text")
    engine = Engine(cfg, SlotOwner(cfg, tm, dm), Metrics())
    # the defaults a request that sets no speculative field gets (both drafters)
    specs = {"target_only": None,
             "speculative": speculative_from_pb(pb.SpeculativeParams(), cfg, has_draft=True)}
    if args.text == "chat":
        prompt = chat_prompts(tm.tokenizer, args.question + 1)[args.question]
    else:
        prompt = random_prompt(tm.tokenizer, args.prompt_tokens)
    for spec in specs.values():  # warm-up (uninstrumented): first-use allocations
        engine.generate(GenerateParams(tuple(prompt), 4, 0, False, SamplingParams(), None,
                                       spec)).collect(timeout=3600)
    runs: dict[str, Any] = {}
    hooks.cg_start()
    try:
        for mode, spec in specs.items():
            for n in (0, args.new_tokens):
                hooks.cg_zero()
                job = engine.generate(GenerateParams(tuple(prompt), n, 0, False,
                                                     SamplingParams(), None, spec))
                toks, t = job.collect(timeout=3600)
                hooks.cg_dump(f"{mode}-{n}".encode())
                runs[f"{mode}-{n}"] = {"tokens": toks, "draft_n": t.draft_n,
                                       "draft_n_accepted": t.draft_n_accepted,
                                       "n_steps": t.n_steps, "draft_prompt_n": t.draft_prompt_n}
    finally:
        engine.close()
    n = args.new_tokens
    if runs[f"target_only-{n}"]["tokens"] != runs[f"speculative-{n}"]["tokens"]:
        raise SystemExit("speculative tokens differ from target-only")
    res: dict[str, Any] = {"benchmark": "spec_overhead", "text": args.text,
                           "prompt_tokens": len(prompt), "new_tokens": n, "runs": runs}
    if args.callgrind_out is not None:
        c = dumped_counts(args.callgrind_out)
        res["instructions"] = c
        decode = {m: c[f"{m}-{n}"] - c[f"{m}-0"] for m in specs}
        res["decode_instructions"] = decode
        res["decode_speculative_over_target_only"] = round(
            decode["speculative"] / decode["target_only"], 4)
        res["prompt_speculative_over_target_only"] = round(
            c["speculative-0"] / c["target_only-0"], 4)
        res["request_speculative_over_target_only"] = round(
            c[f"speculative-{n}"] / c[f"target_only-{n}"], 4)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
