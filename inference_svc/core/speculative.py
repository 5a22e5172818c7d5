"""Speculative decoding over a target and an optional draft context (ws_spec).

Per slot the decoder keeps the sequence S: the tokens in the target's KV plus
at most one *pending* token (sampled, not yet decoded). `prefill` appends
tokens and samples the next one; `step` returns one or more new tokens (the
accepted proposals plus one target token); `commit` decodes the pending token
so the KV holds the whole conversation.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import binding
from .binding import ffi
from .errors import InvalidArgumentError
from .handle import (
    NativeHandle,
    Room,
    buffer_arg,
    new_room,
    read_tokens,
    room_arg,
    state_buffer,
)
from .model import Context
from .params import (
    LOOKUP_MAX_MATCH,
    LOOKUP_ONLY,
    MAX_DRAFT,
    MAX_LOGPROBS,
    MAX_PENALTY_LAST_N,
    NO_SPEC,
    Counters,
    Drafter,
    SamplingParams,
    SpecParams,
    StepResult,
    TokenLogprob,
    lookup_lengths,
)

# the plain values live in .params (importable without the compiled core); the
# decoder's callers keep importing them from here too
__all__ = [
    "LOOKUP_MAX_MATCH",
    "LOOKUP_ONLY",
    "MAX_DRAFT",
    "MAX_LOGPROBS",
    "MAX_PENALTY_LAST_N",
    "NO_SPEC",
    "Counters",
    "Drafter",
    "SamplingParams",
    "SpecDecoder",
    "SpecParams",
    "StepResult",
    "TokenLogprob",
    "lookup",
    "lookup_lengths",
]

def lookup(tokens: list[int], min_match: int, k: int) -> list[int]:
    """The lookup drafter's rule (ws_spec_lookup): the k tokens that follow the most
    recent earlier occurrence of the longest suffix of `tokens` of min_match..
    LOOKUP_MAX_MATCH tokens, or [] when there is none."""
    toks = np.ascontiguousarray(tokens, dtype=np.int32)
    drafts = np.zeros(max(k, 1), dtype=np.int32)
    n = binding.spec_lookup(ffi.from_buffer("int32_t[]", toks) if toks.size else ffi.NULL,
                            int(toks.size), min_match, k, ffi.from_buffer("int32_t[]", drafts))
    return drafts[:n].tolist()


def _c_samplings(samplings: list[SamplingParams]) -> Any:
    c = ffi.new("ws_sampling_params[]", len(samplings))
    for i, sp in enumerate(samplings):
        sp.fill(c[i])
    return c


class SpecDecoder(NativeHandle):
    """Target (and draft) contexts over the same slots, with per-slot RNG and counters."""

    _what = "speculative decoder"

    def __init__(self, target: Context, draft: Context | None = None,
                 head: Context | None = None) -> None:
        """head: a Context of a feature head (inference_svc.core.head.Head) for the
        target, of the same slots and positions."""
        if draft is not None:
            t_tok, d_tok = target.model.content.tokenizer, draft.model.content.tokenizer
            if t_tok.tokens != d_tok.tokens or t_tok.merges != d_tok.merges:
                raise InvalidArgumentError(
                    f"the draft's vocabulary ({len(d_tok.tokens)} tokens) differs from the "
                    f"target's ({len(t_tok.tokens)} tokens)")
        self.target = target
        self.draft = draft
        self.n_slots = target.n_slots
        self.n_ctx = target.n_ctx
        self._handle: Any = binding.spec_init(target.handle,
                                              draft.handle if draft is not None else ffi.NULL)
        self.head = head
        if head is not None:
            ids = np.ascontiguousarray(head.model.token_ids, dtype=np.int32)
            binding.spec_set_head(self.handle, head.handle, ffi.from_buffer("int32_t[]", ids),
                                  int(ids.size))
        self._out = np.empty(MAX_DRAFT + 1, dtype=np.int32)
        self._out_ptr = ffi.from_buffer("int32_t[]", self._out)
        self._lp_ids = np.zeros((MAX_DRAFT + 1, 1 + MAX_LOGPROBS), dtype=np.int32)
        self._lp_vals = np.zeros((MAX_DRAFT + 1, 1 + MAX_LOGPROBS), dtype=np.float32)
        self._lp_ids_ptr = ffi.from_buffer("int32_t[]", self._lp_ids)
        self._lp_vals_ptr = ffi.from_buffer("float[]", self._lp_vals)

    @property
    def has_draft(self) -> bool:
        return self.draft is not None

    def _free(self, handle: Any) -> None:
        binding.spec_free(handle)

    def check(self, sampling: SamplingParams, spec: SpecParams | None = None) -> None:
        """Validates parameters before any decoding (InvalidArgumentError names the bad one)."""
        binding.spec_check_params(self.handle, sampling.to_c(),
                                  spec.to_c() if spec is not None else ffi.NULL)

    def seed(self, slot: int, seed: int) -> None:
        binding.spec_seed(self.handle, slot, seed & 0xFFFFFFFFFFFFFFFF)

    def n_tokens(self, slot: int) -> int:
        return binding.spec_n_tokens(self.handle, slot)

    def tokens(self, slot: int) -> list[int]:
        return read_tokens(binding.spec_tokens, self.handle, slot, self.n_tokens(slot))

    def head_status(self, slot: int) -> tuple[int, bool]:
        """(pairs the head's KV holds for the slot, whether the head can draft now)."""
        n, ready = ffi.new("int32_t *"), ffi.new("int *")
        binding.spec_head_status(self.handle, slot, n, ready)
        return int(n[0]), bool(ready[0])

    def draft_n_tokens(self, slot: int) -> int:
        return binding.spec_draft_n_tokens(self.handle, slot)

    def draft_offset(self, slot: int) -> int:
        return binding.spec_draft_offset(self.handle, slot)

    def prefill(self, slot: int, tokens: list[int] | np.ndarray, sampling: SamplingParams,
                with_draft: bool = True) -> int:
        """Appends tokens (with any pending one) and returns the sampled next token."""
        toks = np.ascontiguousarray(tokens, dtype=np.int32)
        ptr = ffi.from_buffer("int32_t[]", toks) if toks.size else ffi.NULL
        return binding.spec_prefill(self.handle, slot, ptr, int(toks.size), sampling.to_c(),
                                    with_draft)

    def prefill_chunk(self, slot: int, tokens: list[int] | np.ndarray,
                      with_draft: bool = True) -> None:
        """Appends (any pending token and) tokens without sampling; with_draft: the
        draft catches up by at most as many tokens."""
        toks = np.ascontiguousarray(tokens, dtype=np.int32)
        if toks.size == 0:
            raise InvalidArgumentError("a prefill chunk needs at least one token")
        binding.spec_prefill_chunk(self.handle, slot, ffi.from_buffer("int32_t[]", toks),
                                   int(toks.size), with_draft)

    def draft_catch_up(self, slot: int, max_tokens: int) -> tuple[int, int]:
        """Decodes at most max_tokens of the draft's lag behind the target's KV:
        (tokens decoded, lag left)."""
        return binding.spec_draft_catch_up(self.handle, slot, max_tokens)

    def step(self, slot: int, sampling: SamplingParams, spec: SpecParams = NO_SPEC,
             max_new: int = MAX_DRAFT + 1) -> list[int]:
        """One verification pass: 1..min(max_new, n_max + 1) new tokens."""
        n = binding.spec_step(self.handle, slot, sampling.to_c(), spec.to_c(), max_new,
                              self._out_ptr, MAX_DRAFT + 1)
        return self._out[:n].tolist()

    def step_multi(self, slots: list[int], samplings: list[SamplingParams]) -> list[int]:
        """A target-only step for several distinct slots in one forward pass: one new
        token each, the same as `step(slot, sampling, NO_SPEC)` for each in turn."""
        n = len(slots)
        if n == 0 or len(samplings) != n:
            raise InvalidArgumentError("step_multi needs one sampling per slot (>= 1 slot)")
        out = ffi.new("int32_t[]", n)
        binding.spec_step_multi(self.handle, ffi.new("int32_t[]", slots),
                                _c_samplings(samplings), n, out)
        return list(out)

    def step_batch(self, slots: list[int], samplings: list[SamplingParams],
                   specs: list[SpecParams], max_new: list[int]) -> list[StepResult]:
        """One speculative step for each of several distinct slots with one target pass
        for all of them (the drafts propose together, one round per proposal): for
        each slot the same tokens, RNG draws and state as `step` on it alone."""
        n = len(slots)
        if n == 0 or not len(samplings) == len(specs) == len(max_new) == n:
            raise InvalidArgumentError("step_batch needs one sampling, spec and max_new per slot")
        c_pps = ffi.new("ws_spec_params[]", n)
        for i, pp in enumerate(specs):
            pp.fill(c_pps[i])
        per = MAX_DRAFT + 1
        out = np.empty(n * per, dtype=np.int32)
        info = ffi.new("ws_spec_step_info[]", n)
        binding.spec_step_batch(self.handle, n, ffi.new("int32_t[]", slots),
                                _c_samplings(samplings), c_pps, ffi.new("int32_t[]", max_new),
                                ffi.from_buffer("int32_t[]", out), info)
        return [StepResult(out[i * per:i * per + int(info[i].n_out)].tolist(),
                           int(info[i].n_drafted), Drafter(int(info[i].drafter)),
                           int(info[i].match))
                for i in range(n)]

    def logprobs(self, slot: int) -> list[TokenLogprob]:
        """The logprobs of the tokens the slot's last prefill / step / step_batch
        returned ([] when its sampling did not ask for them)."""
        rows, top = binding.spec_logprobs(self.handle, slot, self._lp_ids_ptr, self._lp_vals_ptr,
                                          MAX_DRAFT + 1)
        ids, vals = self._lp_ids[:rows].tolist(), self._lp_vals[:rows].tolist()
        return [TokenLogprob(i[0], v[0], list(zip(i[1:1 + top], v[1:1 + top], strict=True)))
                for i, v in zip(ids, vals, strict=True)]

    def commit(self, slot: int) -> None:
        binding.spec_commit(self.handle, slot)

    def truncate(self, slot: int, n: int) -> None:
        binding.spec_truncate(self.handle, slot, n)

    def keep_min(self, slot: int) -> int:
        """Context.keep_min of the target: a truncation keeps 0 or at least this many."""
        return self.target.keep_min(slot)

    def clear(self, slot: int) -> None:
        binding.spec_clear(self.handle, slot)

    def draft_reset(self, slot: int, offset: int = 0) -> None:
        binding.spec_draft_reset(self.handle, slot, offset)

    def draft_sync(self, slot: int) -> int:
        return binding.spec_draft_sync(self.handle, slot)

    def counters(self, slot: int) -> Counters:
        c = ffi.new("ws_spec_counters *")
        binding.spec_counters_get(self.handle, slot, c)
        return Counters(int(c.n_steps), int(c.n_drafted), int(c.n_accepted),
                        int(c.n_draft_prefill), [int(x) for x in c.drafted_at],
                        [int(x) for x in c.accepted_at])

    def draft_state(self, slot: int) -> memoryview:
        """The slot's draft state (ws_spec_state_get format), as Context.get_state."""
        size = binding.spec_state_size(self.handle, slot)
        return state_buffer(size, lambda ptr: binding.spec_state_get(self.handle, slot, ptr,
                                                                     size))

    def set_draft_state(self, slot: int, data: bytes | bytearray | memoryview) -> int:
        return binding.spec_state_set(self.handle, slot, *buffer_arg(data))

    def slot_state(self, slot: int, target_room: Room = new_room,
                   draft_room: Room = new_room) -> tuple[memoryview, memoryview | None]:
        """The slot's whole state after committing its pending token: the target
        context's slot state and the draft state (None without a draft model), each a
        read-only view of the bytes the core wrote. `target_room(size)` /
        `draft_room(size)` give the writable views of `size` bytes the core writes
        them into (by default new buffers; a caller may place them inside its own)."""
        tsize, dsize = binding.spec_slot_state_prepare(self.handle, slot)
        tview = target_room(tsize)
        dview = draft_room(dsize) if self.has_draft or self.head is not None else None
        tn, dn = binding.spec_slot_state_get(self.handle, slot, *room_arg(tview, tsize),
                                             *room_arg(dview, dsize))
        return (tview[:tn].toreadonly(),
                dview[:dn].toreadonly() if dview is not None else None)

    def set_slot_state(self, slot: int, target_parts: tuple[bytes | memoryview, ...],
                       draft: bytes | memoryview | None, draft_offset: int) -> tuple[bool, str]:
        """Replaces the slot's content: the target state from its (header, tokens, KV)
        parts, then the draft state, or an empty draft from `draft_offset` when there
        is none or the core refuses it. (draft loaded, why it was refused). A refused
        target raises BadStateError and leaves the slot empty."""
        header, tokens, kv = target_parts
        dptr, dlen = buffer_arg(draft) if draft is not None else (ffi.NULL, 0)
        return binding.spec_slot_state_set(self.handle, slot, *buffer_arg(header),
                                           *buffer_arg(tokens), *buffer_arg(kv), dptr, dlen,
                                           draft_offset)

    def generate(self, slot: int, prompt: list[int], n_new: int, sampling: SamplingParams,
                 spec: SpecParams = NO_SPEC) -> list[int]:
        """Convenience: prefill prompt, then step until n_new tokens (tests, benchmarks)."""
        out = [self.prefill(slot, prompt, sampling, with_draft=spec.n_max > 0)]
        while len(out) < n_new:
            out += self.step(slot, sampling, spec, n_new - len(out))
        return out

