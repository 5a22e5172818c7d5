"""The parameters and results of the speculative decoder (ws_spec) as plain values.

Sampling and drafting parameters, a step's result, the counters: what the engine,
the request types and the configuration pass around. Their limits are the core's own
constants, read from its header (inference_svc.core.header), so this module imports
without the compiled core; only `to_c` (a call into the core) loads it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from .errors import InvalidArgumentError
from .header import const

MAX_DRAFT = const("WS_SPEC_MAX_DRAFT")  # most tokens drafted in one step
LOOKUP_MAX_MATCH = const("WS_SPEC_LOOKUP_MAX_MATCH")  # longest suffix a lookup matches


MAX_LOGPROBS = const("WS_SPEC_MAX_LOGPROBS")  # alternatives a token's logprobs may list
MAX_PENALTY_LAST_N = const("WS_SPEC_MAX_PENALTY_LAST_N")  # longest penalty window


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
        from .binding import ffi  # the compiled core: only to call it

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

    NONE = const("WS_DRAFTER_NONE")
    MODEL = const("WS_DRAFTER_MODEL")
    LOOKUP = const("WS_DRAFTER_LOOKUP")
    HEAD = const("WS_DRAFTER_HEAD")


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
        from .binding import ffi  # the compiled core: only to call it

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
