"""GGUF loading: hyper-parameters, tensor types, fingerprints and every bad file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from inference_svc.core import Context, Model, ModelLoadError, fingerprint, gguf_file, load_gguf
from tests.factory import Shape, random_weights, write_model, write_weights

ROOT = Path(__file__).resolve().parent.parent


def test_hparams_and_tokenizer_metadata(small_model_path: Path) -> None:
    m = load_gguf(small_model_path)
    hp = m.hparams
    assert (hp.n_vocab, hp.n_embd, hp.n_layer, hp.n_head, hp.n_head_kv, hp.n_ff, hp.n_rot) == (
        300, 64, 2, 4, 2, 96, 16)
    assert hp.n_ctx_train == 256
    assert m.architecture == "llama"
    assert m.tokenizer.model == "gpt2"
    assert len(m.tokenizer.tokens) == 300
    assert m.tokenizer.bos_id == m.tokenizer.eos_id == 299
    # stored as written (F32 here), as views of the file's memory map, not copies
    assert all(t.type_name == "F32" and not t.data.flags.owndata for t in m.tensors.values())
    assert m.tensors["blk.0.attn_q.weight"].nbytes == 64 * 64 * 4


def test_fingerprint_is_stable_and_tracks_weights(tmp_path: Path) -> None:
    a, b, c = tmp_path / "a.gguf", tmp_path / "b.gguf", tmp_path / "c.gguf"
    write_model(a, seed=1)
    write_model(b, seed=1)
    write_model(c, seed=2)
    fa = load_gguf(a).fingerprint
    assert len(fa) == 64
    assert fa == load_gguf(b).fingerprint
    assert fa != load_gguf(c).fingerprint
    d = tmp_path / "d.gguf"
    write_model(d, Shape(rope_theta=20000.0), seed=1)  # same tensors, other hyper-parameter
    assert load_gguf(d).fingerprint != fa


def test_bf16_is_widened_exactly(tmp_path: Path) -> None:
    path = tmp_path / "bf16.gguf"
    weights = write_model(path, Shape(dtype="bf16"), seed=4)
    m = load_gguf(path)
    w = weights["blk.1.ffn_up.weight"]
    expected = ((w.view(np.uint32) >> 16) << 16).view(np.float32)
    assert np.array_equal(m.tensors["blk.1.ffn_up.weight"].dequantize(), expected)
    assert m.tensor_types["blk.1.ffn_up.weight"] == "BF16"


def test_quantized_tensor_stays_quantized(tmp_path: Path) -> None:
    path = tmp_path / "q8.gguf"
    weights = write_model(path, Shape(dtype="q8_0"), seed=4)
    m = load_gguf(path)
    t = m.tensors["blk.0.attn_k.weight"]
    assert m.tensor_types["blk.0.attn_k.weight"] == t.type_name == "Q8_0"
    assert t.shape == (64, 64) and t.nbytes == 64 * 2 * 34  # 2 blocks of 34 bytes a row
    w = weights["blk.0.attn_k.weight"]
    assert np.abs(t.dequantize() - w).max() < 0.02 * np.abs(w).max()


def test_unsupported_type_names_tensor_and_type(tmp_path: Path) -> None:
    path = tmp_path / "q5_1.gguf"
    shape = Shape()
    weights = random_weights(shape, 0)
    writer_path = tmp_path / "plain.gguf"
    write_weights(writer_path, shape, weights, 0, "plain")
    # the same model with one matrix stored as Q5_1, which the core has no kernel for
    reader = gguf.GGUFReader(str(writer_path))
    w = gguf.GGUFWriter(str(path), "llama")
    for f in reader.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        w.add_key_value(f.name, f.contents(), f.types[0],
                        f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        arr = np.array(t.data).reshape(tuple(reversed(t.shape.tolist())))
        if t.name == "blk.1.ffn_up.weight":
            q = gguf.quants.quantize(arr, gguf.GGMLQuantizationType.Q5_1)
            w.add_tensor(t.name, q, raw_dtype=gguf.GGMLQuantizationType.Q5_1)
        else:
            w.add_tensor(t.name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError,
                       match="tensor 'blk.1.ffn_up.weight' has type Q5_1, which the core "
                             "does not support"):
        load_gguf(path)


def mapped(path: Path) -> bool:
    return str(path.resolve()) in Path("/proc/self/maps").read_text()


def test_memory_map_is_released_on_close(tmp_path: Path) -> None:
    path = tmp_path / "mapped.gguf"
    write_model(path, Shape(dtype="q4_1"), seed=2)
    model = Model.load(path)
    with Context(model, n_ctx=16) as ctx:
        ctx.decode(0, [1, 2, 3])
        assert mapped(path)
    model.close()
    assert not mapped(path)


def test_fingerprint_is_cached_by_file_identity(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    path, cache = tmp_path / "m.gguf", tmp_path / "cache"
    write_model(path, Shape(dtype="q4_0"), seed=3)
    first = load_gguf(path, cache_dir=cache).fingerprint
    assert len(list((cache / "fingerprints").iterdir())) == 1

    def refuse(*args: object) -> str:
        raise AssertionError("the cached fingerprint was computed again")

    monkeypatch.setattr(fingerprint, "compute", refuse)
    assert load_gguf(path, cache_dir=cache).fingerprint == first
    # another file (other inode and mtime) with other weights: computed, not the cached one
    monkeypatch.undo()
    path.unlink()
    write_model(path, Shape(dtype="q4_0"), seed=4)
    second = load_gguf(path, cache_dir=cache).fingerprint
    assert second != first
    assert second == fingerprint.compute(load_gguf(path).hparams, load_gguf(path).tensors)


def test_fingerprint_covers_the_stored_type(tmp_path: Path) -> None:
    """The same weights stored as two types are two models."""
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    write_model(a, Shape(dtype="q8_0"), seed=1)
    write_model(b, Shape(dtype="q4_0"), seed=1)
    assert load_gguf(a).fingerprint != load_gguf(b).fingerprint


def bad_files(tmp_path: Path, good: Path) -> dict[str, tuple[Path, str]]:
    data = good.read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[: len(data) // 2])
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(data[:10])
    text = tmp_path / "text.gguf"
    text.write_text("this is not a model\n" * 10)
    arch = tmp_path / "gpt2arch.gguf"
    write_model(arch, arch="gpt2")
    missing_tensor = tmp_path / "missing_tensor.gguf"
    w = gguf.GGUFWriter(str(missing_tensor), "llama")
    w.add_embedding_length(8)
    w.add_head_count(2)
    w.add_block_count(1)
    w.add_feed_forward_length(8)
    w.add_context_length(8)
    w.add_tensor("token_embd.weight", np.zeros((260, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {
        "missing": (tmp_path / "nope.gguf", "model file not found"),
        "truncated": (truncated, "not a readable GGUF file"),
        "header_only": (header_only, "not a readable GGUF file"),
        "not_gguf": (text, "not a readable GGUF file"),
        "architecture": (arch, "architecture 'gpt2' is not supported"),
        "missing_tensor": (missing_tensor, "tensor 'output_norm.weight' is missing"),
    }


@pytest.mark.parametrize("case", ["missing", "truncated", "header_only", "not_gguf",
                                  "architecture", "missing_tensor"])
def test_bad_files_raise_model_load_error(tmp_path: Path, small_model_path: Path,
                                          case: str) -> None:
    path, message = bad_files(tmp_path, small_model_path)[case]
    with pytest.raises(ModelLoadError, match=message):
        load_gguf(path)


def test_unknown_tensor_type(tmp_path: Path, small_model_path: Path) -> None:
    """A tensor type id the format does not know: a clear error, not a crash."""
    m = gguf.GGUFReader(str(small_model_path))
    t = m.tensors[0]
    # the type id of the first tensor info sits right after its dims
    data = bytearray(small_model_path.read_bytes())
    type_field = t.field.parts[-2]
    offset = t.field.offset + sum(p.nbytes for p in t.field.parts[:-2])
    assert type_field.nbytes == 4
    data[offset:offset + 4] = (999).to_bytes(4, "little")
    bad = tmp_path / "badtype.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="999"):
        load_gguf(bad)


@pytest.mark.parametrize("case", ["missing", "not_gguf"])
def test_cli_reports_one_line_and_fails(tmp_path: Path, small_model_path: Path,
                                        case: str) -> None:
    path, message = bad_files(tmp_path, small_model_path)[case]
    proc = subprocess.run(
        [sys.executable, "-m", "inference_svc.complete", "--model", str(path), "--prompt", "x"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0]
    assert "Traceback" not in proc.stderr


def test_architecture_is_checked_before_the_file_is_parsed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An unsupported architecture is refused from the header alone: the full reader
    (vocabulary, tensors) never runs."""
    from tests.factory import Shape, write_model

    bad = tmp_path / "qwen2.gguf"
    write_model(bad, Shape(n_vocab=300, n_embd=64, n_layer=1, n_head=4, n_head_kv=2, n_ff=96),
                arch="qwen2")

    def no_parse(*args: object, **kw: object) -> None:
        raise AssertionError("the GGUF file was parsed")

    monkeypatch.setattr(gguf_file, "parse", no_parse)
    with pytest.raises(ModelLoadError, match="architecture 'qwen2' is not supported"):
        load_gguf(bad)


def test_header_parser_agrees_with_the_gguf_reader(tmp_path: Path) -> None:
    from inference_svc.core.gguf_parse import parse

    path = tmp_path / "mixed.gguf"
    write_model(path, Shape(n_embd=256, n_ff=512, dtype="mixed"), seed=6)
    header = parse(path.read_bytes())
    reader = gguf.GGUFReader(str(path))
    expected = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert header.fields == expected
    assert [(t.name, t.type, t.offset, list(t.dims)) for t in header.tensors] == [
        (t.name, int(t.tensor_type), int(t.data_offset), t.shape.tolist())
        for t in reader.tensors]


def test_header_that_nests_arrays_without_end_is_refused(tmp_path: Path) -> None:
    """A metadata array of arrays of arrays... (each 12 bytes) must not crash the parser."""
    import struct

    nest = struct.pack("<IQ", 9, 1) * 5000  # array element type ARRAY, count 1, ...
    data = (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"k"
            + struct.pack("<I", 9) + nest)
    path = tmp_path / "nested.gguf"
    path.write_bytes(data)
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        load_gguf(path)
