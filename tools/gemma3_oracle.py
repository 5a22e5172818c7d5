"""Writes tests/fixtures/gemma3_oracle.json: llama.cpp's token ids (encode and decode)
for a tokenizer test set and its greedy continuations of five prompts, on Gemma 3 270M.

Run with a Python that has llama-cpp-python (never a project dependency):
    python tools/gemma3_oracle.py MODEL.gguf tests/fixtures/gemma3_oracle.json
The tests read the JSON only; they never import llama_cpp."""

from __future__ import annotations

import json
import sys

import numpy as np

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea,",
    "Question: What is 17 times 23?\nAnswer:",
    "The three laws of thermodynamics are",
]
TEXTS = [
    "Hello world",
    " Hello  world   with    runs of     spaces",
    "\n\n\ttabs\tand\n newlines \r\n",
    "emoji: 😀🎉👩‍💻 and flags 🇫🇷 done",
    "def f(x):\n    return x**2  # square\n",
    "for (int i = 0; i < n; ++i) { a[i] += b[i] * 2; }",
    "Ünïcödé çhâràctêrs, 日本語のテキスト, Ελληνικά, русский",
    "   leading spaces and trailing   ",
    "numbers 1234567890 3.14159 -42 1e-5",
    "<start_of_turn>user literal markup<end_of_turn>",
    "",
    " ",
    "a",
    "\u00a0non-breaking\u200bzero-width",
]
N_GEN = 40


def main() -> None:
    from llama_cpp import Llama

    llm = Llama(model_path=sys.argv[1], n_ctx=1024, n_threads=2, logits_all=True,
                verbose=False)
    tokenizer = []
    for text in TEXTS:
        ids = llm.tokenize(text.encode(), add_bos=False, special=False)
        tokenizer.append({"text": text, "ids": ids,
                          "with_bos": llm.tokenize(text.encode(), add_bos=True, special=False),
                          "decoded": llm.detokenize(ids).decode("utf-8", "replace")})
    greedy = []
    for prompt in PROMPTS:
        ids = llm.tokenize(prompt.encode(), add_bos=True, special=False)
        llm.reset()
        llm.eval(ids)
        out, margins = [], []
        for _ in range(N_GEN):
            logits = np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float64)
            top = np.argsort(logits)[::-1][:2]
            out.append(int(top[0]))
            margins.append(float(logits[top[0]] - logits[top[1]]))
            llm.eval([int(top[0])])
        greedy.append({"prompt": prompt, "ids": ids, "continuation": out,
                       "margins": margins})
    def rows(entries: list[dict]) -> str:
        return ",\n".join("  " + json.dumps(e, ensure_ascii=False) for e in entries)

    with open(sys.argv[2], "w") as f:
        f.write(f'{{"model": "gemma-3-270m-q4_k_m.gguf",\n "tokenizer": [\n'
                f"{rows(tokenizer)}\n ],\n \"greedy\": [\n{rows(greedy)}\n ]}}\n")


if __name__ == "__main__":
    main()
