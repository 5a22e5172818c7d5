"""Speculative acceptance after a save and after a restart, per drafter, through the
service on the real model.

    .venv/bin/python bench/spec_resume.py [--prompts 6] [--gen 96] [--threads 2]

SmolLM2-135M-Instruct with its draft (models/smollm2-draft.gguf), one service process
on 127.0.0.1 with `--slot-save-path`, greedy. Each conversation is an input-grounded
request (bench/prompts.py `grounded`: rewrite code, quote a text, extract a record)
and a second turn that asks to repeat the answer with a change, so both drafters have
text to follow. Turn 2 runs on the same slot after turn 1, in five ways:

- never saved:    turn 2 right after turn 1;
- save/restore:   SaveSlot, EraseSlot, RestoreSlot between the turns;
- no sidecar:     the same with the `.drft` deleted before RestoreSlot (the draft is
                  re-prefilled: `--draft-restore-policy reprefill`);
- restart:        SIGTERM after turn 1 (the auto-save), a new process restores the
                  slot at start-up, then turn 2.

for six drafter settings: the server's default (lookup, the feature head, the draft
model), draft model + lookup (`--head none`), lookup only (`--draft none --head none`),
draft model only (`--no-spec-lookup --head none`), the head + lookup (`--draft none`) and
the head alone (`--draft none --no-spec-lookup`); the head's KV is in the `.drft` too.
Per setting and way: the
turn-2 totals of draft_n / draft_n_accepted, the lookup's share, target passes,
prompt tokens processed and reused, the draft's catch-up tokens, the restore's
milliseconds (for a restart: from SIGTERM to the new process serving) and turn 2's
prompt milliseconds, and whether turn 2's tokens equal the never-saved run's.
Acceptance counts are exact at temperature 0 and do not depend on the machine's load;
times do. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))  # corpus, for the prompts

from prompts import grounded_prompts  # noqa: E402
from service import Service  # noqa: E402

from inference_svc.client import InferenceClient, make_request  # noqa: E402
from inference_svc.core import Model  # noqa: E402

HEAD = "{head}"  # replaced by --head
SETTINGS: dict[str, tuple[str, ...]] = {
    "default": ("--head", HEAD),
    "draft+lookup": ("--head", "none"), "lookup": ("--draft", "none", "--head", "none"),
    "draft": ("--no-spec-lookup", "--head", "none"),
    "head+lookup": ("--draft", "none", "--head", HEAD),
    "head": ("--draft", "none", "--head", HEAD, "--no-spec-lookup")}
WAYS = ("never saved", "save/restore", "no sidecar", "restart")
FOLLOW_UP = ("Now give the same answer again, word for word, with one short sentence added "
             "at the end.")
COUNTS = ("draft_n", "draft_n_accepted", "lookup_n", "lookup_n_accepted", "head_n",
          "head_n_accepted", "n_steps", "predicted_n", "prompt_n", "cache_n", "draft_prompt_n")


def follow_up(tok: Any, text: str) -> list[int]:
    """The end of the assistant's turn, a user turn, the assistant's opening (ChatML)."""
    vocab = tok.data.tokens
    if "<|im_start|>" not in vocab:
        raise SystemExit("this benchmark needs a ChatML model (SmolLM2)")
    start, end = vocab.index("<|im_start|>"), vocab.index("<|im_end|>")
    nl = tok.encode("\n")
    return [end, *nl, start, *tok.encode(f"user\n{text}"), end, *nl,
            start, *tok.encode("assistant\n")]


def generate(c: InferenceClient, prompt: list[int], n: int) -> tuple[list[int], Any]:
    req = make_request(prompt, max_tokens=n, id_slot=0, cache_prompt=True, temperature=0.0)
    tokens: list[int] = []
    last = None
    for r in c.generate_stream(req, timeout=600):
        tokens += r.tokens
        last = r
    assert last is not None
    return tokens, last.timings


class Server:
    """One service process of a setting on its save directory, with a client."""

    def __init__(self, args: argparse.Namespace, setting: tuple[str, ...], save: Path) -> None:
        ns = argparse.Namespace(ctx=args.ctx, threads=args.threads, n_max=args.n_max)
        self.svc = Service(ns, args.target, args.draft, extra=(
            "--slot-save-path", str(save), "--instance-id", "bench", *setting))
        self.c = InferenceClient(f"127.0.0.1:{self.svc.port}", timeout=600)
        self.c.wait_ready(120)

    def stop(self) -> None:
        self.c.close()
        self.svc.stop()


def run_setting(args: argparse.Namespace, name: str, prompts: list[list[int]],
                tok: Any) -> dict[str, Any]:
    setting = tuple(str(args.head) if a == HEAD else a for a in SETTINGS[name])
    with tempfile.TemporaryDirectory(prefix="spec-resume-") as tmp:
        save = Path(tmp)
        srv = Server(args, setting, save)
        totals = {w: dict.fromkeys(COUNTS, 0) for w in WAYS}
        restore_ms: dict[str, list[float]] = {w: [] for w in WAYS}
        prompt_ms: dict[str, list[float]] = {w: [] for w in WAYS}
        same = dict.fromkeys(WAYS, 0)
        try:
            for i, p in enumerate(prompts):
                base: list[int] | None = None
                for way in WAYS:
                    for slot in range(4):
                        srv.c.erase(slot)
                    out1, _ = generate(srv.c, p, args.gen)
                    p2 = p + out1 + follow_up(tok, FOLLOW_UP)
                    if way in ("save/restore", "no sidecar"):
                        srv.c.save(0, f"c{i}")
                        if way == "no sidecar":
                            (save / f"c{i}.drft").unlink(missing_ok=True)
                        srv.c.erase(0)
                        restore_ms[way].append(srv.c.restore(0, f"c{i}").restore_ms)
                    elif way == "restart":
                        srv.stop()  # SIGTERM: the auto-save of slot 0
                        t0 = time.perf_counter()
                        srv = Server(args, setting, save)
                        restore_ms[way].append(1e3 * (time.perf_counter() - t0))
                    out2, t = generate(srv.c, p2, args.gen)
                    if base is None:
                        base = out2
                    same[way] += out2 == base
                    for k in COUNTS:
                        totals[way][k] += int(getattr(t, k))
                    prompt_ms[way].append(t.prompt_ms)
        finally:
            srv.stop()
    result: dict[str, Any] = {}
    for w in WAYS:
        tw = totals[w]
        result[w] = {**tw,
                     "accepted_per_proposed": round(tw["draft_n_accepted"] / tw["draft_n"], 4)
                     if tw["draft_n"] else None,
                     "tokens_per_pass": round(tw["predicted_n"] / tw["n_steps"], 3)
                     if tw["n_steps"] else None,
                     "restore_ms_median": round(statistics.median(restore_ms[w]), 1)
                     if restore_ms[w] else None,
                     "turn2_prompt_ms_median": round(statistics.median(prompt_ms[w]), 1),
                     "turn2_equal_to_never_saved": f"{same[w]}/{len(prompts)}"}
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", dest="target", type=Path,
                    default=ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--draft", type=Path, default=ROOT / "models" / "smollm2-draft.gguf")
    ap.add_argument("--head", type=Path, default=ROOT / "models" / "smollm2-head.gguf",
                    help="the feature head of the head settings")
    ap.add_argument("--settings", nargs="+", choices=tuple(SETTINGS), default=list(SETTINGS))
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--prompt-tokens", type=int, default=160,
                    help="tokens of the code or text each request embeds")
    ap.add_argument("--gen", type=int, default=96, help="tokens generated per turn")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-max", type=int, default=8)
    args = ap.parse_args()
    with Model.load(args.target) as model:
        tok = model.tokenizer
        prompts = grounded_prompts(tok, args.prompts, args.prompt_tokens)
        out = {"model": args.target.name, "draft": args.draft.name, "head": args.head.name,
               "prompts": args.prompts,
               "gen": args.gen, "threads": args.threads, "n_max": args.n_max,
               "settings": {name: run_setting(args, name, prompts, tok)
                            for name in args.settings}}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
