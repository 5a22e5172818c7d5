"""Domain types of the service, each with `from_pb` / `to_pb` for its messages.

Handlers stay thin: they convert a request with `from_pb`, call the engine and
convert the result with `to_pb`. Every check of a request's content is here.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from inference_svc import chat
from inference_svc.chat import ChatTemplate
from inference_svc.config import Config
from inference_svc.core.params import (
    MAX_DRAFT,
    MAX_LOGPROBS,
    MAX_PENALTY_LAST_N,
    Counters,
    SamplingParams,
    SpecParams,
    TokenLogprob,
    lookup_lengths,
)
from inference_svc.errors import InvalidArgument
from inference_svc.pb import inference_pb2 as pb
from inference_svc.prompts import BoundedTokenizer
from inference_svc.sessions.names import check_session_name
from inference_svc.sessions.turn_mark import check_turn_id

if TYPE_CHECKING:
    from inference_svc.core import Tokenizer

MAX_STOP_STRINGS = 16
MAX_STOP_BYTES = 256


class StopReason(enum.IntEnum):
    EOS = pb.STOP_REASON_EOS
    MAX_TOKENS = pb.STOP_REASON_MAX_TOKENS
    STOP_STRING = pb.STOP_REASON_STOP_STRING


class DraftPolicy(enum.IntEnum):
    NONE = pb.DRAFT_POLICY_NONE
    SIDECAR = pb.DRAFT_POLICY_SIDECAR
    REPREFILL = pb.DRAFT_POLICY_REPREFILL
    EMPTY = pb.DRAFT_POLICY_EMPTY

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass(frozen=True)
class RequestContext:
    """What checking a request needs to know about the running service."""

    config: Config
    tokenizer: Tokenizer | BoundedTokenizer
    n_vocab: int
    n_ctx: int
    n_slots: int
    has_draft: bool
    chat: ChatTemplate | None = None  # None: Chat is FAILED_PRECONDITION
    has_head: bool = False  # a feature head is loaded (--head)


def check_slot_id(id_slot: int, n_slots: int, allow_any: bool = False) -> int:
    if allow_any and id_slot == -1:
        return -1
    if not 0 <= id_slot < n_slots:
        allowed = "-1 (any) or " if allow_any else ""
        raise InvalidArgument(f"id_slot {id_slot} is out of range: {allowed}0..{n_slots - 1}")
    return id_slot


def check_tokens(tokens: list[int], n_vocab: int, what: str) -> None:
    bad = next((t for t in tokens if not 0 <= t < n_vocab), None)
    if bad is not None:
        raise InvalidArgument(
            f"{what} holds token id {bad}, outside the vocabulary 0..{n_vocab - 1}")


def _check_range(name: str, value: float, ok: bool, rule: str) -> None:
    if not ok or (isinstance(value, float) and math.isnan(value)):
        raise InvalidArgument(f"{name} {value:g} is outside {rule}")


def sampling_from_pb(m: pb.SamplingParams, cfg: Config,
                     logprobs: int = 0) -> tuple[SamplingParams, int | None]:
    d = cfg.sampling

    def get(name: str) -> float:
        return getattr(m, name) if m.HasField(name) else getattr(d, name)

    t, k, p, mp = get("temperature"), get("top_k"), get("top_p"), get("min_p")
    rp, last_n = get("repeat_penalty"), get("repeat_last_n")
    pres, freq = get("presence_penalty"), get("frequency_penalty")
    _check_range("temperature", t, 0.0 <= t <= 100.0, "[0, 100]")
    _check_range("top_k", k, k >= 0, "[0, inf)")
    _check_range("top_p", p, 0.0 < p <= 1.0, "(0, 1]")
    _check_range("min_p", mp, 0.0 <= mp < 1.0, "[0, 1)")
    _check_range("repeat_penalty", rp, 0.0 <= rp <= 10.0, "[0, 10]")
    _check_range("repeat_last_n", last_n, 0 <= last_n <= MAX_PENALTY_LAST_N,
                 f"0..{MAX_PENALTY_LAST_N}")
    _check_range("presence_penalty", pres, -2.0 <= pres <= 2.0, "[-2, 2]")
    _check_range("frequency_penalty", freq, -2.0 <= freq <= 2.0, "[-2, 2]")
    _check_range("logprobs", logprobs, 0 <= logprobs <= MAX_LOGPROBS, f"0..{MAX_LOGPROBS}")
    return (SamplingParams(t, int(k), p, mp, rp, int(last_n), pres, freq, logprobs),
            (m.seed if m.HasField("seed") else None))


def speculative_from_pb(m: pb.SpeculativeParams, cfg: Config,
                        has_draft: bool, has_head: bool = False) -> SpecParams | None:
    """The request's speculative parameters; None: plain target-only decoding. n_max
    bounds every drafter: the draft model's, the head's and the lookup's proposals."""
    d = cfg.speculative
    n_max = m.n_max if m.HasField("n_max") else d.n_max
    n_min = m.n_min if m.HasField("n_min") else d.n_min
    p_min = m.p_min if m.HasField("p_min") else d.p_min
    lookup = m.lookup if m.HasField("lookup") else d.lookup
    _check_range("speculative.n_max", n_max, 0 <= n_max <= MAX_DRAFT, f"0..{MAX_DRAFT}")
    _check_range("speculative.n_min", n_min, 0 <= n_min <= n_max, f"0..n_max ({n_max})")
    _check_range("speculative.p_min", p_min, 0.0 <= p_min <= 1.0, "[0, 1]")
    has_model = has_draft or has_head
    enabled = m.enabled if m.HasField("enabled") else (d.enabled and (has_model or lookup))
    if enabled and not (has_model or lookup):
        raise InvalidArgument("speculative decoding needs a drafter: this server has no draft "
                              "model or head and the request turned the lookup drafter off")
    if not enabled or n_max == 0:
        return None
    return SpecParams(n_max if has_draft else 0, n_min if has_model else 0, p_min,
                      lookup_k=lookup_lengths(n_max, d.lookup_min) if lookup else (),
                      head_n_max=n_max if has_head else 0)


@dataclass(frozen=True)
class GenerateParams:
    prompt: tuple[int, ...]
    max_tokens: int
    id_slot: int  # -1: any
    cache_prompt: bool
    sampling: SamplingParams
    seed: int | None
    spec: SpecParams | None  # None: no speculative decoding
    stop: tuple[str, ...] = ()
    n_truncated: int = 0  # prompt tokens dropped to fit the context
    # a named conversation the prompt continues (inference_svc.sessions.host); None: none
    session: str | None = None
    # the prompt is the session's whole conversation (Chat), not what follows it
    conversation: bool = False
    # a Chat's conversation (the session's kept part included): what its session keeps
    # once the reply is added (chat_reply: as an assistant message)
    messages: tuple[chat.Message, ...] = ()
    chat_reply: bool = False
    # an `append` Chat: the session's conversation its messages continue (None: not one)
    history: tuple[chat.Message, ...] | None = None
    # the caller's id of this session turn: sent again, it replaces the turn ("": none)
    turn_id: str = ""

    @classmethod
    def from_pb(cls, req: pb.GenerateRequest, rc: RequestContext) -> GenerateParams:
        if req.prompt and req.prompt_tokens:
            raise InvalidArgument("set prompt or prompt_tokens, not both")
        cut_short = False  # the text was tokenized only up to past what the context holds
        if req.prompt_tokens:
            prompt: Sequence[int] = list(req.prompt_tokens)
            check_tokens(prompt, rc.n_vocab, "prompt_tokens")
        else:  # without truncate_prompt, a prompt of more than n_ctx tokens fails anyway
            prompt = rc.tokenizer.encode_ids(req.prompt,
                                             None if req.truncate_prompt else rc.n_ctx)
            cut_short = len(prompt) > rc.n_ctx and not req.truncate_prompt
        id_slot = check_slot_id(req.id_slot if req.HasField("id_slot") else -1, rc.n_slots,
                                allow_any=True)
        return cls._build(req, rc, prompt, id_slot,
                          req.cache_prompt if req.HasField("cache_prompt") else True,
                          req.truncate_prompt, cut_short)

    @classmethod
    def from_chat(cls, req: pb.ChatRequest, rc: RequestContext,
                  history: Sequence[chat.Message] = (),
                  session: str | None | bool = True) -> GenerateParams:
        """The Generate request of a Chat: the rendered conversation as its prompt.
        `history`: the conversation the session keeps, which an `append` Chat's
        messages continue. `session`: the request's session as `session_from_pb` already
        gave it (the caller needed it first), or True to read it here."""
        template = chat.require(rc.chat)
        if req.append and not req.HasField("session"):
            raise InvalidArgument("append continues the conversation a session keeps: "
                                  "set session")
        messages = [*history, *(chat.Message(m.role, m.content) for m in req.messages)]
        if not req.messages:
            raise InvalidArgument("messages is empty: a conversation needs at least one "
                                  "message" + (" to append" if req.append else ""))
        size = sum(len(m.role.encode("utf-8", "surrogatepass"))
                   + len(m.content.encode("utf-8", "surrogatepass")) for m in messages)
        agp = req.add_generation_prompt if req.HasField("add_generation_prompt") else True
        tok = rc.tokenizer
        prompt = (tok.run(lambda: template.tokens(messages, agp), size)
                  if isinstance(tok, BoundedTokenizer) else template.tokens(messages, agp))
        id_slot = check_slot_id(req.id_slot if req.HasField("id_slot") else -1, rc.n_slots,
                                allow_any=True)
        params = cls._build(req, rc, prompt, id_slot,
                            req.cache_prompt if req.HasField("cache_prompt") else True, False,
                            session=session)
        if params.session is None:
            return params
        return dataclasses.replace(params, messages=tuple(messages), chat_reply=agp,
                                   history=tuple(history) if req.append else None)

    @classmethod
    def _build(cls, req: pb.GenerateRequest | pb.ChatRequest, rc: RequestContext,
               prompt: Sequence[int], id_slot: int, cache_prompt: bool,
               truncate_prompt: bool, cut_short: bool = False,
               session: str | None | bool = True) -> GenerateParams:
        """The options Generate and Chat share (same names in both messages); cut_short:
        the prompt text was tokenized only up to past what the context holds; session:
        as `from_chat` takes it (True: read from the request here)."""
        cfg = rc.config
        if not prompt:
            raise InvalidArgument("the prompt is empty: at least one token is needed")
        if req.HasField("max_tokens"):
            max_tokens = req.max_tokens
            if max_tokens < 0:
                raise InvalidArgument(f"max_tokens {max_tokens} is negative")
        else:  # the default, capped to the room the prompt leaves
            room = rc.n_ctx - (1 if truncate_prompt else len(prompt))
            max_tokens = min(cfg.default_max_tokens, max(room, 1))
        n_truncated = 0
        if len(prompt) + max_tokens > rc.n_ctx:
            if not truncate_prompt or max_tokens >= rc.n_ctx:
                raise InvalidArgument(
                    f"the prompt of {f'more than {rc.n_ctx}' if cut_short else len(prompt)} "
                    f"tokens plus max_tokens {max_tokens} exceed the context of {rc.n_ctx} "
                    "tokens"
                    + ("" if truncate_prompt or isinstance(req, pb.ChatRequest)
                       else " (set truncate_prompt to drop the oldest "
                                                      "prompt tokens)"))
            n_truncated = len(prompt) + max_tokens - rc.n_ctx
            prompt = prompt[n_truncated:]
        stop = tuple(req.stop)
        if len(stop) > MAX_STOP_STRINGS:
            raise InvalidArgument(f"{len(stop)} stop strings, at most {MAX_STOP_STRINGS}")
        for s in stop:
            if not s or len(s.encode()) > MAX_STOP_BYTES:
                raise InvalidArgument(f"stop string {s!r} must be 1..{MAX_STOP_BYTES} bytes")
        if session is True:
            session = session_from_pb(req)
        assert session is None or isinstance(session, str)
        if req.turn_id:
            check_turn_id(req.turn_id)
            if session is None:
                raise InvalidArgument("turn_id names a turn of a session: set session")
        sampling, seed = sampling_from_pb(req.sampling, cfg, req.logprobs)
        spec = speculative_from_pb(req.speculative, cfg, rc.has_draft, rc.has_head)
        return cls(tuple(prompt), max_tokens, id_slot, cache_prompt, sampling, seed, spec,
                   stop, n_truncated, session, isinstance(req, pb.ChatRequest),
                   turn_id=req.turn_id)


def session_from_pb(req: pb.GenerateRequest | pb.ChatRequest) -> str | None:
    """The request's session name (checked: the one check of a session name on a
    request's path), None without one. A session chooses its
    slot and continues its own tokens: id_slot, truncate_prompt and cache_prompt false
    contradict it (a Chat has no truncate_prompt)."""
    if not req.HasField("session"):
        return None
    name = check_session_name(req.session)
    truncate = isinstance(req, pb.GenerateRequest) and req.truncate_prompt
    for bad, what in ((req.HasField("id_slot") and req.id_slot != -1, "id_slot"),
                      (truncate, "truncate_prompt"),
                      (req.HasField("cache_prompt") and not req.cache_prompt,
                       "cache_prompt false")):
        if bad:
            raise InvalidArgument(f"a request with a session cannot set {what}: the session "
                                  "picks its slot and continues its own tokens")
    return name


@dataclass
class Timings:
    id_slot: int = -1
    prompt_n: int = 0
    cache_n: int = 0
    prompt_ms: float = 0.0
    predicted_n: int = 0
    predicted_ms: float = 0.0
    draft_n: int = 0
    draft_n_accepted: int = 0
    draft_prompt_n: int = 0
    n_steps: int = 0
    n_truncated: int = 0
    queue_ms: float = 0.0
    session_tier: int = 0  # pb.SessionTier: where the session was found (0: no session)
    session_restore_ms: float = 0.0
    session_n_discarded: int = 0  # session tokens the prompt did not continue, dropped
    lookup_n: int = 0  # of draft_n / draft_n_accepted: the lookup drafter's
    lookup_n_accepted: int = 0
    head_n: int = 0  # of draft_n / draft_n_accepted: the feature head's
    head_n_accepted: int = 0

    def add_counters(self, c: Counters) -> None:
        self.draft_n, self.draft_n_accepted = c.n_drafted, c.n_accepted
        self.draft_prompt_n, self.n_steps = c.n_draft_prefill, c.n_steps

    @property
    def prompt_per_second(self) -> float:
        return 1e3 * self.prompt_n / self.prompt_ms if self.prompt_ms > 0 else 0.0

    @property
    def predicted_per_second(self) -> float:
        """Tokens of the decoding steps (all but the prompt's first token) per second."""
        n = self.predicted_n - 1
        return 1e3 * n / self.predicted_ms if n > 0 and self.predicted_ms > 0 else 0.0

    def to_pb(self) -> pb.Timings:
        return pb.Timings(
            prompt_n=self.prompt_n, cache_n=self.cache_n, prompt_ms=self.prompt_ms,
            predicted_n=self.predicted_n, predicted_ms=self.predicted_ms, draft_n=self.draft_n,
            draft_n_accepted=self.draft_n_accepted, draft_prompt_n=self.draft_prompt_n,
            id_slot=self.id_slot, prompt_per_second=self.prompt_per_second,
            predicted_per_second=self.predicted_per_second, n_truncated=self.n_truncated,
            n_steps=self.n_steps, queue_ms=self.queue_ms, session_tier=self.session_tier,
            session_restore_ms=self.session_restore_ms,
            session_n_discarded=self.session_n_discarded, lookup_n=self.lookup_n,
            lookup_n_accepted=self.lookup_n_accepted, head_n=self.head_n,
            head_n_accepted=self.head_n_accepted)


@dataclass(frozen=True)
class Chunk:
    """New output of a generation: token ids and the text they complete (None: the
    engine did not decode it, as a request without stop strings needs no text there;
    the reader decodes the tokens with a StreamDecoder)."""

    tokens: list[int]
    text: str | None
    logprobs: list[TokenLogprob] | None = None  # one per token when the request asked


def logprobs_to_pb(lps: list[TokenLogprob]) -> list[pb.TokenLogprob]:
    return [pb.TokenLogprob(token=lp.token, logprob=lp.logprob,
                            top=[pb.TopLogprob(token=t, logprob=v) for t, v in lp.top])
            for lp in lps]


@dataclass(frozen=True)
class Finished:
    reason: StopReason
    timings: Timings
    stop_string: str = ""
    seed: int | None = None
    last: Chunk | None = None  # the final output, sent with the end in one message


@dataclass(frozen=True)
class SlotInfo:
    id: int
    n_tokens: int
    busy: bool
    draft_n_tokens: int
    draft_offset: int
    counters: Counters = field(default_factory=Counters)
    last_used_unix_ms: int = 0

    def to_pb(self) -> pb.SlotInfo:
        c = self.counters
        return pb.SlotInfo(
            id=self.id, n_tokens=self.n_tokens, busy=self.busy,
            draft_n_tokens=self.draft_n_tokens, draft_offset=self.draft_offset,
            counters=pb.SlotCounters(n_steps=c.n_steps, n_drafted=c.n_drafted,
                                     n_accepted=c.n_accepted, n_draft_prefill=c.n_draft_prefill),
            last_used_unix_ms=self.last_used_unix_ms)


@dataclass(frozen=True)
class SaveResult:
    id_slot: int
    filename: str
    n_saved: int
    n_written: int
    draft_saved: bool
    save_ms: float
    target_sha256: str

    def to_pb(self) -> pb.SaveSlotResponse:
        return pb.SaveSlotResponse(**_fields(self))


@dataclass(frozen=True)
class RestoreResult:
    id_slot: int
    filename: str
    n_restored: int
    n_read: int
    draft_restored: bool
    draft_policy: DraftPolicy
    restore_ms: float
    draft_note: str = ""

    def to_pb(self) -> pb.RestoreSlotResponse:
        out = _fields(self)
        out["draft_policy_applied"] = int(out.pop("draft_policy"))
        return pb.RestoreSlotResponse(**out)


def _fields(obj: object) -> dict[str, object]:
    """A dataclass's fields by name (each result's fields are its response's)."""
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}  # type: ignore[arg-type]
