"""Reads a llama or gemma3 GGUF file: hyper-parameters, tokenizer metadata, a model
fingerprint, and the tensors as they are stored, memory-mapped from the file (no copy,
no dequantization; the C core computes on the stored types). The C core parses no
files."""

from __future__ import annotations

import mmap
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .errors import ModelLoadError
from .fingerprint import model_fingerprint
from .gguf_parse import Header, parse, peek_field

SUPPORTED_ARCHITECTURES = ("llama", "gemma3")
# gemma3 (llama.cpp's convention): layer l is global when (l+1) % 6 == 0, the others
# attend to the last `sliding_window` positions with RoPE base 10000
GEMMA3_SWA_PERIOD = 6
GEMMA3_ROPE_THETA_SWA = 10000.0
# the core's ws_arch values
ARCH_IDS = {"llama": 0, "gemma3": 1}
# the GGML types the C core computes with (weights stay in these types)
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q5_K",
                   "Q6_K")


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
    # gemma3 only; a llama model keeps the defaults
    arch: str = "llama"
    key_length: int = 0         # dims per head when not n_embd / n_head
    n_swa: int = 0              # sliding window of the local layers
    swa_period: int = 0         # layer l is global when (l+1) % swa_period == 0
    rope_theta_swa: float = 0.0

    @property
    def head_dim(self) -> int:
        return self.key_length or self.n_embd // self.n_head

    def layer_is_local(self, layer: int) -> bool:
        return self.n_swa > 0 and (layer + 1) % self.swa_period != 0

    def identity(self) -> dict[str, Any]:
        """The fields that identify the model (a llama model's as before the gemma3
        fields existed, so its fingerprint is unchanged)."""
        d = asdict(self)
        if self.arch == "llama":
            for k in ("arch", "key_length", "n_swa", "swa_period", "rope_theta_swa"):
                d.pop(k)
        return d


@dataclass(frozen=True)
class TokenizerData:
    model: str
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    bos_id: int | None
    eos_id: int | None
    scores: list[float] = field(default_factory=list)  # the 'llama' (SentencePiece) model
    add_bos: bool = False            # tokenizer.ggml.add_bos_token
    add_space_prefix: bool = False   # tokenizer.ggml.add_space_prefix ('llama' model)
    chat_template: str | None = None  # tokenizer.chat_template (Jinja), None: none


@dataclass(frozen=True)
class Tensor:
    """One tensor as stored: `data` is its bytes, a view of the file's memory map."""

    name: str
    type: int                # GGML type id
    type_name: str
    shape: tuple[int, ...]   # numpy order: (rows, cols) or (n,)
    data: np.ndarray         # uint8 [nbytes]

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape))

    def dequantize(self) -> np.ndarray:
        """The values as F32 (a new array): natively for F32/F16/BF16, else through
        gguf's own dequantizer (the reference's view of the weights)."""
        from gguf import GGMLQuantizationType as Q
        from gguf import quants

        qtype = Q(self.type)
        if qtype == Q.F32:
            arr = self.data.view(np.float32).copy()
        elif qtype == Q.F16:
            arr = self.data.view(np.float16).astype(np.float32)
        elif qtype == Q.BF16:
            arr = (self.data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            arr = quants.dequantize(self.data.reshape(self.shape[0], -1) if len(self.shape) > 1
                                    else self.data, qtype)
        return np.ascontiguousarray(arr.reshape(self.shape), dtype=np.float32)


@dataclass
class GGUFModel:
    """A model file's content: stored tensors by GGUF name, and metadata. `close()`
    releases the memory map (every array view of it must be gone by then)."""

    path: Path
    name: str
    architecture: str
    hparams: HParams
    tensors: dict[str, Tensor]
    tokenizer: TokenizerData
    fingerprint: str
    _map: mmap.mmap | None = field(default=None, repr=False)

    @property
    def tied_output(self) -> bool:
        return "output.weight" not in self.tensors

    @property
    def n_params(self) -> int:
        return sum(t.n_elements for t in self.tensors.values())

    @property
    def tensor_types(self) -> dict[str, str]:
        return {name: t.type_name for name, t in self.tensors.items()}

    def dequantized(self) -> dict[str, np.ndarray]:
        """Every tensor as F32 (new arrays): the reference's weights."""
        return {name: t.dequantize() for name, t in self.tensors.items()}

    def close(self) -> None:
        """Drops the tensor views and unmaps the file. If something outside still holds
        a view, the map stays until that view is collected."""
        self.tensors = {}
        if self._map is not None:
            mapping, self._map = self._map, None
            _unmap(mapping)


def _field(header: Header, key: str, default: Any = None, required: bool = True) -> Any:
    if key not in header.fields:
        if required and default is None:
            raise ModelLoadError(f"GGUF metadata key {key!r} is missing")
        return default
    return header.fields[key]


def _hparams(header: Header, arch: str, tensors: dict[str, Tensor]) -> HParams:
    p = f"{arch}."
    n_embd = int(_field(header, p + "embedding_length"))
    n_head = int(_field(header, p + "attention.head_count"))
    if n_head <= 0 or n_embd % n_head != 0:
        raise ModelLoadError(f"embedding_length {n_embd} is not a multiple of head_count {n_head}")
    tok = tensors.get("token_embd.weight")
    if tok is None:
        raise ModelLoadError("tensor 'token_embd.weight' is missing")
    extra: dict[str, Any] = {}
    if arch == "gemma3":
        key_len = int(_field(header, p + "attention.key_length", n_embd // n_head))
        if int(_field(header, p + "attention.value_length", key_len)) != key_len:
            raise ModelLoadError("gemma3: value_length differs from key_length")
        extra = dict(arch=arch, key_length=key_len,
                     n_swa=int(_field(header, p + "attention.sliding_window", 0,
                                      required=False)),
                     swa_period=GEMMA3_SWA_PERIOD, rope_theta_swa=GEMMA3_ROPE_THETA_SWA)
    return HParams(
        n_vocab=int(_field(header, p + "vocab_size", tok.shape[0])),
        n_embd=n_embd,
        n_layer=int(_field(header, p + "block_count")),
        n_head=n_head,
        n_head_kv=int(_field(header, p + "attention.head_count_kv", n_head)),
        n_ff=int(_field(header, p + "feed_forward_length")),
        n_rot=int(_field(header, p + "rope.dimension_count",
                         extra.get("key_length", n_embd // n_head))),
        n_ctx_train=int(_field(header, p + "context_length")),
        rms_eps=float(_field(header, p + "attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_field(header, p + "rope.freq_base", 10000.0)),
        **extra,
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
        if hp.arch == "gemma3":
            shapes |= {
                b + "attn_q_norm.weight": (hd,),
                b + "attn_k_norm.weight": (hd,),
                b + "post_attention_norm.weight": (hp.n_embd,),
                b + "post_ffw_norm.weight": (hp.n_embd,),
            }
    return shapes


def _validate(hp: HParams, tensors: dict[str, Tensor]) -> None:
    for name, shape in _expected_shapes(hp).items():
        t = tensors.get(name)
        if t is None:
            raise ModelLoadError(f"tensor {name!r} is missing")
        if t.shape != shape:
            raise ModelLoadError(f"tensor {name!r} has shape {t.shape}, expected {shape}")
    out = tensors.get("output.weight")
    if out is not None and out.shape != (hp.n_vocab, hp.n_embd):
        raise ModelLoadError(f"tensor 'output.weight' has shape {out.shape}")
    # the norm weights (small, copied to F32 for the core) must be finite; the matrices
    # are not scanned: that would read the whole file at every load
    for name, t in tensors.items():
        if len(t.shape) == 1 and not np.isfinite(t.dequantize()).all():
            raise ModelLoadError(f"tensor {name!r} holds NaN or infinite values")


def _stored_tensors(header: Header, mapping: mmap.mmap) -> dict[str, Tensor]:
    """Every tensor as a view of `mapping`; an unsupported type is an error naming the
    tensor, raised before any tensor is used."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    tensors: dict[str, Tensor] = {}
    for t in header.tensors:
        try:
            qtype = GGMLQuantizationType(t.type)
        except ValueError:
            raise ModelLoadError(f"tensor {t.name!r} has unknown type id {t.type}") from None
        if qtype.name not in SUPPORTED_TYPES:
            raise ModelLoadError(
                f"tensor {t.name!r} has type {qtype.name}, which the core does not support "
                f"(supported: {', '.join(SUPPORTED_TYPES)})"
            )
        block, size = GGML_QUANT_SIZES[qtype]
        if not t.dims or t.dims[0] % block:
            raise ModelLoadError(f"tensor {t.name!r} of shape {list(t.dims)} is not a whole "
                                 f"number of {qtype.name} blocks of {block}")
        n_bytes = int(np.prod(t.dims)) // block * size
        if t.offset + n_bytes > len(mapping):
            raise ModelLoadError(f"not a readable GGUF file: tensor {t.name!r} extends past "
                                 "the end of the file (truncated?)")
        data = np.frombuffer(mapping, dtype=np.uint8, count=n_bytes, offset=t.offset)
        shape = tuple(reversed(t.dims))  # numpy (rows, cols)
        tensors[t.name] = Tensor(t.name, int(qtype), qtype.name, shape, data)
    return tensors


def _tokenizer(header: Header) -> TokenizerData:
    model = str(_field(header, "tokenizer.ggml.model"))
    tokens = [str(t) for t in _field(header, "tokenizer.ggml.tokens")]
    types = _field(header, "tokenizer.ggml.token_type", [1] * len(tokens), required=False)
    merges = _field(header, "tokenizer.ggml.merges", [], required=False)
    bos = _field(header, "tokenizer.ggml.bos_token_id", None, required=False)
    eos = _field(header, "tokenizer.ggml.eos_token_id", None, required=False)
    scores = _field(header, "tokenizer.ggml.scores", [], required=False)
    template = _field(header, "tokenizer.chat_template", None, required=False)
    return TokenizerData(
        chat_template=None if template is None else str(template),
        scores=[float(x) for x in scores],
        add_bos=bool(_field(header, "tokenizer.ggml.add_bos_token", False, required=False)),
        add_space_prefix=bool(_field(header, "tokenizer.ggml.add_space_prefix", True,
                                     required=False)),
        model=model,
        tokens=tokens,
        token_types=[int(t) for t in types],
        merges=[str(m) for m in merges],
        bos_id=None if bos is None else int(bos),
        eos_id=None if eos is None else int(eos),
    )


def _unmap(mapping: mmap.mmap) -> None:
    try:
        mapping.close()
    except BufferError:
        pass  # views in a traceback: unmapped when they are collected


def _map(path: Path) -> mmap.mmap:
    try:
        with open(path, "rb") as f:
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as exc:  # an empty file cannot be mapped
        raise ModelLoadError(f"{path} is not a readable GGUF file: {exc}") from exc


def _check_architecture(path: Path, arch: object) -> None:
    if arch is not None and arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: architecture {arch!r} is not supported (supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)})"
        )


def peek_architecture(path: Path) -> str | None:
    """general.architecture read from the header alone, so that a model of another
    architecture is refused before its vocabulary and tensors are parsed; None when the
    header cannot say (the full parse decides then)."""
    mapping = _map(path)
    try:
        arch = peek_field(mapping, "general.architecture")
    except (ValueError, struct.error, RecursionError):
        arch = None
    finally:
        _unmap(mapping)
    return arch if isinstance(arch, str) else None


def check_model_file(path: str | Path) -> None:
    """The cheap checks of a model file (it exists, a supported architecture in its
    header), in milliseconds whatever its size; load_gguf runs them first too."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"model file not found: {path}")
    _check_architecture(path, peek_architecture(path))


def load_gguf(path: str | Path, cache_dir: Path | None = None) -> GGUFModel:
    """Loads a GGUF model; every problem is a ModelLoadError naming it. The fingerprint
    is cached under cache_dir (see fingerprint.cache_dir) by file identity."""
    path = Path(path)
    check_model_file(path)
    mapping = _map(path)
    try:
        header = parse(mapping)
    except (ValueError, struct.error, RecursionError) as exc:
        _unmap(mapping)
        raise ModelLoadError(f"{path} is not a readable GGUF file: {exc}") from exc
    try:
        arch = str(_field(header, "general.architecture"))
        _check_architecture(path, arch)
        tensors = _stored_tensors(header, mapping)
        hp = _hparams(header, arch, tensors)
        _validate(hp, tensors)
        tok = _tokenizer(header)
        if len(tok.tokens) != hp.n_vocab:
            raise ModelLoadError(
                f"{path}: tokenizer has {len(tok.tokens)} tokens, the model {hp.n_vocab}"
            )
        name = str(_field(header, "general.name", path.stem, required=False))
        fp = model_fingerprint(path, hp, tensors, cache_dir)
    except ModelLoadError:
        _unmap(mapping)
        raise
    except Exception as exc:
        _unmap(mapping)
        raise ModelLoadError(f"{path}: malformed GGUF content: {exc}") from exc
    return GGUFModel(path=path, name=name, architecture=arch, hparams=hp, tensors=tensors,
                     tokenizer=tok, fingerprint=fp, _map=mapping)
