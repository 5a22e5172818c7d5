"""Greedy agreement of the core with llama.cpp on Gemma 3 270M, and what explains each
divergence: at the first position where the two engines pick different tokens, the
float64 numpy reference's top-2 margin against each engine's error there.

    .venv/bin/python tools/gemma3_agreement.py --model gemma-3-270m-q4_k_m.gguf \\
        --llama-python /work/scratch/llvenv/bin/python [--n 40] [--out results.json]

For each of the five prompts of tools/gemma3_oracle.py: the core's greedy continuation;
llama.cpp (llama-cpp-python, run with --llama-python; never a project dependency) scores
the same path (prompt + the core's tokens, so both engines see the same prefix) and the
first position where its argmax differs is the divergence. There the reference's logits
(tests/reference.py, float64 on the dequantized weights) give the margin between its
top two and each engine's max |engine - reference|. A near-tie: the margin is below the
error of the engine that picked the reference's second token.

With --f32-check, the same prompts also run in llama.cpp on an F32 copy of the model
(the weights dequantized, written with the gguf package): without quantized products in
llama.cpp, its distance from the reference shows whether the two compute the same
function (a formula difference would stay) or only round differently.

The last line printed is one JSON object (also written to --out)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from gemma3_oracle import PROMPTS  # this tool's directory is on sys.path

ROOT = Path(__file__).resolve().parent.parent


def llama_side(model: str, job: Path, out_dir: Path) -> None:
    """Run under the llama-cpp-python interpreter: the logits of every position of each
    path, saved as out_dir/<i>.npy (float32 [len(path)][n_vocab])."""
    from llama_cpp import Llama

    paths = json.loads(job.read_text())
    llm = Llama(model_path=model, n_ctx=256, n_threads=2, logits_all=True, verbose=False)
    for i, path in enumerate(paths):
        llm.reset()
        llm.eval(path)
        np.save(out_dir / f"{i}.npy", np.asarray(llm.scores[:len(path)], dtype=np.float32))


def llama_logits(python: Path, model: Path, paths: list[list[int]]) -> list[np.ndarray]:
    with tempfile.TemporaryDirectory() as d:
        job = Path(d) / "paths.json"
        job.write_text(json.dumps(paths))
        subprocess.run([str(python), __file__, "--llama-side", str(model), str(job), d],
                       check=True, timeout=3600)
        return [np.load(Path(d) / f"{i}.npy") for i in range(len(paths))]


def write_f32_copy(src: Path, dst: Path) -> None:
    """The model with every tensor dequantized to F32, every metadata key copied."""
    import gguf
    from gguf_io import copy_fields

    reader = gguf.GGUFReader(str(src))
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(str(dst), arch)
    # the writer wrote the architecture key; GGUF.* are the reader's view of the header
    copy_fields(writer, reader,
                lambda key: not key.startswith("GGUF.") and key != "general.architecture")
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        arr = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(shape)
        writer.add_tensor(t.name, np.ascontiguousarray(arr, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def top2(row: np.ndarray) -> tuple[int, int, float]:
    order = np.argsort(row)[::-1]
    return int(order[0]), int(order[1]), float(row[order[0]] - row[order[1]])


def main() -> int:
    if len(sys.argv) == 5 and sys.argv[1] == "--llama-side":
        llama_side(sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4]))
        return 0
    sys.path.insert(0, str(ROOT))
    from inference_svc.core import Context, Model
    from tests.reference import forward

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--llama-python", type=Path, required=True)
    ap.add_argument("--n", type=int, default=40)
    ap.add_argument("--f32-check", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()

    with Model.load(a.model) as model, Context(model, n_ctx=256, n_threads=2) as ctx:
        weights = model.content.dequantized()
        # the prompts' ids as llama.cpp tokenizes them (the same as the core's tokenizer,
        # tests/test_gemma3_tokenizer.py)
        cases = json.loads((ROOT / "tests" / "fixtures" / "gemma3_oracle.json").read_text())
        by_prompt = {c["prompt"]: c["ids"] for c in cases["greedy"]}
        prompts = [list(by_prompt[p]) for p in PROMPTS]
        paths, ours = [], []
        for ids in prompts:
            ctx.clear(0)
            logits = ctx.decode(0, ids)
            out: list[int] = []
            while len(out) < a.n:
                out.append(int(np.argmax(logits)))
                logits = ctx.decode(0, [out[-1]])
            paths.append(ids + out)
            ctx.clear(0)
            ours.append(ctx.decode(0, ids + out, logits_all=True))
        theirs = llama_logits(a.llama_python, a.model, paths)
        f32 = None
        if a.f32_check:
            with tempfile.TemporaryDirectory(dir=ROOT / "models") as d:
                copy = Path(d) / "gemma3-f32.gguf"
                write_f32_copy(a.model, copy)
                f32 = llama_logits(a.llama_python, copy, paths)
        rows = []
        for i, (ids, path) in enumerate(zip(prompts, paths, strict=True)):
            n0 = len(ids) - 1  # the row whose argmax is the first generated token
            pick_ll = theirs[i][n0:n0 + a.n].argmax(1)
            same = pick_ll == np.array(path[len(ids):])
            agree = int(np.argmin(same)) if not same.all() else a.n
            row: dict[str, object] = {"prompt": PROMPTS[i], "agreement": agree}
            at = n0 + min(agree, a.n - 1)  # the divergence (or the last position)
            ref = forward(model.hparams, weights, path[:at + 1])[-1]
            scale = float(np.abs(ref).max())
            r1, r2, margin = top2(ref)
            err_ours = float(np.abs(ours[i][at] - ref).max())
            err_ll = float(np.abs(theirs[i][at] - ref).max())
            row.update({
                "position": agree, "reference_top2": [r1, r2],
                "reference_margin": round(margin, 4), "max_abs_reference": round(scale, 3),
                "ours_pick": int(ours[i][at].argmax()), "llama_pick": int(theirs[i][at].argmax()),
                "ours_error": round(err_ours, 5), "llama_error": round(err_ll, 4),
                "ours_error_rel": round(err_ours / scale, 6),
                "llama_error_rel": round(err_ll / scale, 5),
                # the reference's own gap between the two engines' picks
                "reference_gap_ours_minus_llama": round(
                    float(ref[int(ours[i][at].argmax())] - ref[int(theirs[i][at].argmax())]), 4),
            })
            if agree < a.n:
                loser = max(err_ours if row["ours_pick"] != r1 else 0.0,
                            err_ll if row["llama_pick"] != r1 else 0.0)
                row["near_tie"] = margin < loser
            if f32 is not None:
                err_f32 = float(np.abs(f32[i][at] - ref).max())
                row["llama_f32_error_rel"] = round(err_f32 / scale, 6)
                row["llama_f32_agreement"] = int(
                    np.argmin(np.append(f32[i][n0:n0 + a.n].argmax(1)
                                        == np.array(path[len(ids):]), False)))
            rows.append(row)
    result = {"tool": "gemma3_agreement", "model": str(a.model), "n": a.n,
              "agree_ge_32": sum(1 for r in rows if r["agreement"] >= 32), "prompts": rows}
    text = json.dumps(result)
    if a.out is not None:
        a.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
