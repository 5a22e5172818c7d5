"""Held-out benchmark prompts by domain, as token ids for a given tokenizer.

- code: the first tokens of the stdlib validation files (the split the bundled
  models and the SmolLM2 draft train without);
- prose: the first tokens of the Python language reference topics shipped in
  ``pydoc_data.topics`` (excluded from every training corpus here);
- chat: hand-written user questions in the chat template of the tokenizer's
  model (ChatML's ``<|im_start|>``/``<|im_end|>`` or Gemma's turns); the SmolLM2
  draft trains only on conversations the target wrote itself, so none of these is
  in its data;
- grounded: input-grounded chat requests whose answer copies from the input:
  rewrite or comment code given in the prompt (validation files), quote from a
  given text (language reference topics), extract fields from a given document;
- random: uniformly random token ids (seeded): text where no drafter can pay.
"""

from __future__ import annotations

from typing import Any

from corpus import load_corpus

CORPUS_SEED = 1234  # the split tools/train_models.py and tools/train_draft.py train with
DOMAINS = ("code", "prose", "chat", "grounded", "random")
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


def chat_turn(tok: Any, user: str) -> list[int]:
    """A user turn and the assistant's opening in the model's chat template: ChatML
    (with the SmolLM2 system prompt) or Gemma's turns."""
    vocab = tok.data.tokens
    nl = tok.encode("\n")
    if "<|im_start|>" in vocab and "<|im_end|>" in vocab:
        start, end = vocab.index("<|im_start|>"), vocab.index("<|im_end|>")
        return [start, *tok.encode(f"system\n{CHAT_SYSTEM}"), end, *nl,
                start, *tok.encode(f"user\n{user}"), end, *nl, start, *tok.encode("assistant\n")]
    if "<start_of_turn>" in vocab and "<end_of_turn>" in vocab:
        start, end = vocab.index("<start_of_turn>"), vocab.index("<end_of_turn>")
        bos = [tok.bos_id] if getattr(tok, "bos_id", None) is not None else []
        return [*bos, start, *tok.encode(f"user\n{user}"), end, *nl,
                start, *tok.encode("model\n")]
    raise ValueError("chat prompts need ChatML (<|im_start|>) or Gemma (<start_of_turn>) turns")


def chat_prompts(tok: Any, n: int) -> list[list[int]]:
    """Up to n of the questions as (system +) user turn + the assistant's opening."""
    return [chat_turn(tok, q) for q in CHAT_QUESTIONS[:n]]


# made-up records for the extraction tasks (no real people)
RECORDS = (
    ("Invoice 20931", "Customer: Maren Holt, 14 Alder Road, Tromsø. Email: m.holt@example.org. "
     "Items: 3 x oak shelf at 89.00 EUR, 1 x wall bracket set at 12.50 EUR. Due: 2026-01-15."),
    ("Support ticket 5521", "Reported by Tomasz Wielki (tomasz.w@example.net), product Aurora "
     "router model AX-300, firmware 2.4.1. Symptom: the 5 GHz network drops every ten minutes. "
     "Priority: high. Opened: 2026-03-02."),
    ("Job posting", "Position: Senior Data Engineer at Lindqvist Analytics, Gothenburg. Salary "
     "range 62,000-75,000 EUR. Skills: Python, SQL, Apache Spark. Contact: jobs@example.com. "
     "Apply before 2026-05-30."),
    ("Shipping notice", "Order 77-4410 for Ines Carvalho, Rua das Flores 8, Porto, shipped via "
     "NorthPost tracking number NP99812345PT, 2 parcels, total weight 4.2 kg, expected "
     "delivery 2026-02-11."),
)
GROUNDED_CODE = (
    "Rewrite the following Python code with type hints added to every function. Return the "
    "complete code.",
    "Add a one-line comment above every function in the following Python code and return the "
    "whole code.",
    "Rename the first function in the following Python code to `main_helper`, update its "
    "calls, and return the complete code.",
)
GROUNDED_TEXT = (
    "Quote, word for word, the two sentences of the following text that matter most, then "
    "summarise it in one sentence.",
)
GROUNDED_RECORD = "Extract every field of the following record as a JSON object."


def grounded_prompts(tok: Any, n: int, length: int) -> list[list[int]]:
    """n input-grounded requests, cycling over code, text and record tasks; the code
    and text they embed are the first `length` tokens of held-out files."""
    codes = [tok.decode(ids) for ids in code_prompts(tok, n, length)]
    texts = [tok.decode(ids) for ids in prose_prompts(tok, n, length)]
    tasks: list[str] = []
    for i in range(n):
        kind = i % 4
        if kind < 2:
            tasks.append(f"{GROUNDED_CODE[i // 4 % len(GROUNDED_CODE)]}\n\n```python\n"
                         f"{codes[i]}\n```")
        elif kind == 2:
            tasks.append(f"{GROUNDED_TEXT[0]}\n\n{texts[i]}")
        else:
            title, body = RECORDS[i // 4 % len(RECORDS)]
            tasks.append(f"{GROUNDED_RECORD}\n\n{title}\n{body}")
    return [chat_turn(tok, t) for t in tasks]


def random_prompts(tok: Any, n: int, length: int, seed: int = 7) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    n_vocab = len(tok.data.tokens)
    return [[rng.randrange(n_vocab) for _ in range(length)] for _ in range(n)]


def domain_prompts(tok: Any, domain: str, n: int, length: int) -> list[list[int]]:
    if domain == "code":
        return code_prompts(tok, n, length)
    if domain == "prose":
        return prose_prompts(tok, n, length)
    if domain == "chat":
        return chat_prompts(tok, n)
    if domain == "grounded":
        return grounded_prompts(tok, n, length)
    if domain == "random":
        return random_prompts(tok, n, length)
    raise ValueError(f"unknown domain {domain!r} (one of {', '.join(DOMAINS)})")
