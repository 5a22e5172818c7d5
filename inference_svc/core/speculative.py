"""Speculative decoding over a target and an optional draft context (ws_spec).

Per slot the decoder keeps the sequence S: the tokens in the target's KV plus
at most one *pending* token (sampled, not yet decoded). `prefill` appends
tokens and samples the next one; `step` returns one or more new tokens (the
accepted proposals plus one target token); `commit` decodes the pending token
so the KV holds the whole conversation.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
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

MAX_DRAFT = int(binding.lib.WS_SPEC_MAX_DRAFT)  # most tokens drafted in one step
LOOKUP_MAX_MATCH = int(binding.lib.WS_SPEC_LOOKUP_MAX_MATCH)  # longest suffix a lookup matches


MAX_LOGPROBS = 20
MAX_PENALTY_LAST_N = 4096


@dataclass(frozen=True)
class SamplingParams:
    """The penalties first (over the last repeat_last_n tokens; llama.cpp's repeat
    penalty, OpenAI's presence and frequency penalties), then greedy at temperature 0,
    otherwise temperature, top-k, min-p, top-p in that order. logprobs > 0: the core
    keeps each returned token's logprob and that many alternatives (`logprobs`)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int = 0

    def fill(self, c: Any) -> None:
        """Sets the fields of a ws_sampling_params."""
        c.temperature, c.top_k, c.top_p, c.min_p = (
            self.temperature, self.top_k, self.top_p, self.min_p)
        c.repeat_penalty, c.repeat_last_n = self.repeat_penalty, self.repeat_last_n
        c.presence_penalty, c.frequency_penalty = self.presence_penalty, self.frequency_penalty
        c.n_logprobs = self.logprobs

    def to_c(self) -> Any:
        c = ffi.new("ws_sampling_params *")
        self.fill(c)
        return c


@dataclass(frozen=True)
class TokenLogprob:
    """A returned token's log-probability and the most likely tokens' (most likely
    first): the log-softmax of the target's raw logits at its position."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


class Drafter(enum.IntEnum):
    """Which drafter made a step's proposals (ws_drafter)."""

    NONE = int(binding.lib.WS_DRAFTER_NONE)
    MODEL = int(binding.lib.WS_DRAFTER_MODEL)
    LOOKUP = int(binding.lib.WS_DRAFTER_LOOKUP)
    HEAD = int(binding.lib.WS_DRAFTER_HEAD)


def lookup_lengths(k: int, min_match: int = 1) -> tuple[int, ...]:
    """SpecParams.lookup_k proposing k tokens after every match of min_match or more."""
    return tuple(k if m >= min_match else 0 for m in range(1, LOOKUP_MAX_MATCH + 1))


@dataclass(frozen=True)
class SpecParams:
    """The draft model drafts up to n_max tokens, stopping below p_min top probability
    after n_min. The lookup drafter, where the longest recent repeat of the end of
    the slot's own sequence is m tokens long, proposes lookup_k[m - 1] tokens instead
    (m = 1..LOOKUP_MAX_MATCH; () or all 0: off)."""

    n_max: int = 8
    n_min: int = 0
    p_min: float = 0.0
    lookup_k: tuple[int, ...] = ()
    head_n_max: int = 0  # the feature head's proposals where lookup does not propose

    def __post_init__(self) -> None:
        if self.lookup_k and len(self.lookup_k) != LOOKUP_MAX_MATCH:
            raise InvalidArgumentError(f"lookup_k has {len(self.lookup_k)} lengths, not one "
                                       f"per match length 1..{LOOKUP_MAX_MATCH}")

    def fill(self, c: Any) -> None:
        """Sets the fields of a ws_spec_params."""
        c.n_max, c.n_min, c.p_min = self.n_max, self.n_min, self.p_min
        c.head_n_max = self.head_n_max
        for m, k in enumerate(self.lookup_k, start=1):
            c.lookup_k[m] = k

    def to_c(self) -> Any:
        c = ffi.new("ws_spec_params *")
        self.fill(c)
        return c

    @property
    def lookup(self) -> bool:
        """Whether the lookup drafter may propose."""
        return any(self.lookup_k)


NO_SPEC = SpecParams(n_max=0)
LOOKUP_ONLY = SpecParams(n_max=0, lookup_k=lookup_lengths(8))


@dataclass(frozen=True)
class StepResult:
    """One slot's part of a batched step: the new tokens, how many were drafted, by
    which drafter, and the lookup drafter's longest match (0: none or lookup off)."""

    tokens: list[int]
    drafted: int
    drafter: Drafter = Drafter.NONE
    match: int = 0


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


@dataclass
class Counters:
    n_steps: int = 0
    n_drafted: int = 0
    n_accepted: int = 0
    n_draft_prefill: int = 0
    drafted_at: list[int] = field(default_factory=lambda: [0] * MAX_DRAFT)
    accepted_at: list[int] = field(default_factory=lambda: [0] * MAX_DRAFT)

    def __sub__(self, other: Counters) -> Counters:
        return Counters(
            self.n_steps - other.n_steps,
            self.n_drafted - other.n_drafted,
            self.n_accepted - other.n_accepted,
            self.n_draft_prefill - other.n_draft_prefill,
            [a - b for a, b in zip(self.drafted_at, other.drafted_at, strict=True)],
            [a - b for a, b in zip(self.accepted_at, other.accepted_at, strict=True)],
        )

    @property
    def acceptance(self) -> float:
        return self.n_accepted / self.n_drafted if self.n_drafted else 0.0


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

