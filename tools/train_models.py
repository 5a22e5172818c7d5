"""Train, export and evaluate Warmslot's bundled target/draft model pair.

One command does the whole job (corpus, tokenizer, target, draft, GGUF export,
export check, evaluation, model card)::

    .venv/bin/python tools/train_models.py --out-dir models

Budgets are optimizer steps with a fixed seed, so a busy machine gives a slower
run, not a different model. ``--quick`` is a tiny end-to-end smoke run.
Needs the optional ``train`` extra (torch==2.13.0); nothing here is a runtime
dependency of the services.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # ~3x faster on this machine

import bpe  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402, N812
from corpus import Corpus, load_corpus  # noqa: E402
from eval_models import EvalSettings, evaluate_pair, model_from_gguf, token_stream  # noqa: E402
from gguf_io import numpy_forward, read_gguf, write_gguf  # noqa: E402
from llama_torch import Llama, LlamaConfig, count_params, gguf_tensors, macs_per_token  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

VOCAB_CANDIDATES = (2048, 4096)


@dataclass(frozen=True)
class Phase:
    """A stretch of training at one context length."""

    steps: int
    batch: int
    ctx: int

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.ctx


@dataclass(frozen=True)
class TrainPlan:
    peak_lr: float
    phases: tuple[Phase, ...]
    warmup: int = 50
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 100

    @property
    def total_steps(self) -> int:
        return sum(p.steps for p in self.phases)


def target_config(n_vocab: int) -> LlamaConfig:
    return LlamaConfig(
        "warmslot-target", n_vocab, n_embd=256, n_layer=4, n_head=8, n_head_kv=4, n_ff=688
    )


def draft_config(n_vocab: int) -> LlamaConfig:
    return LlamaConfig(
        "warmslot-draft", n_vocab, n_embd=128, n_layer=1, n_head=4, n_head_kv=2, n_ff=352
    )


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", type=Path, default=Path("models"))
    p.add_argument(
        "--work-dir",
        type=Path,
        default=Path("/tmp/warmslot-train"),
        help="scratch space for checkpoints (not shipped)",
    )
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--vocab-size",
        type=int,
        default=0,
        help="force a vocabulary size (0: choose by measurement)",
    )
    p.add_argument("--target-steps", type=int, default=1250, help="steps at short context")
    p.add_argument("--target-long-steps", type=int, default=150, help="steps at long context")
    p.add_argument("--draft-steps", type=int, default=1600)
    p.add_argument("--draft-long-steps", type=int, default=150)
    p.add_argument("--short-ctx", type=int, default=512)
    p.add_argument("--short-batch", type=int, default=16)
    p.add_argument("--long-ctx", type=int, default=4096)
    p.add_argument("--long-batch", type=int, default=2)
    p.add_argument("--target-lr", type=float, default=2e-3)
    p.add_argument("--draft-lr", type=float, default=3e-3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--compile", action="store_true", help="torch.compile (+~6%% here)")
    p.add_argument("--quick", action="store_true", help="tiny smoke run of every stage")
    p.add_argument(
        "--reuse-checkpoints",
        action="store_true",
        help="skip training a model whose checkpoint and report are in --work-dir "
        "(same flags as the run that made them), e.g. to redo export and evaluation",
    )
    return p.parse_args(argv)


def quick_overrides(args: argparse.Namespace) -> argparse.Namespace:
    args.target_steps, args.target_long_steps = 6, 2
    args.draft_steps, args.draft_long_steps = 6, 2
    return args


def log(event: str, **fields: object) -> None:
    print(json.dumps({"t": round(time.time(), 1), "event": event, **fields}), flush=True)


# ---------------------------------------------------------------- tokenizer


def choose_tokenizer(corpus: Corpus, forced: int) -> tuple[Tokenizer, dict]:
    """Train each candidate vocabulary; keep the one with the fewest MACs per byte.

    The cost of decoding a byte is (MACs per token) x (tokens per byte), summed
    over target and draft; a bigger vocabulary saves tokens but every token
    pays a bigger output layer, which hurts the 1-layer draft most.
    """
    train = [f.text for f in corpus.train]
    valid = [f.text for f in corpus.valid]
    sizes = (forced,) if forced else VOCAB_CANDIDATES
    rows: list[dict] = []
    toks: dict[int, Tokenizer] = {}
    for size in sizes:
        tok = bpe.train_tokenizer(train, size)
        tpb = bpe.tokens_per_byte(tok, valid)
        macs = macs_per_token(target_config(size)) + macs_per_token(draft_config(size))
        rows.append(
            {
                "vocab_size": size,
                "valid_tokens_per_byte": tpb,
                "target_draft_macs_per_byte": macs * tpb,
                "draft_macs_per_byte": macs_per_token(draft_config(size)) * tpb,
            }
        )
        toks[size] = tok
        log("tokenizer", **rows[-1])
    best = min(rows, key=lambda r: r["target_draft_macs_per_byte"])
    return toks[best["vocab_size"]], {"candidates": rows, "chosen": best["vocab_size"]}


# ---------------------------------------------------------------- training


def lr_at(step: int, plan: TrainPlan) -> float:
    if step < plan.warmup:
        return plan.peak_lr * (step + 1) / plan.warmup
    frac = (step - plan.warmup) / max(plan.total_steps - plan.warmup, 1)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(frac, 1.0)))
    return plan.peak_lr * (plan.min_lr_ratio + (1.0 - plan.min_lr_ratio) * cosine)


def sample_batch(stream: np.ndarray, rng: np.random.Generator, phase: Phase) -> torch.Tensor:
    starts = rng.integers(0, len(stream) - phase.ctx - 1, size=phase.batch)
    return torch.from_numpy(np.stack([stream[s : s + phase.ctx + 1] for s in starts]))


def make_optimizer(model: Llama, plan: TrainPlan) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": plan.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=plan.peak_lr, betas=(0.9, 0.95), eps=1e-8)


@torch.no_grad()
def quick_val_loss(model: Llama, stream: np.ndarray, ctx: int, n_windows: int = 8) -> float:
    """Mean nats/token over the first n_windows contiguous validation windows."""
    model.eval()
    n = min(n_windows, (len(stream) - 1) // ctx)
    x = torch.from_numpy(np.stack([stream[i * ctx : i * ctx + ctx + 1] for i in range(n)]))
    loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
    model.train()
    return float(loss)


def train_model(
    model: Llama,
    plan: TrainPlan,
    train_stream: np.ndarray,
    valid_stream: np.ndarray,
    seed: int,
    compile_model: bool,
) -> dict:
    """Train in place; return the loss curve, tokens seen and wall minutes."""
    rng = np.random.default_rng(seed)
    opt = make_optimizer(model, plan)
    fwd: Callable[[torch.Tensor], torch.Tensor] = torch.compile(model) if compile_model else model
    curve: list[dict] = []
    step, tokens, t0 = 0, 0, time.time()
    running = None
    model.train()
    for phase in plan.phases:
        for _ in range(phase.steps):
            for group in opt.param_groups:
                group["lr"] = lr_at(step, plan)
            batch = sample_batch(train_stream, rng, phase)
            logits = fwd(batch[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), plan.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            tokens += phase.tokens_per_step
            value = loss.item()
            running = value if running is None else 0.95 * running + 0.05 * value
            last = step == plan.total_steps
            if step % plan.eval_every == 0 or last or step == 1:
                point = {
                    "step": step,
                    "ctx": phase.ctx,
                    "tokens": tokens,
                    "minutes": round((time.time() - t0) / 60, 2),
                    "lr": lr_at(step - 1, plan),
                    "train_loss": round(running, 4),
                    "valid_loss_512": round(quick_val_loss(model, valid_stream, 512), 4),
                }
                curve.append(point)
                log("train", model=model.cfg.name, **point)
    model.eval()
    return {
        "curve": curve,
        "tokens_seen": tokens,
        "steps": step,
        "minutes": round((time.time() - t0) / 60, 2),
    }


def make_plan(args: argparse.Namespace, short: int, long: int, lr: float) -> TrainPlan:
    phases = (
        Phase(short, args.short_batch, args.short_ctx),
        Phase(long, args.long_batch, args.long_ctx),
    )
    eval_every = 100 if not args.quick else 2
    return TrainPlan(
        peak_lr=lr,
        phases=tuple(p for p in phases if p.steps > 0),
        warmup=min(50, max(1, (short + long) // 10)),
        eval_every=eval_every,
    )


# ---------------------------------------------------------------- export


def export(model: Llama, path: Path, vocab: bpe.GgufVocab, description: str) -> None:
    tensors = {k: v.detach().float().numpy() for k, v in gguf_tensors(model).items()}
    write_gguf(path, model.cfg, tensors, vocab, description)


@torch.no_grad()
def check_export(model: Llama, path: Path, tokens: list[int]) -> dict:
    """Reload the GGUF; numpy forward vs torch on the same (F16) weights."""
    loaded = read_gguf(path)
    if loaded.cfg != model.cfg:
        raise RuntimeError(f"{path}: config {loaded.cfg} != {model.cfg}")
    ref = numpy_forward(loaded, tokens)
    reloaded = model_from_gguf(path)
    x = torch.tensor([tokens])
    from_gguf = reloaded(x)[0].numpy()
    original = model(x)[0].numpy()
    err_np = float(np.abs(ref - from_gguf).max())
    err_f16 = float(np.abs(original - from_gguf).max())
    if err_np > 1e-2:
        raise RuntimeError(f"{path}: numpy reference differs from torch by {err_np}")
    return {
        "tokens": len(tokens),
        "max_abs_numpy_vs_torch": err_np,
        "max_abs_f16_vs_f32_weights": err_f16,
    }


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ---------------------------------------------------------------- driver


def model_summary(model: Llama) -> dict:
    return {
        "config": model.cfg.to_dict(),
        "params": count_params(model),
        "macs_per_token": macs_per_token(model.cfg),
    }


def command_line(argv: Sequence[str]) -> str:
    return " ".join([".venv/bin/python", "tools/train_models.py", *argv])


def run(args: argparse.Namespace, argv: Sequence[str]) -> None:
    started = time.time()
    torch.set_num_threads(args.threads)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    corpus = load_corpus(args.seed)
    log(
        "corpus",
        train_files=len(corpus.train),
        valid_files=len(corpus.valid),
        train_bytes=sum(f.n_bytes for f in corpus.train),
        valid_bytes=sum(f.n_bytes for f in corpus.valid),
        excluded=len(corpus.excluded),
    )
    tok, tok_report = choose_tokenizer(corpus, args.vocab_size)
    tok.save(str(args.out_dir / "tokenizer.json"))
    vocab = bpe.gguf_vocab(tok)
    n_vocab = tok.get_vocab_size()
    train_stream = token_stream(bpe.encode_all(tok, [f.text for f in corpus.train]))
    valid_stream = token_stream(bpe.encode_all(tok, [f.text for f in corpus.valid]))
    log("streams", train_tokens=len(train_stream), valid_tokens=len(valid_stream))

    results: dict[str, dict] = {}
    models: dict[str, Llama] = {}
    specs = (
        (
            "target",
            target_config(n_vocab),
            args.target_steps,
            args.target_long_steps,
            args.target_lr,
        ),
        ("draft", draft_config(n_vocab), args.draft_steps, args.draft_long_steps, args.draft_lr),
    )
    for offset, (role, cfg, short, long, lr) in enumerate(specs, start=1):
        torch.manual_seed(args.seed + offset)
        model = Llama(cfg)
        plan = make_plan(args, short, long, lr)
        log("model", role=role, **model_summary(model))
        checkpoint = args.work_dir / f"{role}.pt"
        saved_report = args.work_dir / f"{role}.report.json"
        if args.reuse_checkpoints and checkpoint.exists() and saved_report.exists():
            model.load_state_dict(torch.load(checkpoint))
            report = json.loads(saved_report.read_text())
            log("reused", role=role, checkpoint=str(checkpoint))
        else:
            report = train_model(
                model, plan, train_stream, valid_stream, args.seed + offset, args.compile
            )
            torch.save(model.state_dict(), checkpoint)
            saved_report.write_text(json.dumps(report))
        model.eval()
        path = args.out_dir / f"{role}.gguf"
        export(model, path, vocab, f"Warmslot bundled {role}, trained on CPython stdlib sources")
        report["export_check"] = check_export(model, path, valid_stream[:300].tolist())
        report["plan"] = {**asdict(plan), "phases": [asdict(p) for p in plan.phases]}
        results[role] = {**model_summary(model), **report}
        models[role] = model_from_gguf(path)
        log("exported", role=role, **report["export_check"])

    settings = EvalSettings(seed=args.seed)
    if args.quick:
        settings = replace(settings, window_limit=2, n_prompts=4, n_new=16, sample_tokens=24)
    metrics = evaluate_pair(models["target"], models["draft"], tok, corpus.valid, settings)
    log(
        "evaluated",
        target_bpb=metrics["target"]["bits_per_byte"],
        draft_bpb=metrics["draft"]["bits_per_byte"],
        accepted_4=metrics["speculative"]["accepted_per_pass_4"],
    )

    shipped = ("target.gguf", "draft.gguf", "tokenizer.json")
    train_log = {
        "command": command_line(argv),
        "training_command": command_line([a for a in argv if a != "--reuse-checkpoints"]),
        "reused_checkpoints": args.reuse_checkpoints,
        "seed": args.seed,
        "quick": args.quick,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": args.threads,
        "corpus": {
            "root": corpus.root,
            "train_files": len(corpus.train),
            "valid_files": [f.rel for f in corpus.valid],
            "excluded_generated": corpus.excluded,
            "train_bytes": sum(f.n_bytes for f in corpus.train),
            "train_tokens": int(len(train_stream)),
        },
        "tokenizer": tok_report,
        "models": results,
        "metrics": metrics,
        "total_minutes": round((time.time() - started) / 60, 2),
    }
    (args.out_dir / "train_log.json").write_text(json.dumps(train_log, indent=1) + "\n")
    checksums = {name: sha256(args.out_dir / name) for name in (*shipped, "train_log.json")}
    from model_card import render_card  # imported late: the card can evolve during a run

    (args.out_dir / "MODEL_CARD.md").write_text(render_card(train_log, checksums))
    log("done", minutes=train_log["total_minutes"], **checksums)


def main(argv: Sequence[str]) -> None:
    args = parse_args(argv)
    if args.quick:
        args = quick_overrides(args)
    run(args, argv)


if __name__ == "__main__":
    main(sys.argv[1:])
