"""The committed SmolLM2-135M-Instruct draft (models/smollm2-draft.gguf) with its
target (fetched by `make setup`): the file is what the model card says (llama,
Q8_0 matrices, the target's tokenizer metadata byte for byte, at most 15 MB), and
greedy speculative decoding with it gives exactly the target-only tokens for
every n_max from 1 to 16, with the acceptance it had when committed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import gguf
import pytest

from inference_svc.core import Context, Model
from inference_svc.core.speculative import SamplingParams, SpecDecoder, SpecParams

ROOT = Path(__file__).resolve().parent.parent
TARGET = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
DRAFT = ROOT / "models" / "smollm2-draft.gguf"
CODE = ('import os\n\n\ndef list_python_files(root):\n'
        '    """Return the .py files under root."""\n')
CHAT_QUESTION = "How do I make a good cup of tea?"
FLOOR = {"code": 0.028, "chat": 0.033}


def tokenizer_fields(path: Path) -> dict[str, object]:
    reader = gguf.GGUFReader(str(path))
    return {k: (f.types, f.contents()) for k, f in reader.fields.items()
            if k.startswith("tokenizer.")}


@pytest.fixture(scope="module")
def decoder() -> Iterator[SpecDecoder]:
    assert TARGET.exists(), f"{TARGET} is missing: `make fetch-models` (part of `make setup`)"
    with Model.load(TARGET) as tm, Model.load(DRAFT) as dm, \
            Context(tm, n_slots=1, n_ctx=256, n_threads=2) as tc, \
            Context(dm, n_slots=1, n_ctx=256, n_threads=1) as dc:
        dec = SpecDecoder(tc, dc)
        yield dec
        dec.close()


def chat_prompt(dec: SpecDecoder) -> list[int]:
    tok = dec.target.model.tokenizer
    start, end = tok.data.tokens.index("<|im_start|>"), tok.data.tokens.index("<|im_end|>")
    return [start, *tok.encode(f"user\n{CHAT_QUESTION}"), end, *tok.encode("\n"),
            start, *tok.encode("assistant\n")]


def test_draft_file_is_a_q8_llama_with_the_targets_tokenizer() -> None:
    assert DRAFT.stat().st_size <= 15 * 1024 * 1024
    reader = gguf.GGUFReader(str(DRAFT))
    assert reader.fields["general.architecture"].contents() == "llama"
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert {types[n] for n in types if n.endswith("norm.weight")} == {gguf.GGMLQuantizationType.F32}
    assert {types[n] for n in types if not n.endswith("norm.weight")} \
        == {gguf.GGMLQuantizationType.Q8_0}
    assert tokenizer_fields(DRAFT) == tokenizer_fields(TARGET)


@pytest.mark.parametrize("domain", ["code", "chat"])
def test_greedy_speculation_is_target_greedy_for_every_n_max(decoder: SpecDecoder,
                                                             domain: str) -> None:
    tok = decoder.target.model.tokenizer
    prompt = tok.encode(CODE) if domain == "code" else chat_prompt(decoder)
    decoder.clear(0)
    expected = decoder.generate(0, prompt, 40, SamplingParams())
    accepted = drafted = 0
    for n_max in range(1, 17):
        decoder.clear(0)
        before = decoder.counters(0)
        assert decoder.generate(0, prompt, 40, SamplingParams(), SpecParams(n_max=n_max)) \
            == expected
        c = decoder.counters(0) - before
        accepted, drafted = accepted + c.n_accepted, drafted + c.n_drafted
    # at least half the rate the committed draft was measured at (code 172/3073, chat
    # 206/3103 over n_max 1..16): a broken export or a mismatched draft accepts ~nothing
    assert accepted / drafted > FLOOR[domain], (accepted, drafted)


def test_core_rollouts_label_every_position_with_the_cores_own_top_k() -> None:
    """The on-policy training rows (tools/teacher.py): a greedy row takes the argmax at
    every generated position, a chat row's question ends with <|im_end|> and the forced
    assistant header, and every label is the top-k of the core decoding the row alone."""
    pytest.importorskip("torch")
    import sys

    import numpy as np

    sys.path.insert(0, str(ROOT / "tools"))
    from teacher import core_rollouts, top_k_np

    with Model.load(TARGET) as tm:
        tok = tm.tokenizer
        start, end = tok.data.tokens.index("<|im_start|>"), tok.data.tokens.index("<|im_end|>")
        opening = [*tok.encode("\n"), start, *tok.encode("assistant\n")]
        prompt = [start, *tok.encode("user\nHow")]
        rng = np.random.default_rng(5)
        tokens, top = core_rollouts(tm, [prompt, prompt], 72, 0.0, 4, rng,
                                    question=(end, opening, 0.8))
        assert tokens.shape == (2, 72) and top.ids.shape == (2, 71, 4)
        for row, ids, logp in zip(tokens.tolist(), top.ids.numpy(), top.logp.numpy(),
                                  strict=True):
            assert row[: len(prompt)] == prompt
            q_end = row.index(end, len(prompt))
            assert q_end - len(prompt) <= 48  # the question's cap
            answer = q_end + 1 + len(opening)
            assert row[q_end + 1 : answer] == opening
            # greedy after the header: each token is the previous position's top-1
            assert row[answer:] == ids[answer - 1 :, 0].tolist()
            with Context(tm, n_slots=1, n_ctx=96, n_threads=1) as ctx:
                ref_ids, ref_logp = top_k_np(ctx.decode(0, row[:-1], logits_all=True), 4)
            assert (ids == ref_ids).all()
            assert np.abs(logp.astype(np.float32) - ref_logp.astype(np.float32)).max() < 1e-2
        # the two questions were sampled, so the rows differ
        assert tokens[0].tolist() != tokens[1].tolist()
