"""The committed feature head (models/smollm2-head.gguf) against HEAD_SPEC: the file
parses, carries every tensor in its shape and type and the committed target's
fingerprint, fits 15 MB; the numpy reference (tools/head_ref.py) computes what the
torch module it was trained as (tools/head_model.py) computes, for pairs of real
target hidden states, both in one causal pass and chained as drafting runs."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from inference_svc.core.gguf_file import load_gguf
from inference_svc.core.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
TARGET = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
HEAD = ROOT / "models" / "smollm2-head.gguf"
sys.path.insert(0, str(ROOT / "tools"))

from head_gguf import NORMS, expected_shapes, read_head  # noqa: E402
from head_ref import KVCache, draft, forward, target_embeddings  # noqa: E402

TEXTS = ("<|im_start|>user\nHow do I make a good cup of tea?<|im_end|>\n<|im_start|>assistant\n"
         "Start with fresh water",
         "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(")


@pytest.fixture(scope="module")
def target() -> Any:
    assert TARGET.exists(), f"{TARGET} is missing: `make fetch-models` (part of `make setup`)"
    content = load_gguf(TARGET)
    yield content
    content.close()


def test_head_file_is_the_spec_format(target: Any) -> None:
    assert HEAD.stat().st_size <= 15 * 1024 * 1024
    reader = gguf.GGUFReader(str(HEAD))
    assert reader.fields["general.architecture"].contents() == "warmslot-head"
    head = read_head(HEAD)
    hp = target.hparams
    k = len(head.token_ids)
    assert 2048 <= k <= 16384
    shapes = expected_shapes(head.cfg, k)
    assert {t.name: tuple(reversed(t.shape.tolist())) for t in reader.tensors} == shapes
    # GGUF order: ne[0] is the input width (fc takes 2d)
    (fc,) = [t for t in reader.tensors if t.name == "fc.weight"]
    assert fc.shape.tolist() == [2 * hp.n_embd, hp.n_embd]
    for t in reader.tensors:
        want = gguf.GGMLQuantizationType.F32 if t.name in NORMS else gguf.GGMLQuantizationType.Q8_0
        assert t.tensor_type == want, t.name
    p = "warmslot-head."
    assert reader.fields[p + "token_ids"].types == [gguf.GGUFValueType.ARRAY,
                                                   gguf.GGUFValueType.INT32]
    ids = head.token_ids
    assert len(np.unique(ids)) == k and ids.min() >= 0 and ids.max() < hp.n_vocab
    assert (head.cfg.n_embd, head.cfg.n_ff, head.cfg.n_head, head.cfg.n_head_kv) == \
        (hp.n_embd, hp.n_ff, hp.n_head, hp.n_head_kv)
    assert head.cfg.n_ctx == hp.n_ctx_train
    assert head.cfg.rope_base == pytest.approx(hp.rope_theta)
    assert head.cfg.norm_eps == pytest.approx(hp.rms_eps)
    assert head.fingerprint == target.fingerprint
    for key in ("embedding_length", "feed_forward_length", "attention.head_count",
                "attention.head_count_kv", "context_length"):
        assert reader.fields[p + key].types == [gguf.GGUFValueType.UINT32], key
    for key in ("rope.freq_base", "attention.layer_norm_rms_epsilon"):
        assert reader.fields[p + key].types == [gguf.GGUFValueType.FLOAT32], key


@pytest.fixture(scope="module")
def traced(target: Any) -> dict[str, Any]:
    """Real pairs: the target's hidden states of two texts (torch teacher), the head as
    the torch module, the numpy reference's inputs."""
    torch = pytest.importorskip("torch")
    from head_model import Head
    from teacher import hidden_states, load_teacher
    from train_head import head_tensors

    head = read_head(HEAD)
    module = Head(head.cfg, len(head.token_ids), n_pos=64)
    with torch.no_grad():
        params = dict(zip(head_tensors(module), [
            module.fc.weight, module.block.attn_norm.weight, module.block.wq.weight,
            module.block.wk.weight, module.block.wv.weight, module.block.wo.weight,
            module.block.ffn_norm.weight, module.block.w_gate.weight, module.block.w_up.weight,
            module.block.w_down.weight, module.out_norm.weight, module.output.weight],
            strict=True))
        for name, p in params.items():
            p.copy_(torch.from_numpy(head.tensors[name]))
    teacher = load_teacher(TARGET)
    rows = []
    tok = Tokenizer(target.tokenizer)
    for text in TEXTS:
        tokens = tok.encode(text)
        rows.append((tokens, hidden_states(teacher, tokens).numpy()))
    return {"torch": torch, "head": head, "module": module.eval(), "rows": rows,
            "embd": target_embeddings(TARGET)}


def test_numpy_reference_forward_matches_the_torch_head(traced: dict[str, Any]) -> None:
    torch, head, module = traced["torch"], traced["head"], traced["module"]
    for tokens, hidden in traced["rows"]:
        embd = traced["embd"][tokens[1:]]
        g, logits = forward(head, KVCache(), hidden[:-1], embd, start=0)
        with torch.no_grad():
            g_t = module(torch.from_numpy(hidden[None, :-1]), torch.from_numpy(embd[None]))
            logits_t = module.logits(g_t)
        scale = np.abs(g).max()
        assert np.abs(g - g_t[0].double().numpy()).max() < 1e-4 * scale
        assert np.abs(logits - logits_t[0].double().numpy()).max() < 1e-3
        assert (logits.argmax(-1) == logits_t[0].argmax(-1).numpy()).all()
        # one pass over all pairs == the pairs one at a time through the KV cache
        cache = KVCache()
        for p in range(len(tokens) - 1):
            g1, _ = forward(head, cache, hidden[p : p + 1], embd[p : p + 1], start=p)
            assert np.abs(g1[0] - g[p]).max() < 1e-9 * scale


def test_chained_drafting_matches_the_unrolled_training_path(traced: dict[str, Any]) -> None:
    """Step s fed the head's own ĝ, attending to the true pairs and its own chain: the
    numpy reference's KV-cache drafting equals Head.unrolled (what trains and measures
    the chained agreement); with the chain's tokens, draft() is the argmax path."""
    torch, head, module = traced["torch"], traced["head"], traced["module"]
    steps = 4
    for tokens, hidden in traced["rows"]:
        embd = traced["embd"][tokens[1:]]
        with torch.no_grad():
            outs = module.unrolled(torch.from_numpy(hidden[None, :-1]),
                                   torch.from_numpy(embd[None]), steps)
        scale = np.abs(hidden).max()
        for n in (3, len(tokens) - steps - 1):  # drafting after token n, from pair n - 1
            cache = KVCache()
            forward(head, cache, hidden[: n - 1], embd[: n - 1], start=0)
            h = hidden[n - 1]
            for s in range(1, steps + 1):
                q = n - 1 + s - 1
                g, _ = forward(head, cache, h[None], embd[q : q + 1], start=q)
                assert np.abs(g[0] - outs[s - 1][0, q].double().numpy()).max() < 1e-4 * scale
                h = g[0]
            cache.truncate(n - 1)
            drafted = draft(head, cache, hidden[n - 1], tokens[n], n - 1, traced["embd"], 1)
            _, logits = forward(head, KVCache(), hidden[:n], embd[:n], start=0)
            assert drafted == [int(head.token_ids[int(np.argmax(logits[n - 1]))])]
