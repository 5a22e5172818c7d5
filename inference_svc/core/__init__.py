"""The binding of the decoding core: the cffi module (1:1 with native/warmslot.h), models and
contexts, GGUF loading, tokenizers, fingerprints. May import only the compiled core, numpy and
the standard library: nothing else of the service."""

from . import fingerprint
from .errors import (
    BadStateError,
    BufferTooSmallError,
    ContextFullError,
    CoreError,
    CoreMemoryError,
    InvalidArgumentError,
    ModelLoadError,
    ThreadError,
)
from .gguf_file import GGUFModel, HParams, Tensor, check_model_file, load_gguf
from .model import Context, Model
from .tokenizer import StreamDecoder, Tokenizer

__all__ = [
    "BadStateError",
    "BufferTooSmallError",
    "Context",
    "ContextFullError",
    "CoreError",
    "CoreMemoryError",
    "GGUFModel",
    "HParams",
    "InvalidArgumentError",
    "Model",
    "ModelLoadError",
    "StreamDecoder",
    "ThreadError",
    "Tensor",
    "Tokenizer",
    "check_model_file",
    "fingerprint",
    "load_gguf",
]
