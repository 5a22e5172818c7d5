"""Held-out benchmark prompts by domain, as token ids for a given tokenizer.

- code: the first tokens of the stdlib validation files (the split the bundled
  models and the SmolLM2 draft train without);
- prose: the first tokens of the Python language reference topics shipped in
  ``pydoc_data.topics`` (excluded from every training corpus here);
- chat: hand-written user questions in the ChatML template of the tokenizer's
  model (needs ``<|im_start|>``/``<|im_end|>``); the SmolLM2 draft trains only
  on conversations the target wrote itself, so none of these is in its data.
"""

from __future__ import annotations

from typing import Any

from corpus import load_corpus

CORPUS_SEED = 1234  # the split tools/train_models.py and tools/train_draft.py train with
DOMAINS = ("code", "prose", "chat")
CHAT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
CHAT_QUESTIONS = (
    "What are three good ways to keep a sourdough starter alive while on holiday?",
    "Explain the difference between a list and a tuple in Python.",
    "Write a short poem about the first snow of winter.",
    "How do I politely decline a meeting invitation from my manager?",
    "Why is the sky blue during the day and red at sunset?",
    "Give me a simple plan to start running three times a week.",
    "Write a Python function that checks whether a string is a palindrome.",
    "What is the difference between weather and climate?",
    "Summarize the main causes of the French Revolution in a few sentences.",
    "How does a hash table work?",
    "Suggest a name and a short description for a cozy coffee shop.",
    "What should I pack for a two-day hiking trip in the mountains?",
    "Explain recursion to a ten-year-old.",
    "How can I reduce the amount of plastic I use at home?",
    "Write a SQL query that returns the ten most recent orders.",
    "What are the health benefits of drinking water?",
)


def code_prompts(tok: Any, n: int, length: int) -> list[list[int]]:
    """The first `length` tokens of n validation files (long enough ones, fixed order)."""
    valid = sorted(load_corpus(CORPUS_SEED).valid, key=lambda f: f.rel)
    return first_tokens(tok, [f.text for f in valid], n, length)


def prose_prompts(tok: Any, n: int, length: int) -> list[list[int]]:
    from pydoc_data.topics import topics

    return first_tokens(tok, [topics[k] for k in sorted(topics)], n, length)


def first_tokens(tok: Any, texts: list[str], n: int, length: int) -> list[list[int]]:
    prompts = []
    for text in texts:
        ids = tok.encode(text)
        if len(ids) >= length:
            prompts.append(ids[:length])
        if len(prompts) == n:
            break
    return prompts


def chat_prompts(tok: Any, n: int) -> list[list[int]]:
    """Up to n of the questions as system + user turn + the assistant's opening."""
    try:
        start, end = tok.data.tokens.index("<|im_start|>"), tok.data.tokens.index("<|im_end|>")
    except ValueError as exc:
        raise ValueError("chat prompts need a vocabulary with <|im_start|> and <|im_end|>") \
            from exc
    nl = tok.encode("\n")
    head = [start, *tok.encode(f"system\n{CHAT_SYSTEM}"), end, *nl]
    return [[*head, start, *tok.encode(f"user\n{q}"), end, *nl,
             start, *tok.encode("assistant\n")] for q in CHAT_QUESTIONS[:n]]


def domain_prompts(tok: Any, domain: str, n: int, length: int) -> list[list[int]]:
    if domain == "code":
        return code_prompts(tok, n, length)
    if domain == "prose":
        return prose_prompts(tok, n, length)
    if domain == "chat":
        return chat_prompts(tok, n)
    raise ValueError(f"unknown domain {domain!r} (one of {', '.join(DOMAINS)})")
