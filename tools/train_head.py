"""Train the EAGLE-style feature head of SmolLM2-135M-Instruct (HEAD_SPEC's definitions).

    .venv/bin/python tools/train_head.py [--stage all|data|vocab|train|export|eval]

Stage ``data`` lets the target generate (tools/head_data.py) and stores, in seeded
shards under --work-dir, every row's tokens, the target's hidden states h_i and its
argmax next token. Shard 0 of each kind is held out for validation.
Stage ``vocab`` counts the target's next tokens in the training shards and measures
the coverage of the K most frequent for each --k-candidates; the readout vocabulary
token_ids is the --k most frequent (most frequent first).
Stage ``train`` fits the head (tools/head_model.py): smooth-L1 between the predicted
hidden state and the true h_{p+1}, plus cross-entropy of its K logits against the
target's own next-token distribution over the same K tokens (computed from h_{p+1}),
checkpointing every --eval-every steps; stage ``export`` writes the GGUF
(tools/head_gguf.py) and stage ``eval`` measures top-1 agreement with the target at
drafting steps 1..4 on the held-out shards, the head fed its own hidden states.

Everything is seeded (--seed); existing shards and checkpoints are reused, so re-running
a command resumes it. Needs torch==2.13.0 (a tool dependency of ``make draft`` only).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402, N812
from gguf_io import read_gguf  # noqa: E402
from head_data import rollout_hidden  # noqa: E402
from head_gguf import read_head, write_head  # noqa: E402
from head_model import Head  # noqa: E402
from llama_torch import LlamaConfig  # noqa: E402
from train_draft import (  # noqa: E402
    STARTERS,
    chat_prefix,
    checkpoint_path,
    log,
    special_id,
    start_run,
    target_tokenizer,
    train_files,
)

from inference_svc.core.tokenizer import Tokenizer  # noqa: E402

KINDS = ("chat", "code")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stage", choices=("all", "data", "vocab", "train", "export", "eval"),
                   default="all")
    p.add_argument("--target", type=Path,
                   default=ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("--out", type=Path, default=ROOT / "models" / "smollm2-head.gguf")
    p.add_argument("--work-dir", type=Path, default=ROOT / "models" / "scratch" / "head")
    p.add_argument("--log-out", type=Path, default=ROOT / "models" / "smollm2-head-train.json",
                   help="the run's log as one JSON document (written by export and eval)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--row-tokens", type=int, default=256, help="tokens per row")
    p.add_argument("--shard-rows", type=int, default=32)
    p.add_argument("--chat-shards", type=int, default=96)
    p.add_argument("--code-shards", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=128,
                   help="file opening of a code row (the benchmark's length)")
    p.add_argument("--temperature", type=float, default=0.7,
                   help="answers of sampled shards (every third shard)")
    p.add_argument("--question-temperature", type=float, default=0.8)
    p.add_argument("--k", type=int, default=8192, help="readout vocabulary size")
    p.add_argument("--k-candidates", default="2048,4096,8192,16384")
    p.add_argument("--steps", type=int, default=1600)
    p.add_argument("--batch", type=int, default=8, help="rows per step (half chat, half code)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--ce-weight", type=float, default=0.1,
                   help="EAGLE's weight of the cross-entropy beside the smooth-L1")
    p.add_argument("--unroll", type=int, default=3,
                   help="training-time drafting steps (2 and more: also on the head's own "
                        "hidden states)")
    p.add_argument("--noise", type=float, default=0.0,
                   help="uniform noise on the input hidden states, relative to their std")
    p.add_argument("--init-from", type=Path, default=None,
                   help="start from this checkpoint's head weights (fresh optimizer, step 0)")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-rows", type=int, default=16, help="held-out rows per kind")
    p.add_argument("--quick", action="store_true", help="tiny end-to-end run")
    args = p.parse_args(argv)
    if args.quick:
        args.chat_shards, args.code_shards, args.shard_rows, args.row_tokens = 2, 2, 4, 160
        args.steps, args.eval_every, args.warmup, args.batch, args.eval_rows = 20, 10, 5, 4, 4
        args.k = 2048
    return args


# ---------------------------------------------------------------- data


def shard_path(work: Path, kind: str, i: int) -> Path:
    return work / "data" / f"{kind}_{i:04d}.pt"


def make_data(args: argparse.Namespace, logf: Path) -> None:
    """Seeded shards, interleaved by kind so that a run stopped early has both; a shard
    that exists is kept, so an interrupted run resumes."""
    from inference_svc.core import Model

    (args.work_dir / "data").mkdir(parents=True, exist_ok=True)
    counts = {"chat": args.chat_shards, "code": args.code_shards}
    todo = [(i, kind) for i in range(max(counts.values())) for kind in KINDS
            if i < counts[kind] and not shard_path(args.work_dir, kind, i).exists()]
    if not todo:  # a resumed run: no model to load, no files to tokenize
        return
    tok, _ = target_tokenizer(args.target)
    start, end = special_id(tok, "<|im_start|>"), special_id(tok, "<|im_end|>")
    opening = [*tok.encode("\n"), start, *tok.encode("assistant\n")]
    openings = file_windows(tok, args.seed, args.prompt_tokens,
                            args.code_shards * args.shard_rows)
    with Model.load(args.target) as model:
        for i, kind in todo:
            path = shard_path(args.work_dir, kind, i)
            t0 = time.time()
            temp = args.temperature if i % 3 == 2 else 0.0
            rng = np.random.default_rng(args.seed * 100_003 + i * 2 + (kind == "code"))
            if kind == "chat":
                prefix = chat_prefix(tok, STARTERS[i % len(STARTERS)])
                rows = rollout_hidden(model, [prefix] * args.shard_rows, args.row_tokens,
                                      temp, rng, (end, opening, args.question_temperature),
                                      args.threads)
                loss_from = len(prefix) - 1
            else:
                rows = rollout_hidden(model,
                                      openings[i * args.shard_rows:(i + 1) * args.shard_rows],
                                      args.row_tokens, temp, rng, None, args.threads)
                loss_from = args.prompt_tokens - 1
            shard = {k: torch.from_numpy(v) for k, v in rows.items()}
            shard["loss_from"] = torch.tensor(loss_from)
            shard["temperature"] = torch.tensor(temp)
            torch.save(shard, path.with_suffix(".tmp"))
            os.replace(path.with_suffix(".tmp"), path)
            n = args.shard_rows * (args.row_tokens - loss_from)
            log(logf, "shard", kind=kind, index=i, temperature=temp, new_tokens=n,
                seconds=round(time.time() - t0, 1))
            if i < 3:
                log(logf, "sample", kind=kind, text=tok.decode(shard["tokens"][0].tolist()))


def file_windows(tok: Tokenizer, seed: int, length: int, count: int) -> list[list[int]]:
    """`count` windows of `length` tokens of the stdlib's training-split files: the first
    window of every file that long in a seeded order (train_draft.file_openings), then the
    windows starting `2 * length` tokens later, and so on, so each window's continuation
    is text the file does not repeat from its prompt."""
    out: list[list[int]] = []
    files = [tok.encode(f.text) for f in train_files(seed)]
    offset = 0
    while len(out) < count:
        more = [ids[offset:offset + length] for ids in files if len(ids) >= offset + length]
        if not more:
            raise ValueError(f"the training files hold only {len(out)} windows of {length}")
        out.extend(more[:count - len(out)])
        offset += 2 * length
    return out


def load_kind(work: Path, kind: str, indices: range) -> dict[str, torch.Tensor]:
    """Shards of one kind concatenated; loss_from per row."""
    shards = [torch.load(shard_path(work, kind, i)) for i in indices
              if shard_path(work, kind, i).exists()]
    if not shards:
        raise FileNotFoundError(f"no {kind} shards in {work / 'data'} (run --stage data)")
    out = {k: torch.cat([s[k] for s in shards]) for k in ("tokens", "hidden", "top1")}
    out["loss_from"] = torch.cat([s["loss_from"].expand(len(s["tokens"])) for s in shards])
    return out


def split_data(args: argparse.Namespace) -> tuple[dict[str, dict[str, torch.Tensor]],
                                                  dict[str, dict[str, torch.Tensor]]]:
    """Shard 0 of each kind is held out (validation); shards 1.. train."""
    counts = {"chat": args.chat_shards, "code": args.code_shards}
    train = {kind: load_kind(args.work_dir, kind, range(1, counts[kind])) for kind in KINDS}
    valid = {kind: {k: v[: args.eval_rows]
                    for k, v in load_kind(args.work_dir, kind, range(1)).items()}
             for kind in KINDS}
    return train, valid


# ---------------------------------------------------------------- readout vocabulary


def next_tokens(data: dict[str, torch.Tensor]) -> torch.Tensor:
    """The target's argmax next token at every loss position (pairs p >= loss_from)."""
    top1 = data["top1"][:, :-1]
    pos = torch.arange(top1.shape[1])[None, :]
    return top1[pos >= data["loss_from"][:, None]]


def choose_vocab(args: argparse.Namespace, train: dict[str, dict[str, torch.Tensor]],
                 valid: dict[str, dict[str, torch.Tensor]], n_vocab: int,
                 logf: Path) -> torch.Tensor:
    """The --k ids most often the target's next token in the training data, most
    frequent first; logs each candidate K's coverage of the held-out rows
    and of the training rows, and its Q8_0 size cost."""
    d = train[KINDS[0]]["hidden"].shape[-1]
    counts = torch.zeros(n_vocab, dtype=torch.long)
    seen = torch.zeros(n_vocab, dtype=torch.long)
    for data in train.values():
        counts += torch.bincount(next_tokens(data).long(), minlength=n_vocab)
        seen += torch.bincount(data["tokens"].flatten().long(), minlength=n_vocab)
    # ties (above all the ids never the target's next token here) by how often the id
    # occurs anywhere in the rows, prompts included, then by id
    order = torch.argsort(-(counts * (seen.max() + 1) + seen), stable=True)
    coverage: dict[str, dict[str, float]] = {}
    for k in [int(c) for c in args.k_candidates.split(",")]:
        inside = torch.zeros(n_vocab, dtype=torch.bool)
        inside[order[:k]] = True
        row = {f"{kind}_valid": float(inside[next_tokens(valid[kind]).long()].float().mean())
               for kind in KINDS}
        row.update({f"{kind}_train": float(inside[next_tokens(train[kind]).long()].float()
                                           .mean()) for kind in KINDS})
        row["output_bytes_q8_0"] = k * d * 34 // 32
        coverage[str(k)] = {key: round(v, 4) for key, v in row.items()}
    log(logf, "vocab", k=args.k, distinct_next_tokens=int((counts > 0).sum()),
        train_next_tokens=int(counts.sum()), coverage=coverage)
    return order[: args.k]


# ---------------------------------------------------------------- held-out check


def heldout_check(args: argparse.Namespace, train: dict[str, dict[str, torch.Tensor]],
                  logf: Path | None) -> dict[str, dict[str, torch.Tensor]]:
    """The benchmark's prompts (bench/prompts.py) must not be in the training rows.

    Refused: a chat question (or its first 8 words) in a decoded training row, a code
    prompt (a validation file's opening) that is a training row's opening. Dropped from
    training (and counted): rows sharing a run of --prompt-tokens/2 tokens with a code
    prompt; the stdlib's codec modules share such boilerplate across files. Shorter
    shared runs (license headers) are only counted. Returns the training data kept."""
    sys.path.insert(0, str(ROOT / "bench"))
    from prompts import CHAT_QUESTIONS, code_prompts

    tok, _ = target_tokenizer(args.target)
    texts = [tok.decode(row.tolist()) for data in train.values() for row in data["tokens"]]
    questions = [q for q in CHAT_QUESTIONS
                 if any(q in t or " ".join(q.split()[:8]) in t for t in texts)]
    bench_code = code_prompts(tok, 64, args.prompt_tokens)
    openings = {tuple(row[: args.prompt_tokens].tolist())
                for data in train.values() for row in data["tokens"]}
    same_opening = sum(tuple(c) in openings for c in bench_code)

    def sharing(n: int, rows: list[list[int]]) -> list[bool]:
        grams = {tuple(c[i : i + n]) for c in bench_code for i in range(len(c) - n + 1)}
        return [any(tuple(r[i : i + n]) in grams for i in range(len(r) - n + 1))
                for r in rows]

    long_run = args.prompt_tokens // 2
    kept: dict[str, dict[str, torch.Tensor]] = {}
    dropped: dict[str, int] = {}
    short: dict[str, int] = {}
    for kind, data in train.items():
        rows = [row.tolist() for row in data["tokens"]]
        drop = torch.tensor(sharing(long_run, rows))
        dropped[kind], short[kind] = int(drop.sum()), sum(sharing(32, rows))
        kept[kind] = {k: v[~drop] for k, v in data.items()}
    log(logf, "heldout_check", chat_questions_checked=len(CHAT_QUESTIONS),
        code_prompts_checked=len(bench_code),
        training_rows={k: int(v["tokens"].shape[0]) for k, v in train.items()},
        chat_questions_found=questions, code_prompts_as_training_openings=same_opening,
        **{f"rows_dropped_sharing_{long_run}_tokens_with_a_code_prompt": dropped},
        rows_sharing_32_tokens_with_a_code_prompt=short)
    if questions or same_opening:
        raise RuntimeError(f"benchmark prompts found in the training data: {questions}, "
                           f"{same_opening} code openings")
    return kept


# ---------------------------------------------------------------- training


@dataclass
class Target:
    """What the head needs of the target: its config, embeddings, output norm, fingerprint."""

    cfg: LlamaConfig
    embd: torch.Tensor  # (n_vocab, d) float32
    out_norm: torch.Tensor  # (d,)
    fingerprint: str


def load_target(path: Path) -> Target:
    from inference_svc.core.gguf_file import load_gguf

    gg = read_gguf(path)
    content = load_gguf(path)
    try:
        fp = content.fingerprint
    finally:
        content.close()
    return Target(gg.cfg, torch.from_numpy(gg.tensors["token_embd.weight"]),
                  torch.from_numpy(gg.tensors["output_norm.weight"]), fp)


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def lr_at(step: int, args: argparse.Namespace) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    frac = min((step - args.warmup) / max(args.steps - args.warmup, 1), 1.0)
    return args.lr * (0.05 + 0.95 * 0.5 * (1.0 + math.cos(math.pi * frac)))


def step_outputs(head: Head, target: Target, ids: torch.Tensor, data: dict[str, torch.Tensor],
                 rows: torch.Tensor, steps: int, noise: float, scale: float,
                 gen: torch.Generator | None) -> tuple[list[torch.Tensor], torch.Tensor,
                                                       torch.Tensor, torch.Tensor]:
    """The head over the rows' pairs p = 0..T-2, drafting steps 1..steps.

    Returns ĝ per step (B, T-1, d), the true h_{p+1} (B, T-1, d), the rows' tokens and
    their loss_from (the first pair whose drafts are generated text)."""
    tokens = data["tokens"][rows].long()
    hidden = data["hidden"][rows]
    h_in = hidden[:, :-1]
    if noise > 0 and gen is not None:
        h_in = h_in + (torch.rand(h_in.shape, generator=gen) * 2 - 1) * (noise * scale)
    embd = target.embd[tokens[:, 1:]]
    outs = head.unrolled(h_in, embd, steps)
    return outs, hidden[:, 1:], tokens, data["loss_from"][rows]


def valid_mask(loss_from: torch.Tensor, t: int, step: int) -> torch.Tensor:
    """Positions q whose step-`step` chain starts at a pair >= loss_from."""
    q = torch.arange(t)[None, :]
    return q >= (loss_from[:, None] + step - 1)


def batch_loss(head: Head, target: Target, ids: torch.Tensor, data: dict[str, torch.Tensor],
               rows: torch.Tensor, args: argparse.Namespace, scale: float,
               gen: torch.Generator) -> tuple[torch.Tensor, dict[str, float]]:
    """EAGLE's loss summed over the unrolled steps: smooth-L1 of ĝ/scale against
    h_{p+1}/scale plus ce_weight x the cross-entropy of the head's K logits against the
    target's distribution over the same K tokens (softmax of its logits from h_{p+1})."""
    outs, true_h, _, loss_from = step_outputs(head, target, ids, data, rows, args.unroll,
                                              args.noise, scale, gen)
    readout = target.embd[ids]
    total = torch.zeros(())
    parts: dict[str, float] = {}
    for s, g in enumerate(outs, start=1):
        mask = valid_mask(loss_from, g.shape[1], s)
        want = true_h[mask]
        with torch.no_grad():
            p_target = F.softmax(F.linear(rms(want, target.out_norm, target.cfg.norm_eps),
                                          readout), dim=-1)
        reg = F.smooth_l1_loss(g[mask] / scale, want / scale)
        logp = F.log_softmax(head.logits(g[mask]), dim=-1)
        ce = -(p_target * logp).sum(-1).mean()
        total = total + reg + args.ce_weight * ce
        parts[f"reg{s}"], parts[f"ce{s}"] = float(reg.detach()), float(ce.detach())
    return total / len(outs), parts


@torch.no_grad()
def agreement(head: Head, target: Target, ids: torch.Tensor,
              valid: dict[str, dict[str, torch.Tensor]],
              steps: int = 4) -> dict[str, float | None]:
    """Top-1 agreement with the target on held-out rows, drafting as it runs: step s
    fed the head's own ĝ of step s-1. step{s}: P(draft s = target's argmax | drafts
    1..s-1 agreed); accept{s}: P(drafts 1..s all agree); mean_accepted: expected drafts
    accepted of a 4-token draft (greedy verification)."""
    head.eval()
    out: dict[str, float | None] = {}
    for kind, data in valid.items():
        rows = torch.arange(data["tokens"].shape[0])
        outs, _, _, loss_from = step_outputs(head, target, ids, data, rows, steps, 0.0, 1.0,
                                             None)
        want = data["top1"][:, 1:].long()  # target's argmax of token p+2, pair p
        t = want.shape[1] - 1  # the last pair has no argmax after it
        correct = [ids[head.logits(g).argmax(-1)] == want for g in outs]
        # chain starting at pair c: step s sits at q = c + s - 1
        n_start = t - steps + 1
        starts = torch.arange(t)[None, :n_start] >= loss_from[:, None]
        chain = torch.ones_like(starts)
        for s in range(1, steps + 1):
            hit = correct[s - 1][:, s - 1 : s - 1 + n_start]
            prev = chain & starts
            n_prev = int(prev.sum())
            out[f"{kind}_step{s}"] = (round(float(hit[prev].float().sum()) / n_prev, 4)
                                      if n_prev else None)
            chain = chain & hit
            out[f"{kind}_accept{s}"] = round(float(chain[starts].float().mean()), 4)
        out[f"{kind}_mean_accepted"] = round(sum(float(out[f"{kind}_accept{s}"] or 0.0)
                                                 for s in range(1, steps + 1)), 4)
        out[f"{kind}_positions"] = int(starts.sum())
    head.train()
    return out


@torch.no_grad()
def valid_loss(head: Head, target: Target, ids: torch.Tensor,
               valid: dict[str, dict[str, torch.Tensor]], scale: float) -> dict[str, float]:
    head.eval()
    out: dict[str, float] = {}
    for kind, data in valid.items():
        rows = torch.arange(data["tokens"].shape[0])
        (g,), true_h, _, loss_from = step_outputs(head, target, ids, data, rows, 1, 0.0,
                                                  scale, None)
        mask = valid_mask(loss_from, g.shape[1], 1)
        out[f"{kind}_reg"] = round(float(F.smooth_l1_loss(g[mask] / scale,
                                                          true_h[mask] / scale)), 4)
    head.train()
    return out


# the arguments a checkpoint must share with the run resuming it
RESUME_KEYS = ("seed", "k", "batch", "lr", "warmup", "ce_weight", "unroll", "noise", "steps",
               "chat_shards", "code_shards", "row_tokens", "shard_rows")


def new_head(args: argparse.Namespace, target: Target, ids: torch.Tensor) -> Head:
    head = Head(target.cfg, len(ids), n_pos=args.row_tokens + 8)
    head.init_from_target(target.out_norm, target.embd[ids], args.seed)
    return head


def train(args: argparse.Namespace, logf: Path) -> None:
    target = load_target(args.target)
    train_data, valid = split_data(args)
    train_data = heldout_check(args, train_data, logf)
    ids = choose_vocab(args, train_data, valid, target.cfg.n_vocab, logf)
    # the loss scale of the hidden states: their RMS over the training loss positions
    h = train_data["chat"]["hidden"][:, :-1][valid_mask(train_data["chat"]["loss_from"],
                                                       args.row_tokens - 1, 1)]
    scale = float(h.pow(2).mean().sqrt())
    head = new_head(args, target, ids)
    decay = [p for n, p in head.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in head.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                             {"params": rest, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    step = 0
    rng = np.random.default_rng(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    ckpt = checkpoint_path(args.work_dir)
    if args.init_from is not None and not ckpt.exists():
        start = torch.load(args.init_from)
        if not torch.equal(start["token_ids"], ids):
            raise ValueError(f"{args.init_from}: another readout vocabulary")
        head.load_state_dict(start["head"])
        log(logf, "init_from", path=str(args.init_from), step=start["step"])
    if ckpt.exists():
        state = torch.load(ckpt)
        for key in RESUME_KEYS:  # a checkpoint of other settings is not resumed silently
            if state["args"][key] != str(getattr(args, key)):
                raise ValueError(f"{ckpt} was trained with --{key.replace('_', '-')} "
                                 f"{state['args'][key]}, not {getattr(args, key)}: "
                                 "remove it or use another --work-dir")
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["opt"])
        step = state["step"]
        rng.bit_generator.state = state["rng"]
        gen.set_state(state["gen"])
        log(logf, "resumed", step=step)
    log(logf, "head", k=len(ids), params=sum(p.numel() for p in head.parameters()),
        hidden_scale=round(scale, 3),
        train_rows={k: int(v["tokens"].shape[0]) for k, v in train_data.items()},
        train_loss_positions={k: int(next_tokens(v).numel()) for k, v in train_data.items()},
        valid_rows={k: int(v["tokens"].shape[0]) for k, v in valid.items()})
    if step == 0:
        log(logf, "eval", step=0, **valid_loss(head, target, ids, valid, scale),
            **agreement(head, target, ids, valid))
    t0, running = time.time(), None
    head.train()
    while step < args.steps:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        total = torch.zeros(())
        parts: dict[str, float] = {}
        for kind in KINDS:  # half of each batch from each kind
            data = train_data[kind]
            rows = torch.from_numpy(rng.integers(0, data["tokens"].shape[0],
                                                 size=args.batch // len(KINDS)))
            value, kparts = batch_loss(head, target, ids, data, rows, args, scale, gen)
            total = total + value / len(KINDS)
            parts.update({f"{kind}_{k}": v for k, v in kparts.items()})
        total.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        value = total.item()
        running = value if running is None else 0.95 * running + 0.05 * value
        if step % 10 == 0:
            log(logf, "step", step=step, loss=round(value, 4), running=round(running, 4),
                seconds=round(time.time() - t0, 1),
                **{k: round(v, 4) for k, v in parts.items()})
        if step % args.eval_every == 0 or step == args.steps:
            log(logf, "eval", step=step, train_loss=round(running, 4),
                lr=lr_at(step - 1, args), minutes=round((time.time() - t0) / 60, 2),
                **valid_loss(head, target, ids, valid, scale),
                **agreement(head, target, ids, valid))
            torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "step": step,
                        "rng": rng.bit_generator.state, "gen": gen.get_state(),
                        "token_ids": ids, "scale": scale,
                        "args": {k: str(v) for k, v in vars(args).items()}},
                       ckpt.with_suffix(".tmp"))
            os.replace(ckpt.with_suffix(".tmp"), ckpt)
            log(logf, "checkpoint", step=step, path=str(ckpt))


# ---------------------------------------------------------------- export


def head_tensors(head: Head) -> dict[str, np.ndarray]:
    """GGUF name -> float32 array in nn.Linear layout."""
    b = head.block
    named = {
        "fc.weight": head.fc.weight, "blk.0.attn_norm.weight": b.attn_norm.weight,
        "blk.0.attn_q.weight": b.wq.weight, "blk.0.attn_k.weight": b.wk.weight,
        "blk.0.attn_v.weight": b.wv.weight, "blk.0.attn_output.weight": b.wo.weight,
        "blk.0.ffn_norm.weight": b.ffn_norm.weight, "blk.0.ffn_gate.weight": b.w_gate.weight,
        "blk.0.ffn_up.weight": b.w_up.weight, "blk.0.ffn_down.weight": b.w_down.weight,
        "output_norm.weight": head.out_norm.weight, "output.weight": head.output.weight,
    }
    return {k: v.detach().float().numpy() for k, v in named.items()}


def load_checkpoint(args: argparse.Namespace, target: Target) -> tuple[Head, torch.Tensor]:
    state = torch.load(checkpoint_path(args.work_dir))
    ids = state["token_ids"]
    head = Head(target.cfg, len(ids), n_pos=args.row_tokens + 8)
    head.load_state_dict(state["head"])
    return head.eval(), ids


def export(args: argparse.Namespace, logf: Path) -> None:
    target = load_target(args.target)
    head, ids = load_checkpoint(args, target)
    write_head(args.out, target.cfg, target.fingerprint, ids.numpy(), head_tensors(head),
               "SmolLM2-135M-Instruct feature head (tools/train_head.py)")
    log(logf, "exported", path=str(args.out), bytes=args.out.stat().st_size)


def evaluate_export(args: argparse.Namespace, logf: Path) -> None:
    """Agreement of the exported file's (Q8_0-rounded) weights on the held-out rows."""
    target = load_target(args.target)
    _, valid = split_data(args)
    f = read_head(args.out)
    head = Head(target.cfg, len(f.token_ids), n_pos=args.row_tokens + 8)
    ids = torch.from_numpy(f.token_ids.astype(np.int64))
    with torch.no_grad():
        for name, p in zip(head_tensors(head), [
                head.fc.weight, head.block.attn_norm.weight, head.block.wq.weight,
                head.block.wk.weight, head.block.wv.weight, head.block.wo.weight,
                head.block.ffn_norm.weight, head.block.w_gate.weight, head.block.w_up.weight,
                head.block.w_down.weight, head.out_norm.weight, head.output.weight],
                strict=True):
            p.copy_(torch.from_numpy(f.tensors[name]))
    log(logf, "eval_export", path=str(args.out), **agreement(head, target, ids, valid))


def write_log(args: argparse.Namespace, logf: Path) -> None:
    """The JSONL log as one JSON document: every event in order."""
    events = [json.loads(line) for line in logf.read_text().splitlines() if line.strip()]
    tmp = args.log_out.with_name(args.log_out.name + ".tmp")
    tmp.write_text(json.dumps({"log": str(logf.name), "events": events}, indent=1) + "\n")
    os.replace(tmp, args.log_out)


def main(argv: Sequence[str]) -> None:
    args = parse_args(argv)
    logf = start_run(args, argv)
    if args.stage in ("all", "data"):
        make_data(args, logf)
    if args.stage == "vocab":
        target = load_target(args.target)
        choose_vocab(args, *split_data(args), target.cfg.n_vocab, logf)
    if args.stage in ("all", "train"):
        train(args, logf)
    if args.stage in ("all", "train", "export"):
        export(args, logf)
    if args.stage in ("all", "eval"):
        evaluate_export(args, logf)
    if args.stage in ("all", "export", "eval"):
        write_log(args, logf)


if __name__ == "__main__":
    main(sys.argv[1:])
