"""Reads a llama-architecture GGUF file into F32 arrays, hyper-parameters,
tokenizer metadata and a model fingerprint. The C core parses no files."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .errors import ModelLoadError

SUPPORTED_ARCHITECTURES = ("llama",)


@dataclass(frozen=True)
class HParams:
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_rot: int
    n_ctx_train: int
    rms_eps: float
    rope_theta: float

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


@dataclass(frozen=True)
class TokenizerData:
    model: str
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    bos_id: int | None
    eos_id: int | None


@dataclass
class GGUFModel:
    """A model file's content: F32 weights by GGUF tensor name, and metadata."""

    path: Path
    name: str
    architecture: str
    hparams: HParams
    tensors: dict[str, np.ndarray]
    tokenizer: TokenizerData
    fingerprint: str
    tensor_types: dict[str, str] = field(default_factory=dict)

    @property
    def tied_output(self) -> bool:
        return "output.weight" not in self.tensors

    @property
    def n_params(self) -> int:
        return int(sum(t.size for t in self.tensors.values()))


def _field(reader: Any, key: str, default: Any = None, required: bool = True) -> Any:
    f = reader.fields.get(key)
    if f is None:
        if required and default is None:
            raise ModelLoadError(f"GGUF metadata key {key!r} is missing")
        return default
    return f.contents()


def _to_f32(tensor: Any) -> np.ndarray:
    """F32/F16/BF16 natively; every other GGML type through gguf's own dequantizer."""
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    qtype = tensor.tensor_type
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # numpy (rows, cols)
    data = np.asarray(tensor.data)
    if qtype == Q.F32:
        arr = data.astype(np.float32, copy=False)
    elif qtype == Q.F16:
        arr = data.astype(np.float32)
    elif qtype == Q.BF16:
        raw = data.view(np.uint8).reshape(-1).view(np.uint16).astype(np.uint32) << 16
        arr = raw.view(np.float32)
    else:
        try:
            arr = quants.dequantize(data, qtype)
        except (NotImplementedError, ValueError, KeyError) as exc:
            raise ModelLoadError(
                f"tensor {tensor.name!r} has type {qtype.name}, which cannot be dequantized: {exc}"
            ) from exc
    return np.ascontiguousarray(arr.reshape(shape), dtype=np.float32)


def _hparams(reader: Any, arch: str, tensors: dict[str, np.ndarray]) -> HParams:
    p = f"{arch}."
    n_embd = int(_field(reader, p + "embedding_length"))
    n_head = int(_field(reader, p + "attention.head_count"))
    if n_head <= 0 or n_embd % n_head != 0:
        raise ModelLoadError(f"embedding_length {n_embd} is not a multiple of head_count {n_head}")
    tok = tensors.get("token_embd.weight")
    if tok is None:
        raise ModelLoadError("tensor 'token_embd.weight' is missing")
    return HParams(
        n_vocab=int(_field(reader, p + "vocab_size", tok.shape[0])),
        n_embd=n_embd,
        n_layer=int(_field(reader, p + "block_count")),
        n_head=n_head,
        n_head_kv=int(_field(reader, p + "attention.head_count_kv", n_head)),
        n_ff=int(_field(reader, p + "feed_forward_length")),
        n_rot=int(_field(reader, p + "rope.dimension_count", n_embd // n_head)),
        n_ctx_train=int(_field(reader, p + "context_length")),
        rms_eps=float(_field(reader, p + "attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_field(reader, p + "rope.freq_base", 10000.0)),
    )


def _expected_shapes(hp: HParams) -> dict[str, tuple[int, ...]]:
    hd = hp.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (hp.n_vocab, hp.n_embd),
        "output_norm.weight": (hp.n_embd,),
    }
    for i in range(hp.n_layer):
        b = f"blk.{i}."
        shapes |= {
            b + "attn_norm.weight": (hp.n_embd,),
            b + "attn_q.weight": (hp.n_head * hd, hp.n_embd),
            b + "attn_k.weight": (hp.n_head_kv * hd, hp.n_embd),
            b + "attn_v.weight": (hp.n_head_kv * hd, hp.n_embd),
            b + "attn_output.weight": (hp.n_embd, hp.n_head * hd),
            b + "ffn_norm.weight": (hp.n_embd,),
            b + "ffn_gate.weight": (hp.n_ff, hp.n_embd),
            b + "ffn_up.weight": (hp.n_ff, hp.n_embd),
            b + "ffn_down.weight": (hp.n_embd, hp.n_ff),
        }
    return shapes


def _validate(hp: HParams, tensors: dict[str, np.ndarray]) -> None:
    for name, shape in _expected_shapes(hp).items():
        t = tensors.get(name)
        if t is None:
            raise ModelLoadError(f"tensor {name!r} is missing")
        if t.shape != shape:
            raise ModelLoadError(f"tensor {name!r} has shape {t.shape}, expected {shape}")
    out = tensors.get("output.weight")
    if out is not None and out.shape != (hp.n_vocab, hp.n_embd):
        raise ModelLoadError(f"tensor 'output.weight' has shape {out.shape}")
    for name, t in tensors.items():
        if not np.isfinite(t).all():
            raise ModelLoadError(f"tensor {name!r} holds NaN or infinite values")


def fingerprint(hp: HParams, tensors: dict[str, np.ndarray]) -> str:
    """SHA-256 over the hyper-parameters and the F32 bytes of every tensor, by name."""
    h = hashlib.sha256()
    h.update(b"warmslot-model-v1\0")
    h.update(json.dumps(asdict(hp), sort_keys=True).encode())
    for name in sorted(tensors):
        t = tensors[name]
        h.update(name.encode() + b"\0" + json.dumps(list(t.shape)).encode() + b"\0")
        h.update(t.tobytes())
    return h.hexdigest()


def _tokenizer(reader: Any) -> TokenizerData:
    model = str(_field(reader, "tokenizer.ggml.model"))
    tokens = [str(t) for t in _field(reader, "tokenizer.ggml.tokens")]
    types = _field(reader, "tokenizer.ggml.token_type", [1] * len(tokens), required=False)
    merges = _field(reader, "tokenizer.ggml.merges", [], required=False)
    bos = _field(reader, "tokenizer.ggml.bos_token_id", None, required=False)
    eos = _field(reader, "tokenizer.ggml.eos_token_id", None, required=False)
    return TokenizerData(
        model=model,
        tokens=tokens,
        token_types=[int(t) for t in types],
        merges=[str(m) for m in merges],
        bos_id=None if bos is None else int(bos),
        eos_id=None if eos is None else int(eos),
    )


_GGUF_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # bytes
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_ARCH_KEY = b"general.architecture"


def peek_architecture(path: Path) -> str | None:
    """general.architecture read straight from the GGUF header, skipping the metadata
    before it (writers put it first), so a model of another architecture is refused
    before its vocabulary and tensors are parsed. None when the header cannot say
    (not little-endian GGUF v2/v3, or no such key): the full reader decides then."""
    import struct

    with open(path, "rb") as f:

        def take(n: int) -> bytes:
            b = f.read(n)
            if len(b) != n:
                raise EOFError
            return b

        def u32() -> int:
            return int(struct.unpack("<I", take(4))[0])

        def u64() -> int:
            return int(struct.unpack("<Q", take(8))[0])

        def skip(vtype: int) -> None:
            if vtype in _GGUF_SCALARS:
                f.seek(_GGUF_SCALARS[vtype], 1)
            elif vtype == _GGUF_STRING:
                f.seek(u64(), 1)
            elif vtype == _GGUF_ARRAY:
                itype, count = u32(), u64()
                if itype in _GGUF_SCALARS:
                    f.seek(_GGUF_SCALARS[itype] * count, 1)
                else:
                    for _ in range(count):
                        skip(itype)
            else:
                raise ValueError(f"GGUF value type {vtype}")

        try:
            if take(4) != b"GGUF" or u32() not in (2, 3):
                return None
            u64()  # tensor count
            for _ in range(min(u64(), 1 << 16)):
                key = take(u64())
                vtype = u32()
                if key == _ARCH_KEY:
                    return take(u64()).decode() if vtype == _GGUF_STRING else None
                skip(vtype)
        except (EOFError, ValueError, UnicodeDecodeError, struct.error, OSError):
            return None
    return None


def _check_architecture(path: Path, arch: str | None) -> None:
    if arch is not None and arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: architecture {arch!r} is not supported (supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)})"
        )


def check_model_file(path: str | Path) -> None:
    """The cheap checks of a model file (it exists, a supported architecture in its
    header), in milliseconds whatever its size; load_gguf runs them first too."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"model file not found: {path}")
    _check_architecture(path, peek_architecture(path))


def load_gguf(path: str | Path) -> GGUFModel:
    """Loads a GGUF model; every problem is a ModelLoadError naming it."""
    path = Path(path)
    check_model_file(path)
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path), "r")
    except Exception as exc:  # the reader raises ValueError, struct.error, IndexError...
        raise ModelLoadError(f"{path} is not a readable GGUF file: {exc}") from exc
    try:
        arch = str(_field(reader, "general.architecture"))
        _check_architecture(path, arch)
        tensors: dict[str, np.ndarray] = {}
        types: dict[str, str] = {}
        for t in reader.tensors:
            tensors[t.name] = _to_f32(t)
            types[t.name] = t.tensor_type.name
        hp = _hparams(reader, arch, tensors)
        _validate(hp, tensors)
        tok = _tokenizer(reader)
        if len(tok.tokens) != hp.n_vocab:
            raise ModelLoadError(
                f"{path}: tokenizer has {len(tok.tokens)} tokens, the model {hp.n_vocab}"
            )
        name = str(_field(reader, "general.name", path.stem, required=False))
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"{path}: malformed GGUF content: {exc}") from exc
    return GGUFModel(
        path=path,
        name=name,
        architecture=arch,
        hparams=hp,
        tensors=tensors,
        tokenizer=tok,
        fingerprint=fingerprint(hp, tensors),
        tensor_types=types,
    )
