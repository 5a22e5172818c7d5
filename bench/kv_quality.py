"""KV cache type accuracy: next-token distributions of a q8_0 (or f32) KV cache against f16.

    .venv/bin/python bench/kv_quality.py [--model PATH ...] [--contexts 512,2048,8192]
        [--window 256] [--types q8_0] [--chunk 64] [--threads 2] [--greedy-tokens 64]
        [--text-rev REV]

Held-out text: README.md then docs/*.md (sorted by name, subfolders left out) as git
revision --text-rev (default HEAD, recorded as a commit id in the output) holds them,
joined by blank lines, tokenized as plain text after BOS when the model asks for one.
They were written for this project, after the models were trained.

Teacher-forced: the text's first max(--contexts) tokens are decoded in chunks of
--chunk by an f16 context and a context of each of --types (the same tokens, so every
position sees the same history), keeping every position's logits. Per position: the
KL divergence KL(p_f16 || p_type) of the softmax distributions (in float64) and
whether the argmax (lowest id on ties) is the same. For each context length L: the
means over the last --window positions before L (the predictions made with about L
tokens of context) and over all L positions; and the mean KL over ranges of positions
(0-15, 16-63, 64-255, 256-1023, 1024-4095, 4096-), where it comes from.

Free-running greedy: a few chat prompts through the model's chat template (Gemma 3's
GGUF has none: tests/fixtures/gemma_turns.jinja, its turn format), --greedy-
tokens tokens decoded greedily by an f16 context and by each type's, each on its own
outputs: the number of leading tokens that are identical (reported, not a target: at a
near-tie the two pick different tokens and the texts go apart from there).

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from inference_svc.chat import Message, load_template, require  # noqa: E402
from inference_svc.core import Context, Model  # noqa: E402

MODELS = (ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf",
          ROOT / "models" / "gemma-3-270m-q4_k_m.gguf")
GEMMA_TEMPLATE = ROOT / "tests" / "fixtures" / "gemma_turns.jinja"
KL_RANGES = (0, 16, 64, 256, 1024, 4096)
CHAT_PROMPTS = (
    "Explain in a few sentences why the sky is blue.",
    "Write a short Python function that checks whether a number is prime.",
    "What are three things to pack for a week of hiking in the mountains?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
)


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout


def held_out_text(rev: str) -> str:
    """README.md and docs/*.md of commit rev, joined."""
    names = sorted(n for n in git("ls-tree", "--name-only", rev, "docs/").split()
                   if n.endswith(".md"))
    return "\n\n".join(git("show", f"{rev}:{n}") for n in ["README.md", *names])


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def teacher_forced(model: Model, tokens: list[int], types: tuple[str, ...], chunk: int,
                   threads: int) -> dict[str, dict[str, np.ndarray]]:
    """Per position and type: KL(p_f16 || p_type) and top-1 agreement with f16."""
    n = len(tokens)
    ctxs = {kv: Context(model, n_ctx=n, n_threads=threads, n_batch=chunk, kv_type=kv)
            for kv in ("f16", *types)}
    out = {kv: {"kl": np.zeros(n), "top1": np.zeros(n, dtype=bool)} for kv in types}
    try:
        for i in range(0, n, chunk):
            piece = tokens[i:i + chunk]
            ref = ctxs["f16"].decode(0, piece, logits_all=True)
            lp_ref = log_softmax(ref)
            p_ref = np.exp(lp_ref)
            for kv in types:
                got = ctxs[kv].decode(0, piece, logits_all=True)
                lp = log_softmax(got)
                out[kv]["kl"][i:i + len(piece)] = (p_ref * (lp_ref - lp)).sum(axis=-1)
                out[kv]["top1"][i:i + len(piece)] = ref.argmax(-1) == got.argmax(-1)
    finally:
        for c in ctxs.values():
            c.close()
    return out


def greedy(model: Model, prompt: list[int], n: int, kv: str, threads: int) -> list[int]:
    eos = model.tokenizer.eos_id
    with Context(model, n_ctx=len(prompt) + n + 1, n_threads=threads, kv_type=kv) as ctx:
        logits = ctx.decode(0, prompt)
        out: list[int] = []
        while len(out) < n:
            t = int(np.argmax(logits))
            out.append(t)
            if t == eos:
                break
            logits = ctx.decode(0, [t])
    return out


def common_prefix(a: list[int], b: list[int]) -> int:
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k


def measure(path: Path, a: argparse.Namespace, types: tuple[str, ...],
            contexts: list[int], text: str) -> dict[str, Any]:
    model = Model.load(path)
    try:
        tok = model.tokenizer
        ids = tok.encode(text, add_bos=True)  # BOS when the model asks for it, as served
        n = max(contexts)
        if len(ids) < n:
            raise SystemExit(f"the held-out text is {len(ids)} tokens of {path.name}, "
                             f"{n} needed")
        tokens = ids[:n]
        t0 = time.perf_counter()
        tf = teacher_forced(model, tokens, types, a.chunk, a.threads)
        res: dict[str, Any] = {"model": path.name, "text_tokens": len(ids),
                               "teacher_forced_s": round(time.perf_counter() - t0, 1),
                               "teacher_forced": {}, "greedy": {}}
        for kv in types:
            kl, top1 = tf[kv]["kl"], tf[kv]["top1"]
            rows = []
            for L in contexts:
                w = slice(max(0, L - a.window), L)
                rows.append({"context": L,
                             "window": [w.start, L],
                             "mean_kl": float(kl[w].mean()),
                             "max_kl": float(kl[w].max()),
                             "top1_agreement": float(top1[w].mean()),
                             "mean_kl_all": float(kl[:L].mean()),
                             "top1_agreement_all": float(top1[:L].mean())})
                print(f"{path.name} {kv} vs f16 at {L} tokens (positions {w.start}..{L - 1}): "
                      f"mean KL {rows[-1]['mean_kl']:.2e}, top-1 "
                      f"{100 * rows[-1]['top1_agreement']:.2f} %; over 0..{L - 1}: mean KL "
                      f"{rows[-1]['mean_kl_all']:.2e}, top-1 "
                      f"{100 * rows[-1]['top1_agreement_all']:.2f} %")
            res["teacher_forced"][kv] = rows
            bounds = [b for b in KL_RANGES if b < len(kl)] + [len(kl)]
            res.setdefault("mean_kl_by_positions", {})[kv] = {
                f"{lo}-{hi - 1}": float(kl[lo:hi].mean())
                for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)}
            print(f"{path.name} {kv} mean KL by positions: " + ", ".join(
                f"{r} {v:.2e}" for r, v in res["mean_kl_by_positions"][kv].items()))
        fallback = GEMMA_TEMPLATE if model.hparams.arch == "gemma3" and \
            not tok.data.chat_template else None
        template = require(load_template(fallback, tok))
        runs = []
        for text in CHAT_PROMPTS:
            prompt = template.tokens([Message("user", text)], add_generation_prompt=True)
            ref = greedy(model, prompt, a.greedy_tokens, "f16", a.threads)
            row: dict[str, Any] = {"prompt": text, "f16_tokens": len(ref)}
            for kv in types:
                got = greedy(model, prompt, a.greedy_tokens, kv, a.threads)
                row[kv] = {"identical_prefix": common_prefix(ref, got),
                           "identical": ref == got, "tokens": len(got)}
            runs.append(row)
            print(f"{path.name} greedy {text[:40]!r}: " + ", ".join(
                f"{kv} identical for {row[kv]['identical_prefix']} of {len(ref)}"
                for kv in types))
        res["greedy"] = runs
        return res
    finally:
        model.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, action="append",
                    help="a GGUF (repeatable); default SmolLM2 and Gemma 3")
    ap.add_argument("--contexts", default="512,2048,8192")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--types", default="q8_0", help="KV types compared with f16")
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--greedy-tokens", type=int, default=64)
    ap.add_argument("--text-rev", default="HEAD", help="git revision of the held-out text")
    a = ap.parse_args()
    rev = git("rev-parse", a.text_rev).strip()
    text = held_out_text(rev)
    types = tuple(t for t in a.types.split(",") if t and t != "f16")
    contexts = sorted(int(x) for x in a.contexts.split(",") if x)
    result = {"native": os.environ.get("WARMSLOT_NATIVE", "release"), "threads": a.threads,
              "window": a.window, "contexts": contexts,
              "text": f"README.md + docs/*.md of {rev}", "text_chars": len(text),
              "models": [measure(p, a, types, contexts, text) for p in (a.model or MODELS)]}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
