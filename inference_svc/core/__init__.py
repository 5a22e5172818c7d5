"""The binding of the decoding core: the cffi module (1:1 with native/warmslot.h), models and
contexts, GGUF loading, tokenizers, fingerprints. May import only the compiled core, numpy and
the standard library: nothing else of the service.

The names below load on first use (PEP 562), so `inference_svc.core.errors`, `.header` and
`.params` import without the compiled core: only a module that calls into C loads it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# name -> the module of this package that defines it
_EXPORTS = {
    "BadStateError": "errors",
    "BufferTooSmallError": "errors",
    "ContextFullError": "errors",
    "CoreError": "errors",
    "CoreMemoryError": "errors",
    "InvalidArgumentError": "errors",
    "ModelLoadError": "errors",
    "ThreadError": "errors",
    "GGUFModel": "gguf_file",
    "HParams": "gguf_file",
    "Tensor": "gguf_file",
    "check_model_file": "gguf_file",
    "load_gguf": "gguf_file",
    "Context": "model",
    "Model": "model",
    "StreamDecoder": "tokenizer",
    "Tokenizer": "tokenizer",
}

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
    "Tensor",
    "ThreadError",
    "Tokenizer",
    "check_model_file",
    "fingerprint",
    "load_gguf",
]

if TYPE_CHECKING:
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


def __getattr__(name: str) -> Any:
    if name == "fingerprint":
        return importlib.import_module(f"{__name__}.fingerprint")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
