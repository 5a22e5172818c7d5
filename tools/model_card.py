"""Render models/MODEL_CARD.md from the metrics in models/train_log.json.

Re-render without retraining::

    .venv/bin/python tools/model_card.py --models-dir models
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Sequence
from pathlib import Path

SHIPPED = ("target.gguf", "draft.gguf", "tokenizer.json", "train_log.json")


def fmt(x: float | None, digits: int = 3) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def section_models(log: dict) -> str:
    rows = []
    for role in ("target", "draft"):
        m = log["models"][role]
        c = m["config"]
        shape = (
            f"{c['n_layer']} x {c['n_embd']}, heads {c['n_head']}/{c['n_head_kv']} kv, "
            f"head_dim {c['n_embd'] // c['n_head']}, ff {c['n_ff']}"
        )
        rows.append(
            [
                role,
                f"{m['params']:,}",
                shape,
                f"{m['macs_per_token']:,}",
                f"{m['tokens_seen']:,}",
                m["steps"],
                fmt(m["minutes"], 1),
            ]
        )
    ratio = log["models"]["draft"]["macs_per_token"] / log["models"]["target"]["macs_per_token"]
    return (
        table(
            ["model", "params", "shape", "MACs/token", "tokens seen", "steps", "train minutes"],
            rows,
        )
        + f"\n\nDraft cost per token: {ratio:.3f} of the target's (weight MACs per "
        "decoded token, output layer included).\n"
    )


def section_quality(log: dict) -> str:
    m = log["metrics"]
    rows = [
        [f"{role} model", fmt(m[role]["nats_per_token"]), fmt(m[role]["bits_per_byte"])]
        for role in ("target", "draft")
    ]
    rows += [
        [f"`{name}` per file", "", fmt(bpb)] for name, bpb in m["compressors_bits_per_byte"].items()
    ]
    v = m["validation"]
    return (
        table(["validation", "nats/token", "bits/byte"], rows)
        + f"\n\n{v['files']} held-out files, {v['bytes']:,} bytes, {v['tokens']:,} tokens "
        f"({fmt(v['tokens_per_byte'])} tokens/byte). Models score the files joined as "
        f"`<|endoftext|> file <|endoftext|> file ...` in {v['windows']} consecutive windows "
        f"of {v['window']} tokens; bits/byte = total nats / ln 2 / file bytes. Compressors "
        "run on each file on its own (sum of compressed bits / sum of bytes).\n"
    )


def section_buckets(log: dict) -> str:
    m = log["metrics"]
    rows = []
    for i, b in enumerate(m["target"]["buckets"]):
        d = m["draft"]["buckets"][i]
        rows.append(
            [b["range"], fmt(b["nats_per_token"]), fmt(d["nats_per_token"]), f"{b['tokens']:,}"]
        )
    return table(["positions", "target nats/token", "draft nats/token", "tokens"], rows) + "\n"


def section_speculative(log: dict) -> str:
    s = log["metrics"]["speculative"]
    rows = [[k, fmt(s[f"accepted_per_pass_{k}"], 2)] for k in (2, 4, 8)]
    return (
        table(["drafted tokens", "accepted tokens per target pass"], rows)
        + f"\n\nMeasured on the target's own greedy continuations ({s['new_tokens']} "
        f"tokens) of {s['prompts']} validation prompts of {s['prompt_tokens']} tokens: a "
        "pass accepts the longest prefix of the draft's greedy proposals that agrees with "
        "the target, plus one token from the target (at most drafted + 1).\n\n"
        "- Draft/target greedy agreement on those continuations: "
        f"{fmt(100 * s['draft_greedy_agreement_on_target_continuations'], 1)} %\n"
        "- Draft/target greedy agreement on validation text: "
        f"{fmt(100 * log['metrics']['greedy_agreement_on_validation'], 1)} %\n"
        + acceptance_gap(log)
    )


ACCEPTANCE_BAR = 3.0


def acceptance_gap(log: dict) -> str:
    """Say plainly whether the draft meets the issue's bar, and what would reach it."""
    s = log["metrics"]["speculative"]
    got = s["accepted_per_pass_4"]
    history = (
        "\n\nMeasured alternative: a 2-layer draft at the same width (ff 256, 557,696 "
        "parameters, 0.163 of the target's cost per token, same seed and steps) reached "
        "1.507 bits/byte and 49.4 % greedy agreement on validation text, yet only 1.95 "
        "accepted tokens per pass with 4 drafted (51.4 % agreement on the target's "
        "continuations). Per unit of work, accepted / (1 + 4 x cost ratio), that is 1.18 "
        "against 1.27 for the 1-layer draft, so the 1-layer draft ships.\n"
    )
    if got >= ACCEPTANCE_BAR:
        return f"\nThe bar of {ACCEPTANCE_BAR} accepted tokens per pass with 4 drafted is met." + (
            history
        )
    agree = s["draft_greedy_agreement_on_target_continuations"]
    d = log["models"]["draft"]
    layers = d["config"]["n_layer"]
    return (
        f"\n**Bar not met:** {got:.2f} accepted tokens per pass with 4 drafted, against a "
        f"bar of {ACCEPTANCE_BAR}. With per-token agreement p the expected figure is "
        f"(1 - p^5) / (1 - p); {100 * agree:.0f} % gives about "
        f"{(1 - agree**5) / (1 - agree):.2f}, and 3.0 needs p of about 0.75. The draft "
        f"({layers} layer{'s' if layers != 1 else ''}, {d['params']:,} parameters, "
        f"{d['minutes']:.0f} minutes of plain training) is a much weaker language model "
        "than the target (see the loss table), so it agrees with it mostly where the next "
        "token is easy. What would close the gap: distillation on the target's logits (it "
        "optimises agreement directly; it costs a target forward per batch, so it needs a "
        "longer budget than plain training to pay off), more draft steps (its loss was "
        "still falling); a deeper draft alone did not help (below)." + history
    )


def section_provenance(log: dict) -> str:
    if not log.get("reused_checkpoints"):
        return f"\nWhole run: {fmt(log['total_minutes'], 1)} minutes.\n"
    return (
        "\nThe models were trained by that command (training minutes per model below). "
        "Export and evaluation were then re-run from its checkpoints with\n\n"
        f"```\n{log['command']}\n```\n\n"
        "which re-exports the same weights (identical GGUF bytes) and recomputes every "
        f"figure in this card ({fmt(log['total_minutes'], 1)} minutes).\n"
    )


def section_data(log: dict) -> str:
    c = log["corpus"]
    return (
        "The `.py` files of the running interpreter's standard library "
        f"(`{c['root']}`), minus tests (`test/`, `tests/`, `idle_test/`), site-packages, "
        "`pydoc_data`, `_sysconfigdata_*`, `html/entities.py` and machine-written files: "
        f"{len(c['excluded_generated'])} files dropped by a generated-file marker in their "
        "header (gencodec.py codec tables, `stringprep.py`, `token.py`, `keyword.py`, "
        "`re/_casefix.py`, ...; listed in `train_log.json`).\n\n"
        f"Split by file with the seed: {c['train_files']} training files "
        f"({c['train_bytes']:,} bytes, {c['train_tokens']:,} tokens) and "
        f"{len(c['valid_files'])} validation files (listed in `train_log.json`). Training "
        "documents are the files joined as `<|endoftext|> file <|endoftext|> file ...`; "
        "batches are random windows of that stream.\n"
    )


def section_tokenizer(log: dict) -> str:
    t = log["tokenizer"]
    rows = [
        [
            r["vocab_size"],
            fmt(r["valid_tokens_per_byte"], 4),
            f"{r['draft_macs_per_byte']:,.0f}",
            f"{r['target_draft_macs_per_byte']:,.0f}",
        ]
        for r in t["candidates"]
    ]
    return (
        table(["vocab", "valid tokens/byte", "draft MACs/byte", "target+draft MACs/byte"], rows)
        + f"\n\nChosen: **{t['chosen']}**, the candidate with the fewest multiply-"
        "accumulates per byte of text for the pair. A bigger vocabulary saves tokens, but "
        "every token then pays a bigger output layer; that layer is most of the small "
        "draft's cost, so the smaller vocabulary keeps the draft cheap.\n"
    )


def section_curve(log: dict) -> str:
    parts = []
    for role in ("target", "draft"):
        rows = [
            [
                p["step"],
                p["ctx"],
                f"{p['tokens']:,}",
                fmt(p["minutes"], 1),
                fmt(p["lr"], 5),
                fmt(p["train_loss"]),
                fmt(p["valid_loss_512"]),
            ]
            for p in log["models"][role]["curve"]
        ]
        parts.append(
            f"**{role}**\n\n"
            + table(
                ["step", "ctx", "tokens", "min", "lr", "train loss (EMA)", "valid loss @512"], rows
            )
        )
    note = (
        "\n\n`valid loss @512` is a quick progress probe (the first 8 windows of 512 tokens "
        "of the validation stream), not the full validation figure above.\n"
    )
    return "\n\n".join(parts) + note


def section_samples(log: dict) -> str:
    parts = []
    for i, s in enumerate(log["metrics"]["samples"], start=1):
        parts.append(
            f"### Sample {i}\n\nPrompt (after `<|endoftext|>`):\n\n```python\n"
            f"{s['prompt']}\n```\n\nGreedy:\n\n```python\n{s['prompt']}{s['greedy']}\n```"
            f"\n\nSampled (temperature {s['sampled_temperature']}):\n\n```python\n"
            f"{s['prompt']}{s['sampled']}\n```\n"
        )
    return "\n".join(parts)


def section_checksums(checksums: dict[str, str]) -> str:
    return "```\n" + "".join(f"{h}  {n}\n" for n, h in checksums.items()) + "```\n"


def render_card(log: dict, checksums: dict[str, str]) -> str:
    t_cfg = log["models"]["target"]["config"]
    quick = "\n> **Quick smoke run - not the shipped models.**\n" if log.get("quick") else ""
    return f"""# Warmslot bundled models: target and draft
{quick}
Two llama-architecture models that share one byte-level BPE tokenizer, trained
from scratch on the CPU on the Python standard library's own sources, so that
Warmslot runs out of the box with speculative decoding and nothing to download.
They write recognisable Python; they are not general-purpose models.

- Files: `target.gguf`, `draft.gguf` (GGUF, architecture `llama`, 2-D weights
  F16, norms F32, output tied to `token_embd.weight` so there is no
  `output.weight`), `tokenizer.json` (the same tokenizer as the GGUF metadata).
- Context length {t_cfg["n_ctx"]}; RoPE base {t_cfg["rope_base"]:g}, Meta's
  interleaved-pair rotation (llama.cpp "normal" RoPE, Q/K not permuted);
  RMSNorm eps {t_cfg["norm_eps"]:g}; SwiGLU; no biases.
- Tokenizer: GPT-2 byte-level BPE (`tokenizer.ggml.model = gpt2`, `pre = gpt-2`);
  `<|endoftext|>` is id 0, both BOS and EOS; `add_bos_token` is false, so
  callers prepend id 0 themselves (training documents start with it).
- Prompts should not end in a bare newline: the GPT-2 pre-tokenizer joins a
  newline with the indentation that follows it, so a final lone `\\n` token
  means "next line starts at column 0" to these models.

## Reproduce

```
{log.get("training_command", log["command"])}
```
{section_provenance(log)}
Seed {log["seed"]} (corpus split, tokenizer data order, initialisation, batches).
Python {log["python"]}, torch {log["torch"]}, {log["threads"]} threads. Budgets are
optimizer steps, so a busy machine gives a slower run, not a different model.

## Data

{section_data(log)}
## Tokenizer

{section_tokenizer(log)}
## Models

{section_models(log)}
Training: AdamW (0.9, 0.95), weight decay 0.1 on matrices, gradient clip 1.0,
linear warm-up then cosine decay to 10 %, first at a short context and then
continued at 4096 tokens (see the curve). Plain next-token training for both
(no distillation).

## Quality

All figures below are measured on the shipped files: the F16 weights are read
back from the GGUFs into the torch model before evaluation
(`tools/eval_models.py --models-dir models` recomputes them). The export is
also checked by an independent numpy forward pass that reads nothing but the
GGUF (max |logit difference| vs torch on 300 validation tokens: target
{log["models"]["target"]["export_check"]["max_abs_numpy_vs_torch"]:.1e}, draft
{log["models"]["draft"]["export_check"]["max_abs_numpy_vs_torch"]:.1e}).

{section_quality(log)}
### Validation loss by position

{section_buckets(log)}
### Speculative decoding

{section_speculative(log)}
## Loss curve

{section_curve(log)}
## Samples (target)

{section_samples(log)}
## Limitations

Tiny models trained for about an hour on one codebase: they imitate the style
of the standard library (docstrings, `self`, 4-space indentation) but do not
write correct programs, know nothing outside Python source, and repeat
themselves under greedy decoding. They exist so that the service, its
snapshots and speculative decoding can be exercised without a download.

## Checksums (sha256)

{section_checksums(checksums)}"""


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main(argv: Sequence[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models-dir", type=Path, default=Path("models"))
    args = p.parse_args(argv)
    log = json.loads((args.models_dir / "train_log.json").read_text())
    checksums = {n: sha256(args.models_dir / n) for n in SHIPPED}
    (args.models_dir / "MODEL_CARD.md").write_text(render_card(log, checksums))


if __name__ == "__main__":
    main(sys.argv[1:])
