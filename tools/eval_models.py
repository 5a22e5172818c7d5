"""Evaluate the bundled target/draft pair (torch on the CPU, figures for the card).

Run on its own it loads ``models/target.gguf`` and ``models/draft.gguf`` (the
shipped F16 weights) and prints the metrics as JSON::

    .venv/bin/python tools/eval_models.py --models-dir models
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from bpe import EOT_ID, encode_all  # noqa: E402
from corpus import CorpusFile, load_corpus  # noqa: E402
from gguf_io import read_gguf  # noqa: E402
from llama_torch import Llama, load_gguf_tensors  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

POSITION_BUCKETS = ((0, 512), (512, 1024), (1024, 2048), (2048, 4096))
# No trailing newline: the GPT-2 pre-tokenizer glues a newline to the indentation
# after it, so a prompt ending in a bare "\n" token tells the model "column 0 next".
SAMPLE_PROMPTS = (
    "def fibonacci(n):",
    'class Stack:\n    """A last-in, first-out stack."""\n\n    def __init__(self):',
    "import os\n\n\ndef read_lines(path):",
)
LN2 = math.log(2.0)


def token_stream(docs: Sequence[Sequence[int]]) -> np.ndarray:
    """Documents joined as ``<eot> doc <eot> doc ...`` (the training layout)."""
    parts: list[np.ndarray] = []
    for ids in docs:
        parts.append(np.array([EOT_ID], dtype=np.int64))
        parts.append(np.asarray(ids, dtype=np.int64))
    parts.append(np.array([EOT_ID], dtype=np.int64))
    return np.concatenate(parts)


def model_from_gguf(path: Path) -> Llama:
    loaded = read_gguf(path)
    model = Llama(loaded.cfg)
    load_gguf_tensors(model, {k: torch.from_numpy(v) for k, v in loaded.dequantized().items()})
    return model.eval()


@dataclass
class StreamEval:
    """Per-position losses of one model over the validation stream."""

    nats_sum: float
    n_tokens: int
    bucket_nats: list[float]
    bucket_counts: list[int]
    argmax: np.ndarray  # greedy prediction at every scored position


def windows(stream: np.ndarray, ctx: int, limit: int | None) -> list[np.ndarray]:
    """Non-overlapping windows of up to ctx+1 tokens (inputs and next-token targets)."""
    starts = range(0, len(stream) - 1, ctx)
    if limit is not None:
        starts = starts[:limit]
    return [stream[s : s + ctx + 1] for s in starts]


@torch.no_grad()
def eval_stream(model: Llama, stream: np.ndarray, ctx: int, limit: int | None) -> StreamEval:
    nats_sum, n_tokens = 0.0, 0
    b_nats = [0.0] * len(POSITION_BUCKETS)
    b_counts = [0] * len(POSITION_BUCKETS)
    preds: list[np.ndarray] = []
    for win in windows(stream, ctx, limit):
        x = torch.from_numpy(win[None, :-1])
        logits = model(x)[0].float()
        nll = torch.nn.functional.cross_entropy(logits, torch.from_numpy(win[1:]), reduction="none")
        nll_np = nll.double().numpy()
        nats_sum += float(nll_np.sum())
        n_tokens += len(nll_np)
        for b, (lo, hi) in enumerate(POSITION_BUCKETS):
            seg = nll_np[lo:hi]
            b_nats[b] += float(seg.sum())
            b_counts[b] += len(seg)
        preds.append(logits.argmax(-1).numpy())
    argmax = np.concatenate(preds) if preds else np.zeros(0, dtype=np.int64)
    return StreamEval(nats_sum, n_tokens, b_nats, b_counts, argmax)


def summarize(ev: StreamEval, n_bytes: int) -> dict:
    """nats/token, bits/byte (scored tokens' share of the bytes) and buckets."""
    nats_tok = ev.nats_sum / max(ev.n_tokens, 1)
    return {
        "nats_per_token": nats_tok,
        "bits_per_byte": ev.nats_sum / LN2 / max(n_bytes, 1),
        "scored_tokens": ev.n_tokens,
        "buckets": [
            {
                "range": f"{lo}-{hi}",
                "nats_per_token": nats / cnt if cnt else None,
                "tokens": cnt,
            }
            for (lo, hi), nats, cnt in zip(
                POSITION_BUCKETS, ev.bucket_nats, ev.bucket_counts, strict=True
            )
        ],
    }


def compressed_bits(data: bytes, argv: list[str]) -> int:
    out = subprocess.run(argv, input=data, capture_output=True, check=True).stdout
    return 8 * len(out)


def compressor_bpb(files: Sequence[CorpusFile]) -> dict[str, float]:
    """``xz -9e`` and ``gzip -9`` on each file on its own: sum of bits / sum of bytes."""
    total_bytes = sum(f.n_bytes for f in files)
    result: dict[str, float] = {}
    for label, argv in (("xz -9e", ["xz", "-9e", "-c"]), ("gzip -9", ["gzip", "-9", "-c"])):
        if shutil.which(argv[0]) is None:
            continue
        bits = sum(compressed_bits(f.text.encode("utf-8"), argv) for f in files)
        result[label] = bits / total_bytes
    return result


@torch.no_grad()
def greedy_continue(model: Llama, prompts: np.ndarray, n_new: int) -> np.ndarray:
    """Batched greedy continuation (full recompute per step; small models only)."""
    seq = torch.from_numpy(prompts)
    for _ in range(n_new):
        nxt = model(seq)[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat((seq, nxt), dim=1)
    return seq.numpy()


def accepted_per_pass(agree: np.ndarray, n_draft: int) -> tuple[int, int]:
    """Tokens produced and target passes for greedy speculation over one sequence.

    ``agree[j]`` says whether the draft's greedy guess for continuation token j
    (given the true prefix) equals the target's token. A pass accepts the longest
    agreeing prefix (at most n_draft) plus one token from the target.
    """
    pos, produced, passes = 0, 0, 0
    n = len(agree)
    while pos < n:
        m = 0
        while m < n_draft and pos + m < n and agree[pos + m]:
            m += 1
        step = min(m + 1, n - pos)
        produced += step
        passes += 1
        pos += step
    return produced, passes


@torch.no_grad()
def speculative_figures(
    target: Llama,
    draft: Llama,
    stream: np.ndarray,
    n_prompts: int,
    prompt_len: int,
    n_new: int,
    seed: int,
) -> dict:
    """Acceptance of the draft on the target's own greedy continuations."""
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(stream) - prompt_len, size=n_prompts)
    prompts = np.stack([stream[s : s + prompt_len] for s in starts])
    seqs = greedy_continue(target, prompts, n_new)
    draft_pred = draft(torch.from_numpy(seqs[:, :-1])).argmax(-1).numpy()
    agree = draft_pred[:, prompt_len - 1 :] == seqs[:, prompt_len:]
    figures: dict = {"prompts": n_prompts, "prompt_tokens": prompt_len, "new_tokens": n_new}
    figures["draft_greedy_agreement_on_target_continuations"] = float(agree.mean())
    for k in (2, 4, 8):
        produced = passes = 0
        for row in agree:
            p, q = accepted_per_pass(row, k)
            produced, passes = produced + p, passes + q
        figures[f"accepted_per_pass_{k}"] = produced / passes
    return figures


@torch.no_grad()
def generate(
    model: Llama, prompt_ids: list[int], n_new: int, temperature: float, seed: int
) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    seq = list(prompt_ids)
    for _ in range(n_new):
        logits = model(torch.tensor([seq[-model.cfg.n_ctx :]]))[0, -1].float()
        if temperature <= 0:
            nxt = int(logits.argmax())
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            nxt = int(torch.multinomial(probs, 1, generator=gen))
        if nxt == EOT_ID:
            break
        seq.append(nxt)
    return seq[len(prompt_ids) :]


def samples(model: Llama, tok: Tokenizer, n_new: int, seed: int) -> list[dict]:
    out: list[dict] = []
    for i, prompt in enumerate(SAMPLE_PROMPTS):
        ids = [EOT_ID] + tok.encode(prompt, add_special_tokens=False).ids
        greedy = generate(model, ids, n_new, 0.0, seed)
        sampled = generate(model, ids, n_new, 0.8, seed + i)
        out.append(
            {
                "prompt": prompt,
                "prompt_ids": ids,
                "greedy_ids": greedy,
                "greedy": tok.decode(greedy),
                "sampled_temperature": 0.8,
                "sampled": tok.decode(sampled),
            }
        )
    return out


@dataclass(frozen=True)
class EvalSettings:
    ctx: int = 4096
    window_limit: int | None = None
    n_prompts: int = 32
    prompt_len: int = 128
    n_new: int = 128
    sample_tokens: int = 120
    seed: int = 1234


def evaluate_pair(
    target: Llama,
    draft: Llama,
    tok: Tokenizer,
    valid: Sequence[CorpusFile],
    settings: EvalSettings,
) -> dict:
    """All card figures for a (target, draft) pair on the validation files."""
    torch.manual_seed(settings.seed)
    stream = token_stream(encode_all(tok, [f.text for f in valid]))
    n_bytes = sum(f.n_bytes for f in valid)
    n_win = len(windows(stream, settings.ctx, settings.window_limit))
    ev_t = eval_stream(target, stream, settings.ctx, settings.window_limit)
    ev_d = eval_stream(draft, stream, settings.ctx, settings.window_limit)
    # Every token is scored unless window_limit cut the stream short (quick runs).
    scored_bytes = n_bytes * ev_t.n_tokens / max(len(stream) - 1, 1)
    return {
        "validation": {
            "files": len(valid),
            "bytes": n_bytes,
            "tokens": int(len(stream)),
            "tokens_per_byte": (len(stream) - len(valid) - 1) / n_bytes,
            "window": settings.ctx,
            "windows": n_win,
        },
        "target": summarize(ev_t, round(scored_bytes)),
        "draft": summarize(ev_d, round(scored_bytes)),
        "greedy_agreement_on_validation": float((ev_t.argmax == ev_d.argmax).mean()),
        "compressors_bits_per_byte": compressor_bpb(valid),
        "speculative": speculative_figures(
            target,
            draft,
            stream,
            settings.n_prompts,
            settings.prompt_len,
            settings.n_new,
            settings.seed,
        ),
        "samples": samples(target, tok, settings.sample_tokens, settings.seed),
    }


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models-dir", type=Path, default=Path("models"))
    p.add_argument("--seed", type=int, default=1234, help="corpus split seed used in training")
    p.add_argument("--window-limit", type=int, default=None)
    p.add_argument("--prompts", type=int, default=32)
    return p.parse_args(argv)


def main(argv: Sequence[str]) -> None:
    args = parse_args(argv)
    torch.set_num_threads(2)
    tok = Tokenizer.from_file(str(args.models_dir / "tokenizer.json"))
    target = model_from_gguf(args.models_dir / "target.gguf")
    draft = model_from_gguf(args.models_dir / "draft.gguf")
    valid = load_corpus(args.seed).valid
    settings = EvalSettings(window_limit=args.window_limit, n_prompts=args.prompts, seed=args.seed)
    print(json.dumps(evaluate_pair(target, draft, tok, valid, settings), indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])
