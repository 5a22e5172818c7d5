"""Between a slot's core state and the bytes of its slot files, both ways.

`encode_slot` turns captured state bytes into the target file and sidecar;
`prepare_restore` loads and checks both files against the running models
before anything touches a slot, so the engine only has to apply the result.
"""

from __future__ import annotations

from dataclasses import dataclass

from inference_svc import slotfile
from inference_svc.core import Context, Model
from inference_svc.slotfile import DTYPE_BY_NAME, KVLayout, ModelSpec
from inference_svc.store import SlotStore


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
    target: bytes
    draft: bytes | None
    target_sha256: str
    n_tokens: int


def encode_slot(target_state: bytes, draft_state: bytes | None, target: ModelSpec,
                draft: ModelSpec | None) -> EncodedSlot:
    """The slot files of captured core state (Context.get_state, SpecDecoder.draft_state)."""
    t = slotfile.target_from_core(target_state, target)
    tbytes = slotfile.encode_target(t)
    tdigest = slotfile.digest(tbytes)
    dbytes = None
    if draft_state is not None and draft is not None:
        dbytes = slotfile.encode_draft(slotfile.draft_from_core(draft_state, tdigest, draft))
    return EncodedSlot(tbytes, dbytes, tdigest, t.n_tokens)


@dataclass(frozen=True)
class PreparedRestore:
    """Checked content ready to be applied to a slot."""

    target_parts: tuple[bytes, bytes, bytes | memoryview]  # Context.set_state_parts pieces
    n_tokens: int
    draft_state: bytes | None  # SpecDecoder.set_draft_state bytes; None: apply the policy
    draft_note: str  # why draft_state is None
    n_read: int


def prepare_restore(store: SlotStore, name: str, target: ModelSpec,
                    draft: ModelSpec | None, deadline: float | None = None) -> PreparedRestore:
    """Loads (by `deadline`, time.monotonic()) and checks a saved slot. Raises NotFound,
    slotfile errors for the target; a sidecar that cannot be used only sets draft_note."""
    stored = store.load(name, deadline=deadline)
    t = slotfile.decode_target(stored.target, stored.target_body_sha256)
    slotfile.check_target(t, target)
    n_read = len(stored.target)
    draft_state, note = None, stored.draft_note
    if draft is None:
        note = "no draft model"
    elif stored.draft is not None:
        n_read += len(stored.draft)
        try:
            d = slotfile.decode_draft(stored.draft)
            target_digest = stored.target_sha256 or slotfile.digest(stored.target)
            slotfile.check_draft(d, target_digest, t, draft)
            draft_state, note = bytes(d.state), ""
        except slotfile.SlotFileError as exc:
            note = str(exc)
    return PreparedRestore(slotfile.core_parts_from_target(t), t.n_tokens, draft_state, note,
                           n_read)
