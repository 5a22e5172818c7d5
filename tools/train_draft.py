"""Train a draft model for SmolLM2-135M-Instruct by distillation from the target itself.

    .venv/bin/python tools/train_draft.py [--stage all|data|train|export] [--quick]

Stage ``data`` runs the target (a torch port of its GGUF, dequantized once) as
teacher and stores its top-k next-token log-probabilities, in shards under
--work-dir, on four kinds of text:

- chat: conversations the target samples itself from the chat template (a
  shared system turn and a user turn opened by a starter word; it writes the
  question and, after ``<|im_end|>``, usually the answer and further turns);
- code: windows of the training split of the Python standard library sources;
- chatpol / codepol (on-policy): what speculative decoding is measured on, the
  target's own continuations computed by the C core (greedy in even shards,
  sampled at --temperature in odd ones) of chat prompts whose user question the
  target wrote, and of the first --prompt-tokens tokens of training files.

Stage ``train`` fits the draft to those distributions (soft cross-entropy on
the renormalised top-k, ``--loss kl``; or plain next-token cross-entropy on the
same tokens, ``--loss ce``), checkpointing every --checkpoint-every steps and
exporting each checkpoint to a GGUF, so a partial run yields a usable draft.
Stage ``export`` writes the GGUF of the latest checkpoint to --out.

Every shard and every batch is seeded (--seed), shards and checkpoints are
reused when present: re-running the same command resumes it, and the same
command on a fresh work dir gives the same draft. Needs torch==2.13.0 (a tool
dependency of ``make draft-model`` only).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import gguf  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402, N812
from corpus import CorpusFile, load_corpus  # noqa: E402
from gguf_io import write_gguf  # noqa: E402
from llama_torch import Llama, LlamaConfig, count_params, gguf_tensors, macs_per_token  # noqa: E402
from teacher import core_rollouts, load_teacher, sample_batch, teacher_top_k  # noqa: E402

from inference_svc.core.gguf_file import TokenizerData  # noqa: E402
from inference_svc.core.tokenizer import Tokenizer  # noqa: E402

CORPUS_SEED = 1234  # the stdlib train/validation split (bench/speculative.py holds out its valid)
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
# first word of the user turn, one per chat shard (round robin): spreads the questions
STARTERS = ("How", "What", "Write", "Explain", "Can", "Why", "Give", "I", "Please", "Tell",
            "Python", "Summarize", "Create", "Is", "Describe", "Help", "List", "Which", "My",
            "Compare", "Translate", "When", "Who", "Fix")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stage", choices=("all", "data", "train", "export"), default="all")
    p.add_argument("--target", type=Path,
                   default=ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("--out", type=Path, default=ROOT / "models" / "smollm2-draft.gguf")
    p.add_argument("--work-dir", type=Path, default=ROOT / "models" / "scratch" / "draft")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ctx", type=int, default=256, help="tokens per training window")
    p.add_argument("--top-k", type=int, default=32, help="teacher log-probs kept per position")
    p.add_argument("--chat-shards", type=int, default=16)
    p.add_argument("--code-shards", type=int, default=16)
    p.add_argument("--chatpol-shards", type=int, default=2,
                   help="on-policy chat: questions the target writes, its own answers")
    p.add_argument("--codepol-shards", type=int, default=1,
                   help="on-policy code: the target's continuations of file openings")
    p.add_argument("--prompt-tokens", type=int, default=128,
                   help="file opening of an on-policy code row (the benchmark's length)")
    p.add_argument("--shard-rows", type=int, default=32, help="windows per shard")
    p.add_argument("--valid-shards", type=int, default=1, help="of each kind, held out")
    p.add_argument("--temperature", type=float, default=0.8, help="chat sampling")
    p.add_argument("--n-embd", type=int, default=192)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=3)
    p.add_argument("--n-head-kv", type=int, default=1)
    p.add_argument("--n-ff", type=int, default=768)
    p.add_argument("--embd-init", choices=("pca", "random"), default="pca",
                   help="token embeddings from the target's, projected on their top principal "
                   "directions, or random")
    p.add_argument("--loss", choices=("kl", "ce"), default="kl")
    p.add_argument("--label-k", type=int, default=8,
                   help="train on the teacher's label-k most likely ids (0: all kept)")
    p.add_argument("--eval-rows", type=int, default=4, help="validation windows per kind")
    p.add_argument("--head-frequent", type=int, default=4096,
                   help="train the output layer with a softmax over this many most frequent "
                   "ids plus the batch's teacher top-k (0: the full vocabulary)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=12)
    p.add_argument("--lr", type=float, default=4e-3)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--checkpoint-every", type=int, default=25)
    p.add_argument("--quick", action="store_true", help="tiny end-to-end run")
    args = p.parse_args(argv)
    if args.quick:
        args.chat_shards, args.code_shards, args.shard_rows, args.valid_shards = 3, 3, 4, 1
        args.steps, args.checkpoint_every, args.warmup, args.batch = 20, 10, 5, 4
        args.ctx = 128
    return args


def log(logf: Path | None, event: str, **fields: object) -> None:
    line = json.dumps({"t": round(time.time(), 1), "event": event, **fields})
    print(line, flush=True)
    if logf is not None:
        with logf.open("a") as f:
            f.write(line + "\n")


def target_tokenizer(path: Path) -> tuple[Tokenizer, gguf.GGUFReader]:
    """The core's own tokenizer for the target, so that training sees the service's ids."""
    reader = gguf.GGUFReader(str(path))

    def field(key: str) -> object:
        return reader.fields[key].contents()

    data = TokenizerData(
        model=str(field("tokenizer.ggml.model")),
        tokens=[str(t) for t in field("tokenizer.ggml.tokens")],
        token_types=[int(t) for t in field("tokenizer.ggml.token_type")],
        merges=[str(m) for m in field("tokenizer.ggml.merges")],
        bos_id=int(field("tokenizer.ggml.bos_token_id")),
        eos_id=int(field("tokenizer.ggml.eos_token_id")),
    )
    return Tokenizer(data), reader


def special_id(tok: Tokenizer, text: str) -> int:
    return tok.data.tokens.index(text)


def chat_prefix(tok: Tokenizer, starter: str) -> list[int]:
    start, end = special_id(tok, "<|im_start|>"), special_id(tok, "<|im_end|>")
    return ([start, *tok.encode(f"system\n{SYSTEM}"), end, *tok.encode("\n"), start,
             *tok.encode(f"user\n{starter}")])


# ---------------------------------------------------------------- data


def code_stream(tok: Tokenizer, eot: int) -> np.ndarray:
    corpus = load_corpus(CORPUS_SEED)
    out: list[int] = []
    for f in corpus.train:
        out += [eot, *tok.encode(f.text)]
    return np.asarray(out, dtype=np.int64)


def train_files(seed: int) -> list[CorpusFile]:
    """The corpus's training-split files in a seeded order."""
    files = sorted(load_corpus(CORPUS_SEED).train, key=lambda f: f.rel)
    return [files[i] for i in np.random.default_rng(seed).permutation(len(files))]


def file_openings(tok: Tokenizer, seed: int, length: int, count: int) -> list[list[int]]:
    """The first `length` tokens of `count` training files that long, in a seeded order
    (the benchmark's code prompts are the openings of the validation files)."""
    out = []
    for f in train_files(seed):
        ids = tok.encode(f.text)
        if len(ids) >= length:
            out.append(ids[:length])
        if len(out) == count:
            break
    return out


def on_policy_shard(args: argparse.Namespace, tok: Tokenizer, model: object, kind: str,
                    i: int, openings: list[list[int]] | None) -> tuple[torch.Tensor, object]:
    """Even shards greedy (what temperature-0 speculation verifies), odd ones sampled at
    --temperature; rows are the target's own continuations computed by the C core."""
    temp = 0.0 if i % 2 == 0 else args.temperature
    rng = np.random.default_rng(args.seed * 100_003 + i * 2 + (kind == "codepol") + 7_000)
    if kind == "chatpol":
        start, end = special_id(tok, "<|im_start|>"), special_id(tok, "<|im_end|>")
        prefix = chat_prefix(tok, STARTERS[i % len(STARTERS)])
        opening = [*tok.encode("\n"), start, *tok.encode("assistant\n")]
        return core_rollouts(model, [prefix] * args.shard_rows, args.ctx + 1, temp, args.top_k,
                             rng, args.threads, question=(end, opening, args.temperature))
    assert openings is not None
    rows = openings[i * args.shard_rows : (i + 1) * args.shard_rows]
    return core_rollouts(model, rows, args.ctx + 1, temp, args.top_k, rng, args.threads)


def shard_path(work: Path, kind: str, i: int) -> Path:
    return work / "data" / f"{kind}_{i:04d}.pt"


TEACHER_TOLERANCE = 1e-3  # max |logit| difference between the torch port and the C core


@torch.no_grad()
def check_teacher(teacher: Llama, target: Path, tok: Tokenizer, logf: Path,
                  tolerance: float = TEACHER_TOLERANCE) -> None:
    """The torch port must compute the C core's logits (chat, code and prose prompts)."""
    from inference_svc.core import Context, Model

    texts = ["<|im_start|>user\nWhat is the capital of France?<|im_end|>\n",
             "def fibonacci(n):\n    if n < 2:", "The quick brown fox jumps over the lazy dog."]
    worst = 0.0
    with Model.load(target) as model:
        for text in texts:
            ids = tok.encode(text)
            # an f32 KV cache: the comparison is of the arithmetic, not of the f16 rounding
            # of keys and values the service's default cache adds
            with Context(model, n_slots=1, n_ctx=64, n_threads=1, kv_type="f32") as ctx:
                ref = ctx.decode(0, ids, logits_all=True)
            got = teacher(torch.tensor([ids]))[0].numpy()
            worst = max(worst, float(np.abs(got - ref).max()))
    log(logf, "teacher_check", max_abs_logit_diff=worst)
    if worst > tolerance:
        raise RuntimeError(f"the torch teacher differs from the C core by {worst} in a logit")


def make_data(args: argparse.Namespace, logf: Path) -> None:
    """Teacher shards; an existing shard is kept, so an interrupted run resumes."""
    (args.work_dir / "data").mkdir(parents=True, exist_ok=True)
    tok, _ = target_tokenizer(args.target)
    eot = special_id(tok, "<|endoftext|>")
    teacher = load_teacher(args.target)
    check_teacher(teacher, args.target, tok, logf)
    stream: np.ndarray | None = None
    openings: list[list[int]] | None = None
    core_model = None
    counts = (("chat", args.chat_shards), ("code", args.code_shards),
              ("chatpol", args.chatpol_shards), ("codepol", args.codepol_shards))
    # interleaved so that a run stopped early has every kind
    for i in range(max(c for _, c in counts)):
        for kind, count in counts:
            path = shard_path(args.work_dir, kind, i)
            if i >= count or path.exists():
                continue
            t0 = time.time()
            gen = torch.Generator().manual_seed(args.seed * 100_003 + i * 2 + (kind == "code"))
            if kind in ("chatpol", "codepol"):
                if core_model is None:
                    from inference_svc.core import Model
                    core_model = Model.load(args.target)
                if kind == "codepol" and openings is None:
                    openings = file_openings(tok, args.seed, args.prompt_tokens,
                                             args.codepol_shards * args.shard_rows)
                tokens, top = on_policy_shard(args, tok, core_model, kind, i, openings)
            elif kind == "chat":
                prefix = chat_prefix(tok, STARTERS[i % len(STARTERS)])
                tokens, top = sample_batch(teacher, prefix, args.shard_rows,
                                           args.ctx + 1 - len(prefix), args.temperature,
                                           args.top_k, gen)
            else:
                if stream is None:
                    stream = code_stream(tok, eot)
                starts = torch.randint(0, len(stream) - args.ctx - 1, (args.shard_rows,),
                                       generator=gen)
                tokens = torch.from_numpy(
                    np.stack([stream[s : s + args.ctx + 1] for s in starts.tolist()]))
                top = teacher_top_k(teacher, tokens[:, :-1], args.top_k)
            shard = {"tokens": tokens.to(torch.int32), "ids": top.ids, "logp": top.logp}
            torch.save(shard, path.with_suffix(".tmp"))
            os.replace(path.with_suffix(".tmp"), path)
            n = tokens.shape[0] * (tokens.shape[1] - 1)
            log(logf, "shard", kind=kind, index=i, tokens=n,
                tokens_per_s=round(n / (time.time() - t0), 1))
            if kind in ("chat", "chatpol") and i < 2:
                log(logf, "chat_sample", text=tok.decode(tokens[0].tolist()))


def load_shards(work: Path, kind: str, indices: range) -> dict[str, torch.Tensor]:
    shards = [torch.load(shard_path(work, kind, i)) for i in indices
              if shard_path(work, kind, i).exists()]
    if not shards:
        raise FileNotFoundError(f"no {kind} shards in {work / 'data'} (run --stage data)")
    return {k: torch.cat([s[k] for s in shards]) for k in shards[0]}


# ---------------------------------------------------------------- model


def draft_config(args: argparse.Namespace, target: LlamaConfig) -> LlamaConfig:
    return LlamaConfig("smollm2-135m-draft", target.n_vocab, n_embd=args.n_embd,
                       n_layer=args.n_layer, n_head=args.n_head, n_head_kv=args.n_head_kv,
                       n_ff=args.n_ff, n_ctx=target.n_ctx, rope_base=target.rope_base,
                       norm_eps=target.norm_eps)


def pca_embeddings(target_embd: torch.Tensor, dim: int) -> torch.Tensor:
    """The target's token embeddings projected on their top `dim` right singular vectors,
    rescaled to the draft's initial embedding scale (std 0.02 per entry)."""
    _, _, vh = torch.linalg.svd(target_embd.double(), full_matrices=False)
    proj = (target_embd.double() @ vh[:dim].T).float()
    return proj * (0.02 / proj.std())


def new_draft(args: argparse.Namespace, teacher_cfg: LlamaConfig,
              teacher_embd: torch.Tensor | None) -> Llama:
    torch.manual_seed(args.seed)
    model = Llama(draft_config(args, teacher_cfg))
    if args.embd_init == "pca":
        assert teacher_embd is not None
        with torch.no_grad():
            model.tok_embd.weight.copy_(pca_embeddings(teacher_embd, args.n_embd))
    return model


def lr_at(step: int, args: argparse.Namespace) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    frac = min((step - args.warmup) / max(args.steps - args.warmup, 1), 1.0)
    return args.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * frac)))


def hidden(model: Llama, idx: torch.Tensor) -> torch.Tensor:
    """The normalised last hidden state (B, T, n_embd): the input of the output layer."""
    t = idx.shape[1]
    x = model.tok_embd(idx)
    for block in model.blocks:
        x = block(x, model.rope_cos[:t], model.rope_sin[:t])
    return model.out_norm(x)


def batch_loss(model: Llama, data: dict[str, torch.Tensor], rows: torch.Tensor,
               loss: str, frequent: torch.Tensor | None = None,
               label_k: int | None = None) -> torch.Tensor:
    """Mean loss over the rows' positions.

    kl: cross-entropy against the teacher's renormalised top-k (KL up to a constant),
    written as logsumexp - sum p_k * logit_k so no full log-softmax is materialised;
    ce: plain next-token cross-entropy on the same tokens.
    label_k: only the teacher's label_k most likely ids, renormalised (0/None: all).
    frequent (kl only): the softmax runs over these ids and every id in the rows'
    teacher top-k instead of the whole vocabulary (a candidate softmax: the tokens
    left out have no teacher probability here and are rarely proposed); the exported
    draft keeps the full tied output layer.
    """
    tokens = data["tokens"][rows].long()
    h = hidden(model, tokens[:, :-1])
    if loss == "ce":
        logits = F.linear(h, model.tok_embd.weight).float()
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    ids = data["ids"][rows, :, : label_k or None].long()
    p = F.softmax(data["logp"][rows, :, : label_k or None].float(), dim=-1)
    if frequent is None:
        logits = F.linear(h, model.tok_embd.weight).float()
    else:
        cand, inv = torch.unique(torch.cat([frequent, ids.flatten()]), return_inverse=True)
        ids = inv[len(frequent):].view_as(ids)
        logits = F.linear(h, model.tok_embd.weight[cand]).float()
    return (torch.logsumexp(logits, dim=-1) - (p * logits.gather(-1, ids)).sum(-1)).mean()


@torch.no_grad()
def evaluate(model: Llama, valid: dict[str, dict[str, torch.Tensor]]) -> dict[str, float]:
    """Full-vocabulary soft cross-entropy and top-1 agreement with the teacher."""
    model.eval()
    out: dict[str, float] = {}
    for kind, data in valid.items():
        n = data["tokens"].shape[0]
        losses, agrees = [], []
        for s in range(0, n, 8):
            rows = torch.arange(s, min(s + 8, n))
            tokens = data["tokens"][rows].long()
            logits = F.linear(hidden(model, tokens[:, :-1]), model.tok_embd.weight).float()
            ids, logp = data["ids"][rows].long(), data["logp"][rows].float()
            p = F.softmax(logp, dim=-1)
            value = (torch.logsumexp(logits, -1) - (p * logits.gather(-1, ids)).sum(-1)).mean()
            losses.append(float(value) * len(rows))
            agrees.append(float((logits.argmax(-1) == ids[..., 0]).float().mean()) * len(rows))
        out[f"{kind}_soft_ce"] = round(sum(losses) / n, 4)
        out[f"{kind}_top1_agree"] = round(sum(agrees) / n, 4)
    model.train()
    return out


def frequent_ids(train_data: dict[str, dict[str, torch.Tensor]], n: int,
                 n_vocab: int) -> torch.Tensor:
    """The n ids most often the teacher's top-1 in the training data (ties by id)."""
    counts = torch.zeros(n_vocab, dtype=torch.long)
    for data in train_data.values():
        counts += torch.bincount(data["ids"][..., 0].flatten().long(), minlength=n_vocab)
    order = torch.argsort(-counts, stable=True)
    return order[:n].sort().values


def checkpoint_path(work: Path) -> Path:
    return work / "checkpoint.pt"


def train(args: argparse.Namespace, logf: Path) -> None:
    teacher_meta = gguf_config(args.target)
    n_valid = args.valid_shards
    counts = {"chat": args.chat_shards, "code": args.code_shards,
              "chatpol": args.chatpol_shards, "codepol": args.codepol_shards}
    kinds = [kind for kind, count in counts.items() if count > n_valid]
    train_data = {kind: load_shards(args.work_dir, kind, range(n_valid, counts[kind]))
                  for kind in kinds}
    valid = {kind: {k: v[: args.eval_rows]
                    for k, v in load_shards(args.work_dir, kind, range(n_valid)).items()}
             for kind, count in counts.items() if count > 0}
    frequent = frequent_ids(train_data, args.head_frequent, teacher_meta.n_vocab) \
        if args.head_frequent else None
    ckpt = checkpoint_path(args.work_dir)
    if ckpt.exists():
        state = torch.load(ckpt)
        model = Llama(LlamaConfig(**state["config"]))
        model.load_state_dict(state["model"])
    else:
        state = None
        embd = load_teacher(args.target).tok_embd.weight.detach() \
            if args.embd_init == "pca" else None
        model = new_draft(args, teacher_meta, embd)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": rest, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    step = 0
    rng = np.random.default_rng(args.seed)
    if state is not None:
        opt.load_state_dict(state["opt"])
        step = state["step"]
        rng.bit_generator.state = state["rng"]
        log(logf, "resumed", step=step)
    log(logf, "draft", config=model.cfg.to_dict(), params=count_params(model),
        macs_per_token=macs_per_token(model.cfg),
        train_windows={k: int(v["tokens"].shape[0]) for k, v in train_data.items()})
    t0, running = time.time(), None
    model.train()
    while step < args.steps:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        total = torch.zeros(())
        for kind in kinds:  # an equal share of each batch from each kind
            data = train_data[kind]
            rows = torch.from_numpy(rng.integers(0, data["tokens"].shape[0],
                                                 size=args.batch // len(kinds)))
            value = batch_loss(model, data, rows, args.loss, frequent, args.label_k)
            total = total + value / len(kinds)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        value = total.item()
        running = value if running is None else 0.98 * running + 0.02 * value
        if step % args.checkpoint_every == 0 or step == args.steps:
            metrics = evaluate(model, valid)
            log(logf, "eval", step=step, train_loss=round(running, 4), lr=lr_at(step - 1, args),
                minutes=round((time.time() - t0) / 60, 2), **metrics)
            torch.save({"config": model.cfg.to_dict(), "model": model.state_dict(),
                        "opt": opt.state_dict(), "step": step, "rng": rng.bit_generator.state,
                        "args": {k: str(v) for k, v in vars(args).items()}},
                       ckpt.with_suffix(".tmp"))
            os.replace(ckpt.with_suffix(".tmp"), ckpt)
            export(args, model, args.work_dir / "draft-latest.gguf")
            log(logf, "checkpoint", step=step, path=str(ckpt))


# ---------------------------------------------------------------- export


def gguf_config(path: Path) -> LlamaConfig:
    reader = gguf.GGUFReader(str(path))

    def field(key: str) -> object:
        return reader.fields[key].contents()

    return LlamaConfig(
        name=str(field("general.name")), n_vocab=len(reader.fields["tokenizer.ggml.tokens"].data),
        n_embd=int(field("llama.embedding_length")), n_layer=int(field("llama.block_count")),
        n_head=int(field("llama.attention.head_count")),
        n_head_kv=int(field("llama.attention.head_count_kv")),
        n_ff=int(field("llama.feed_forward_length")),
        n_ctx=int(field("llama.context_length")),
        rope_base=float(field("llama.rope.freq_base")),
        norm_eps=float(f"{float(field('llama.attention.layer_norm_rms_epsilon')):.7g}"))


def export(args: argparse.Namespace, model: Llama, path: Path) -> None:
    """Q8_0 matrices, F32 norms, the target's tokenizer metadata copied unchanged."""
    _, reader = target_tokenizer(args.target)
    tensors = {k: v.detach().float().numpy() for k, v in gguf_tensors(model).items()}
    tmp = path.with_name(path.name + ".tmp")
    write_gguf(tmp, model.cfg, tensors, reader,
               "Draft for SmolLM2-135M-Instruct, distilled from it (tools/train_draft.py)",
               matrix_type=gguf.GGMLQuantizationType.Q8_0)
    os.replace(tmp, path)


def export_latest(args: argparse.Namespace) -> None:
    state = torch.load(checkpoint_path(args.work_dir))
    model = Llama(LlamaConfig(**state["config"]))
    model.load_state_dict(state["model"])
    export(args, model, args.out)


def start_run(args: argparse.Namespace, argv: Sequence[str]) -> Path:
    """A training run's set-up (threads, work directory) and its first log event; the
    log's path."""
    torch.set_num_threads(args.threads)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    logf = args.work_dir / "train_log.jsonl"
    log(logf, "start", argv=list(argv), torch=torch.__version__,
        args={k: str(v) for k, v in vars(args).items()})
    return logf


def main(argv: Sequence[str]) -> None:
    args = parse_args(argv)
    logf = start_run(args, argv)
    if args.stage in ("all", "data"):
        make_data(args, logf)
    if args.stage in ("all", "train"):
        train(args, logf)
    if args.stage in ("all", "train", "export"):
        export_latest(args)
        log(logf, "exported", path=str(args.out), bytes=args.out.stat().st_size)


if __name__ == "__main__":
    main(sys.argv[1:])
