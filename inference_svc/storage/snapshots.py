"""Between a slot's core state and the bytes of its slot files, both ways.

`SlotFileBuffers` holds a slot's files while the core captures its state into
them and encodes them in place (`encode_slot`: the same from state read apart);
`prepare_restore` loads and checks both files against the running models
before anything touches a slot, so the engine only has to apply the result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from inference_svc.chat import Message
from inference_svc.sessions import chat_record, turn_mark
from inference_svc.storage import slotfile
from inference_svc.storage.slotfile import DTYPE_BY_NAME, KVLayout, ModelSpec
from inference_svc.storage.store import SlotStore

if TYPE_CHECKING:
    from inference_svc.core import Context, Model


def model_spec(model: Model, n_ctx: int, kv_type: str) -> ModelSpec:
    """What a slot file must match to restore into a context of this model, size and KV
    type: the model, the KV layout and type, and the size."""
    hp = model.hparams
    layout = KVLayout(hp.n_layer, hp.n_head_kv, hp.head_dim, DTYPE_BY_NAME[kv_type])
    local = tuple(hp.layer_is_local(layer) for layer in range(hp.n_layer))
    return ModelSpec(model.fingerprint, model.name, layout, hp.n_vocab, n_ctx,
                     local if any(local) else ())


def context_spec(ctx: Context) -> ModelSpec:
    """model_spec of an open context."""
    return model_spec(ctx.model, ctx.n_ctx, ctx.kv_type)


@dataclass(frozen=True)
class EncodedSlot:
    target: memoryview
    draft: memoryview | None
    target_sha256: str
    n_tokens: int


class SlotFileBuffers:
    """The two slot files' buffers for one save, handed to the core to write a slot's
    state straight into the place the files hold it (`target` and `draft` allocate;
    SlotOwner.capture takes them); `encode` then writes the headers and digests around
    it. The state is copied once, by the core, on its way to the store (a target of a
    model with sliding-window layers too: its buffer has room for the window section).
    `tail`: optional sections the target file holds after the KV (a session's
    conversation, chat_record), written in room left for them."""

    def __init__(self, target: ModelSpec, tail: Sequence[slotfile.Section] = ()) -> None:
        self._spec = target
        self._tail = tuple(tail)
        self._tail_size = slotfile.sections_size(self._tail)
        self._target: memoryview | None = None
        self._draft: memoryview | None = None

    def target(self, state_len: int) -> memoryview:
        """Room for `state_len` bytes of target state; the view the core writes."""
        self._target = _file_buffer(slotfile.target_file_size(state_len, self._spec,
                                                              self._tail_size))
        return self._target[slotfile.target_state_at(self._spec):][:state_len]

    def draft(self, state_len: int) -> memoryview:
        """Room for `state_len` bytes of draft state; the view the core writes."""
        self._draft = _file_buffer(slotfile.draft_file_size(state_len))
        return self._draft[slotfile.DRAFT_STATE_AT:][:state_len]

    def encode(self, target_state: memoryview, draft_state: memoryview | None,
               draft: ModelSpec | None) -> EncodedSlot:
        """The slot files of the state the core wrote (`target_state`, `draft_state`:
        the views it returned, which must fill the rooms allocated)."""
        tbuf = _written(self._target, target_state,
                        lambda n: slotfile.target_file_size(n, self._spec, self._tail_size))
        tbuf, n_tokens, tdigest = slotfile.seal_target(tbuf, self._spec, self._tail)
        dbuf = None
        if draft_state is not None and draft is not None:
            dbuf = _written(self._draft, draft_state, slotfile.draft_file_size)
            slotfile.seal_draft(dbuf, tdigest, draft)
        return EncodedSlot(tbuf.toreadonly(), dbuf.toreadonly() if dbuf is not None else None,
                           tdigest, n_tokens)


def _file_buffer(size: int) -> memoryview:
    # not zero-filled: the core and the headers write every byte
    return memoryview(np.empty(size, dtype=np.uint8))


def _written(buf: memoryview | None, state: memoryview, file_size: Callable[[int], int]
             ) -> memoryview:
    if buf is None or len(buf) != file_size(len(state)):
        raise ValueError(f"{len(state)} bytes of core state do not fill the file buffer")
    return buf


def encode_slot(target_state: bytes | memoryview, draft_state: bytes | memoryview | None,
                target: ModelSpec, draft: ModelSpec | None,
                tail: Sequence[slotfile.Section] = ()) -> EncodedSlot:
    """The slot files of core state read apart (Context.get_state,
    SpecDecoder.draft_state): copied into SlotFileBuffers and encoded there. `tail`:
    optional sections of the target file after the KV."""
    bufs = SlotFileBuffers(target, tail)
    tview = bufs.target(len(target_state))
    tview[:] = memoryview(target_state).cast("B")
    dview = None
    if draft_state is not None:
        dview = bufs.draft(len(draft_state))
        dview[:] = memoryview(draft_state).cast("B")
    return bufs.encode(tview, dview, draft)


@dataclass(frozen=True)
class PreparedRestore:
    """Checked content ready to be applied to a slot."""

    target_parts: tuple[bytes, bytes, bytes | memoryview]  # Context.set_state_parts pieces
    n_tokens: int
    draft_state: memoryview | None  # the sidecar's draft state; None: apply the policy
    draft_note: str  # why draft_state is None
    n_read: int
    chat: tuple[Message, ...] | None = None  # a session's conversation (CHAT section)
    generation: int = 0  # the store's generation of what was read (0: none kept)
    turn: turn_mark.TurnMark | None = None  # a session's last turn (TURN section)


def prepare_restore(store: SlotStore, name: str, target: ModelSpec,
                    draft: ModelSpec | None, deadline: float | None = None) -> PreparedRestore:
    """Loads (by `deadline`, time.monotonic()) and checks a saved slot. Raises NotFound,
    slotfile errors for the target; a sidecar that cannot be used only sets draft_note."""
    stored = store.load(name, deadline=deadline)
    target_digest, body_digest = stored.target_sha256, stored.target_body_sha256
    if target_digest is None:  # both from one pass over the file
        target_digest, body_digest = slotfile.file_digests(stored.target)
    t = slotfile.decode_target(stored.target, body_digest)
    slotfile.check_target(t, target)
    n_read = len(stored.target)
    draft_state, note = None, stored.draft_note
    if draft is None:
        note = "no draft model"
    elif stored.draft is not None:
        n_read += len(stored.draft)
        try:
            d = slotfile.decode_draft(stored.draft)
            slotfile.check_draft(d, target_digest, t, draft)
            draft_state, note = memoryview(d.state), ""
        except slotfile.SlotFileError as exc:
            note = str(exc)
    return PreparedRestore(slotfile.core_parts_from_target(t), t.n_tokens, draft_state, note,
                           n_read, chat_record.unpack(t.extra), stored.generation,
                           turn_mark.unpack(t.extra))
