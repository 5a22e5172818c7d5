"""Writes tests/fixtures/bundled_golden.json: the bundled models' fingerprints and the
target's greedy completions of three fixed prompts, through the C core.

    python tools/bundled_golden.py

Run it only when the bundled models are retrained on purpose: the golden test
(tests/test_bundled_models.py) exists to catch any other change in numerics or
weights.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from inference_svc.core import Context, Model  # noqa: E402

MODELS = {"target": ROOT / "models" / "target.gguf", "draft": ROOT / "models" / "draft.gguf"}
PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\n\nclass Config:",
    "    for i in range(len(items)):\n        if",
]
N_TOKENS = 32
OUT = ROOT / "tests" / "fixtures" / "bundled_golden.json"


def greedy(model: Model, prompt: str, n: int) -> list[int]:
    with Context(model, n_ctx=256, n_threads=1) as ctx:
        logits = ctx.decode(0, model.tokenizer.encode(prompt))
        out = []
        for _ in range(n):
            out.append(int(logits.argmax()))
            logits = ctx.decode(0, [out[-1]])
    return out


def main() -> int:
    golden: dict[str, object] = {}
    for role, path in MODELS.items():
        with Model.load(path) as m:
            golden[role] = {"file": path.name, "fingerprint": m.fingerprint,
                            "n_params": m.content.n_params}
    with Model.load(MODELS["target"]) as m:
        golden["greedy"] = [{"prompt": p, "tokens": greedy(m, p, N_TOKENS),
                             "text": m.tokenizer.decode(greedy(m, p, N_TOKENS))}
                            for p in PROMPTS]
    OUT.write_text(json.dumps(golden, indent=1) + "\n")
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
