"""The slot owner: the one holder of what the slots contain.

It owns the models' contexts (target, draft model, feature head) and the speculative
decoder over them, and so every slot's tokens, KV, draft state, RNG and counters. The
operations on a slot's content are its methods and nobody else's: prefill (in chunks
the scheduler sizes), step, commit, truncate, capture, apply, clear. Once the engine
thread starts it owns the slots (`own`): a change from any other thread raises, so the
content of a slot cannot change under a running unit. Reads (tokens, counters) are
answered on any thread.

What a slot is bound to (a session) is the scheduler's record, changed only through
the scheduler; where a session's state lives below the slots is the sessions' (their
versions and tiers). The captured state comes out as the core wrote it: slot-file
encoding, digests and store I/O run on the caller's thread (inference_svc.storage).
"""

from __future__ import annotations

import random
import struct
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from inference_svc.core import Context
from inference_svc.core.handle import Room, new_room
from inference_svc.core.header import const
from inference_svc.core.params import Counters, SamplingParams, SpecParams, StepResult
from inference_svc.core.speculative import SpecDecoder, TokenLogprob

if TYPE_CHECKING:
    from inference_svc.config import Config
    from inference_svc.core import Model, Tokenizer
    from inference_svc.core.head import Head

# the core's slot state (ws_slot_state_get): a header of 8 u32, word 6 its token count,
# then the tokens (int32 each) and the KV
_STATE_HEAD = const("WS_STATE_HEADER_BYTES")
_STATE_N_TOKENS = struct.Struct("<I")
_STATE_N_TOKENS_AT = 24


@dataclass(frozen=True)
class SlotState:
    """A slot's whole state as the decoding core writes it, in parts: the target
    context's slot state (WSKV) and the draft state (WSSP: pending offset, lag, RNG,
    counters and the draft's KV), each a view of the buffer the core wrote."""

    target: memoryview
    draft: memoryview | None
    n_tokens: int

    def target_parts(self) -> tuple[memoryview, memoryview, memoryview]:
        """The target state as `SlotOwner.apply` takes it (header, tokens, KV), views of
        the captured buffer: applying a captured state needs no slot-file decoding."""
        view = self.target
        n = _STATE_N_TOKENS.unpack_from(view, _STATE_N_TOKENS_AT)[0]
        at = _STATE_HEAD + 4 * n
        return view[:_STATE_HEAD], view[_STATE_HEAD:at], view[at:]


@dataclass(frozen=True)
class Applied:
    """What `SlotOwner.apply` did with the draft: `sidecar` True when the saved draft
    state was loaded; otherwise `rejected` says why the core refused it ("" when
    there was none) and the draft was reset."""

    sidecar: bool
    rejected: str = ""


class SlotOwner:
    """The contexts and the decoder of `cfg.slots` slots; see the module's docstring."""

    def __init__(self, cfg: Config, target: Model, draft: Model | None = None,
                 head: Head | None = None) -> None:
        """head: a feature head for the target (inference_svc.core.head), or None."""
        self.target = target
        self.draft = draft
        self.head = head
        self.n_slots = cfg.slots
        self.n_ctx = cfg.ctx or target.hparams.n_ctx_train
        self.tokenizer: Tokenizer = target.tokenizer
        self.eos_id = self.tokenizer.eos_id
        self._owner: int | None = None  # the engine thread's ident, once it runs
        # the KV caches are committed at start (reserve_kv): a machine that cannot hold
        # them fails here, and no prefill or restore pays the first touch of their pages
        self._tctx = Context(target, n_slots=cfg.slots, n_ctx=self.n_ctx, n_threads=cfg.threads,
                             n_batch=cfg.batch, reserve_kv=True, kv_type=cfg.kv_type)
        self._dctx: Context | None = None
        self._hctx: Context | None = None
        self._dec: SpecDecoder | None = None
        try:
            if draft is not None:
                self._dctx = Context(draft, n_slots=cfg.slots, n_ctx=self.n_ctx,
                                     n_threads=cfg.draft_threads, n_batch=cfg.batch,
                                     reserve_kv=True, kv_type=cfg.kv_type)
            if head is not None:
                # one thread: the head's passes are small, and a pool of its own would
                # spin against the target's on the same cores
                self._hctx = Context(head, n_slots=cfg.slots, n_ctx=self.n_ctx, n_threads=1,
                                     n_batch=cfg.batch, reserve_kv=True, kv_type=cfg.kv_type)
            self._dec = SpecDecoder(self._tctx, self._dctx, self._hctx)
        except BaseException:
            self.close()
            raise
        rng = random.SystemRandom() if cfg.seed is None else random.Random(cfg.seed)
        for i in range(self.n_slots):
            self._dec.seed(i, rng.getrandbits(64))

    @property
    def has_draft(self) -> bool:
        """A draft model drafts (a feature head alone does not count)."""
        return self._dctx is not None

    @property
    def _decoder(self) -> SpecDecoder:
        assert self._dec is not None, "the slot owner is closed"
        return self._dec

    def own(self, thread: threading.Thread) -> None:
        """From now on only `thread` (the engine's) changes the slots."""
        self._owner = thread.ident

    def _mine(self) -> SpecDecoder:
        if self._owner is not None and threading.get_ident() != self._owner:
            raise RuntimeError("a slot's content changes on the engine thread only "
                               "(Engine.call / Engine.slot_op)")
        return self._decoder

    def close(self) -> None:
        for obj in (self._dec, self._hctx, self._dctx, self._tctx):
            if obj is not None:
                obj.close()
        self._dec = None

    # ---------------------------------------------------------------- reads

    def n_tokens(self, slot: int) -> int:
        return self._decoder.n_tokens(slot)

    def tokens(self, slot: int) -> list[int]:
        return self._decoder.tokens(slot)

    def keep_min(self, slot: int) -> int:
        """The shortest prefix the slot can be cut back to and continue (sliding-window
        layers hold only their window: below it everything is re-processed)."""
        return self._decoder.keep_min(slot)

    def counters(self, slot: int) -> Counters:
        return self._decoder.counters(slot)

    def draft_n_tokens(self, slot: int) -> int:
        return self._decoder.draft_n_tokens(slot)

    def draft_offset(self, slot: int) -> int:
        return self._decoder.draft_offset(slot)

    def logprobs(self, slot: int) -> list[TokenLogprob]:
        """The logprobs of the tokens the slot's last decoder call returned."""
        return self._decoder.logprobs(slot)

    # ---------------------------------------------------------------- changes

    def seed(self, slot: int, seed: int) -> None:
        self._mine().seed(slot, seed)

    def truncate(self, slot: int, n: int) -> None:
        """Keeps the slot's first n tokens."""
        self._mine().truncate(slot, n)

    def clear(self, slot: int) -> int:
        """Empties the slot; the number of tokens it held."""
        dec = self._mine()
        n = dec.n_tokens(slot)
        dec.clear(slot)
        return n

    def commit(self, slot: int) -> None:
        """Decodes the slot's pending token (a no-op when there is none)."""
        self._mine().commit(slot)

    def draft_catch_up(self, slot: int, max_tokens: int) -> tuple[int, int]:
        """At most max_tokens of the draft's lag decoded: (done, lag left)."""
        return self._mine().draft_catch_up(slot, max_tokens)

    def prefill_chunk(self, slot: int, tokens: list[int], with_draft: bool) -> None:
        """A chunk of a prompt into the KV, nothing sampled."""
        self._mine().prefill_chunk(slot, tokens, with_draft=with_draft)

    def prefill(self, slot: int, tokens: list[int], sampling: SamplingParams,
                with_draft: bool) -> int:
        """The prompt's last tokens into the KV; the token sampled after them."""
        return self._mine().prefill(slot, tokens, sampling, with_draft=with_draft)

    def step_batch(self, slots: list[int], samplings: list[SamplingParams],
                   specs: list[SpecParams], max_new: list[int]) -> list[StepResult]:
        """A decode step (speculative or not) of every slot, in one target pass."""
        return self._mine().step_batch(slots, samplings, specs, max_new)

    def capture(self, slot: int, target_room: Room = new_room,
                draft_room: Room = new_room) -> SlotState:
        """The slot's target and draft state, written by the core into the views
        `target_room(size)` / `draft_room(size)` give (by default new buffers); an idle
        slot's pending token is committed first (a no-op when there is none)."""
        dec = self._mine()
        target, draft = dec.slot_state(slot, target_room, draft_room)
        return SlotState(target, draft, dec.n_tokens(slot))

    def apply(self, slot: int, target_parts: tuple[bytes | memoryview, ...],
              draft_state: bytes | memoryview | None, draft_offset: int) -> Applied:
        """Replaces the slot's content: the target state (header, tokens, KV parts),
        then the draft state, or, when there is none or the core refuses it, an empty
        draft from `draft_offset`. A target the core refuses raises BadStateError and
        leaves the slot empty."""
        loaded, rejected = self._mine().set_slot_state(slot, target_parts, draft_state,
                                                        draft_offset)
        return Applied(loaded, rejected)
