"""The service's configuration: one frozen dataclass built from command-line flags,
each of which can also come from an environment variable `WARMSLOT_<FLAG>`
(`--slot-save-path` <- `WARMSLOT_SLOT_SAVE_PATH`). A flag beats its variable."""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from inference_svc.core.header import DEFAULT_KV_TYPE
from inference_svc.core.header import KV_TYPES as _core_kv_types
from inference_svc.core.params import LOOKUP_MAX_MATCH, SamplingParams
from snapshot_svc.clientlib import settings, tls

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = ROOT / "models" / "target.gguf"
DEFAULT_DRAFT = ROOT / "models" / "draft.gguf"
DEFAULT_HEAD = ROOT / "models" / "smollm2-head.gguf"
ENV_PREFIX = "WARMSLOT_"
DRAFT_POLICIES = ("reprefill", "empty")
# the core's KV types, default first
KV_TYPES = (DEFAULT_KV_TYPE, *(t for t in _core_kv_types if t != DEFAULT_KV_TYPE))
HTTP_RISK = ("anyone who reaches the HTTP port (--http-host) could generate and read and "
             "continue every session")


def default_fallback_path() -> Path:
    """`$XDG_STATE_HOME/warmslot/fallback`, i.e. `~/.local/state/warmslot/fallback`."""
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "warmslot" / "fallback"


# request defaults for sampling (llama.cpp's)
DEFAULT_SAMPLING = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)


@dataclass(frozen=True)
class Speculative:
    """Request defaults for speculative decoding.

    On by default (a request's SpeculativeParams override) with up to three drafters:
    the lookup drafter (`lookup`), which continues the longest recent repeat (at least
    `lookup_min` tokens) of the slot's own text and needs no model; the feature head
    (--head) when one is loaded, which drafts from the target's own hidden states the
    steps where lookup finds no repeat; and the draft model when one is loaded, which
    drafts the steps neither of them does. `head_cost` is one head-drafted token's
    price in target decode steps (the head's small forward pass and its place in the
    verification).
    n_max caps the tokens drafted per step; with `adaptive` each slot drafts, per
    drafter, the length its measured acceptance pays for (inference_svc.engine.draft_length),
    down to none where the drafter is useless; `draft_cost` and `lookup_cost` are one
    drafted token's price in target decode steps (a model-drafted token costs its
    draft decode and its place in the verification, a looked-up one only the
    latter). The draft model stops proposing once its top probability falls below
    p_min, which wastes the fewest verification slots."""

    enabled: bool = True
    n_max: int = 8
    n_min: int = 0
    p_min: float = 0.75
    adaptive: bool = True
    draft_cost: float = 0.3
    lookup: bool = True
    lookup_min: int = 1
    lookup_cost: float = 0.25
    head_cost: float = 0.3


@dataclass(frozen=True)
class Config:
    model: Path = DEFAULT_MODEL
    draft: Path | None = DEFAULT_DRAFT  # None: no draft model, no speculative decoding
    # the feature head (docs/formats.md, warmslot-head); the default is used only when
    # it exists and was trained for the target, a head named otherwise must load
    head: Path | None = DEFAULT_HEAD
    slots: int = 4
    ctx: int | None = None  # None: the target model's training context
    threads: int = 2
    # the draft is small: one thread, so its pool's spinning workers and the target's
    # do not fight over the same cores
    draft_threads: int = 1
    batch: int = 512  # prompt tokens per decode call (one engine step)
    # prompt or draft catch-up tokens per engine step while other slots decode, so that
    # their next tokens wait for a short unit only
    batch_shared: int = 64
    # element type of the target's and the draft's KV caches; a slot file restores only
    # into the type it was saved from
    kv_type: str = DEFAULT_KV_TYPE
    host: str = "127.0.0.1"
    port: int = 50051
    slot_save_path: Path | None = None
    snapshot_addr: str | None = None  # HOST:PORT of a snapshot service (instead of a directory)
    snapshot_timeout: float = 30.0  # seconds per snapshot-service call
    snapshot_client_max_protocol: int = 2  # 1: behave as a protocol-1 client (no drafts)
    auto_save: bool = True  # save every slot on SIGTERM / SIGINT, restore them on start
    instance_id: str = field(default_factory=socket.gethostname)  # auto-<id>-slot<N>
    restore_timeout: float = 30.0  # seconds to wait for an unreachable store at start-up
    # seconds the stop's auto-save may spend on the snapshot service; what is not saved
    # by then goes to the local fallback (docs/operations.md, "Restart-resume and reliability")
    auto_save_timeout: float = 60.0
    # where the stop puts slots the snapshot service did not take (None: nowhere)
    fallback_save_path: Path | None = field(default_factory=default_fallback_path)
    draft_restore_policy: str = "reprefill"
    metrics_port: int = 0  # 0: no metrics endpoint
    metrics_host: str = "127.0.0.1"
    # the OpenAI-compatible HTTP door (inference_svc.api.http_door); None: none, 0: any free port
    http_port: int | None = None
    http_host: str = "127.0.0.1"
    sampling: SamplingParams = DEFAULT_SAMPLING
    speculative: Speculative = Speculative()
    default_max_tokens: int = 256
    max_queue_wait: float = 60.0  # seconds a request waits for a busy slot
    max_queue: int = 64  # requests waiting for a slot, beyond which RESOURCE_EXHAUSTED
    seed: int | None = None  # seeds the slots' RNGs at start-up (None: random)
    shutdown_grace: float = 10.0  # seconds running requests get on SIGTERM / SIGINT
    workers: int = 0  # gRPC handler threads; 0: slots + max_queue + 8
    # at most one Generate response per interval x generations running (0: one per step)
    stream_interval_ms: float = 10.0
    log_level: str = "info"
    log_format: str = "json"  # json | text
    # security: API keys (clientlib.auth), TLS of the service and of its snapshot client
    api_keys: Path | None = None
    insecure: bool = False  # serve a non-loopback address with neither keys nor TLS
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None  # set: clients need a certificate it signed (mTLS)
    snapshot_tls_ca: Path | None = None  # set: TLS to the snapshot service
    snapshot_tls_cert: Path | None = None
    snapshot_tls_key: Path | None = None
    snapshot_key_file: Path | None = None  # the snapshot service's API key of this replica
    # Generate streams at once per API key (with --api-keys; below the handler threads)
    max_streams_per_key: int = 16
    max_unary_per_key: int = 16  # unary calls at once per API key (with --api-keys)
    max_prompt_bytes: int = 1 << 20  # longest request text, refused before tokenizing
    tokenize_threads: int = 1  # threads tokenizing request text (not the handler threads)
    chat_template: Path | None = None  # Jinja chat template file; None: the model's own
    # bytes of idle sessions' state kept in host memory before they go to the store
    session_ram_mb: int = 1024
    # each session turn's end state written to the store in the background (with a store)
    session_write_through: bool = True
    # a session turn's last message waits until its end state is stored (write-through)
    session_ack_stored: bool = False

    @property
    def grpc_workers(self) -> int:
        return self.workers or self.slots + self.max_queue + 8

    @property
    def draft_to_load(self) -> Path | None:
        """The draft model file to load: None without a draft, or when the default draft
        is missing (speculative decoding is then off)."""
        d = self.draft
        if d is None or (not d.exists() and d.resolve() == DEFAULT_DRAFT):
            return None
        return d

    @property
    def head_to_load(self) -> Path | None:
        """The head file to load: None without a head or when the default is missing."""
        h = self.head
        if h is None or (not h.exists() and h.resolve() == DEFAULT_HEAD):
            return None
        return h

    @property
    def head_is_default(self) -> bool:
        """The head is the default one (skipped, not refused, when it does not fit)."""
        return self.head is not None and self.head.resolve() == DEFAULT_HEAD

    def check_models(self) -> None:
        """The model files' cheap checks (they exist, a supported architecture in the
        header): milliseconds, so a model that cannot load is refused before anything
        starts. Raises ModelLoadError."""
        from inference_svc.core import check_model_file  # the core loads numpy: on demand

        check_model_file(self.model)
        if self.draft_to_load is not None:
            check_model_file(self.draft_to_load)
        if self.head_to_load is not None and not self.head_to_load.is_file():
            from inference_svc.core import ModelLoadError

            raise ModelLoadError(f"head file not found: {self.head_to_load}")

    def __post_init__(self) -> None:
        problems = []
        if self.slots < 1:
            problems.append(f"--slots {self.slots} must be >= 1")
        if self.ctx is not None and self.ctx < 2:
            problems.append(f"--ctx {self.ctx} must be >= 2")
        if self.threads < 1:
            problems.append(f"--threads {self.threads} must be >= 1")
        if self.draft_threads < 1:
            problems.append(f"--draft-threads {self.draft_threads} must be >= 1")
        if self.batch < 1:
            problems.append(f"--batch {self.batch} must be >= 1")
        if self.batch_shared < 1:
            problems.append(f"--batch-shared {self.batch_shared} must be >= 1")
        if not 0 < self.speculative.lookup_cost <= 10:
            problems.append(f"--spec-lookup-cost {self.speculative.lookup_cost} must be in "
                            "(0, 10]")
        if not 1 <= self.speculative.lookup_min <= LOOKUP_MAX_MATCH:
            problems.append(f"--spec-lookup-min {self.speculative.lookup_min} must be in "
                            f"1..{LOOKUP_MAX_MATCH}")
        if not 0 < self.speculative.head_cost <= 10:
            problems.append(f"--spec-head-cost {self.speculative.head_cost} must be in "
                            "(0, 10]")
        if not 0 < self.speculative.draft_cost <= 10:
            problems.append(f"--spec-draft-cost {self.speculative.draft_cost} must be in "
                            "(0, 10]")
        if self.kv_type not in KV_TYPES:
            problems.append(f"--kv-type {self.kv_type!r} is not one of {', '.join(KV_TYPES)}")
        if self.draft_restore_policy not in DRAFT_POLICIES:
            problems.append(f"--draft-restore-policy {self.draft_restore_policy!r} is not one "
                            f"of {', '.join(DRAFT_POLICIES)}")
        if not 0 <= self.port < 65536 or not 0 <= self.metrics_port < 65536 or not (
                self.http_port is None or 0 <= self.http_port < 65536):
            problems.append("ports must be in 0..65535")
        if self.workers < 0:
            problems.append("--workers must be >= 0")
        if self.stream_interval_ms < 0:
            problems.append("--stream-interval-ms must be >= 0")
        if self.default_max_tokens < 0:
            problems.append("--default-max-tokens must be >= 0")
        if self.slot_save_path is not None and self.snapshot_addr is not None:
            problems.append("set one of --slot-save-path and --snapshot-addr, not both")
        if self.snapshot_addr is not None and not (
                self.snapshot_addr.split(",")[0]
                and all(_is_host_port(a.strip()) for a in self.snapshot_addr.split(","))):
            problems.append(f"--snapshot-addr {self.snapshot_addr!r} is not HOST:PORT or a "
                            "comma-separated list of them")
        if self.snapshot_client_max_protocol not in (1, 2):
            problems.append("--snapshot-client-max-protocol must be 1 or 2")
        if self.snapshot_timeout <= 0 or self.restore_timeout < 0:
            problems.append("--snapshot-timeout must be > 0 and --restore-timeout >= 0")
        if self.auto_save_timeout < 0:
            problems.append("--auto-save-timeout must be >= 0")
        if not self.instance_id or not all(c.isalnum() or c in "-_." for c in self.instance_id):
            problems.append(f"--instance-id {self.instance_id!r} must be letters, digits, "
                            f"'-', '_' or '.'")
        if self.log_format not in ("json", "text"):
            problems.append(f"--log-format {self.log_format!r} is not json or text")
        if self.api_keys is not None and not (
                self.max_streams_per_key > 0 and self.max_unary_per_key > 0
                and self.max_streams_per_key + self.max_unary_per_key < self.grpc_workers):
            problems.append("--max-streams-per-key and --max-unary-per-key must be >= 1 and "
                            f"together below the handler threads ({self.grpc_workers})")
        if self.session_ram_mb < 0:
            problems.append("--session-ram-mb must be >= 0")
        if self.max_prompt_bytes < 1 or self.tokenize_threads < 1:
            problems.append("--max-prompt-bytes and --tokenize-threads must be >= 1")
        if (self.tls_cert is None) != (self.tls_key is None):
            problems.append("--tls-cert and --tls-key go together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            problems.append("--tls-client-ca needs --tls-cert and --tls-key")
        if (self.snapshot_tls_cert is None) != (self.snapshot_tls_key is None):
            problems.append("--snapshot-tls-cert and --snapshot-tls-key go together")
        if self.snapshot_tls_cert is not None and self.snapshot_tls_ca is None:
            problems.append("--snapshot-tls-cert needs --snapshot-tls-ca")
        if problems:
            raise ValueError("; ".join(problems))
        tls.check_exposure(self.host, self.api_keys, self.tls_cert is not None, self.insecure)
        if self.metrics_port:
            tls.check_exposure(self.metrics_host, self.api_keys, self.tls_cert is not None,
                               self.insecure, risk=tls.METRICS_RISK)
        if self.http_port is not None:
            tls.check_exposure(self.http_host, self.api_keys, self.tls_cert is not None,
                               self.insecure, risk=HTTP_RISK)


def _is_host_port(addr: str) -> bool:
    host, sep, port = addr.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m inference_svc",
        description="Warmslot inference service (gRPC). Every flag can also be set with "
                    "the environment variable WARMSLOT_<FLAG>, e.g. WARMSLOT_SLOT_SAVE_PATH.")
    d = Config()
    f = settings.field_flags(p, d)
    f("--model", "target model GGUF file")
    f("--draft", "draft model GGUF file for speculative decoding ('none': no draft)")
    f("--head",
      "feature draft head GGUF file (warmslot-head) for speculative decoding: drafts from the "
      "target's own hidden states; a file that is missing, corrupt or trained for another "
      "target stops the start ('none': no head; default: models/smollm2-head.gguf when it "
      "exists and matches the target, else none)")
    f("--slots", "number of slots (parallel sessions)")
    f("--ctx", "context size per slot (default: the target model's)")
    f("--threads", "decoding threads (target)")
    f("--draft-threads", "decoding threads (draft)")
    f("--batch", "prompt tokens per decode call")
    f("--batch-shared",
      "at most this many prompt or draft catch-up tokens per decode call while other slots decode "
      "(each such call is sized to about half their decode step, and to --batch at most)")
    f("--kv-type",
      "KV cache element type of the target and the draft: f16 (half the memory and slot-file "
      "size of f32), q8_0 (blocks of 32 8-bit values: 0.53x f16's memory and slot files) or "
      "f32; a slot file restores only into the type it was saved with", choices=KV_TYPES)
    f("--host", "address to listen on")
    f("--port", "gRPC port (0: any free port)")
    f("--slot-save-path", "directory of the local slot store (SaveSlot / RestoreSlot)")
    f("--snapshot-addr",
      "HOST:PORT of a snapshot service that holds the slot files (instead of --slot-save-path); a "
      "comma-separated list of replicas sharing one store fails over between them")
    f("--snapshot-timeout", "seconds each snapshot-service call may take (plus time for its size)")
    f("--snapshot-client-max-protocol",
      "highest snapshot protocol to speak (1: target files only, as an old client)", choices=(1, 2))
    f("--auto-save",
      "with a store configured, save every non-empty slot as auto-<instance>-slot<N> on SIGTERM / "
      "SIGINT and restore them at start-up (--no-auto-save: neither)")
    f("--instance-id", "names this replica's auto-saved slots (default: the host name)")
    f("--restore-timeout",
      "seconds the start-up restore may wait for the snapshot service (every call and retry ends "
      "by then) before the remaining slots start cold; 0: do not wait")
    f("--auto-save-timeout",
      "seconds the stop's auto-save may spend on the snapshot service (every call ends by then); "
      "slots not saved there by then go to --fallback-save-path")
    f("--fallback-save-path",
      "with --snapshot-addr: directory where the stop writes the slots the snapshot service did "
      "not take (down, hung, out of time); they are uploaded, then removed here, at the next "
      "start or once the service answers again, and restored from here while it does not ('none': "
      "no fallback; default $XDG_STATE_HOME/warmslot/fallback)")
    f("--draft-restore-policy",
      "draft of a restored slot without a usable .drft: re-prefill it from the tokens or start it "
      "empty", choices=DRAFT_POLICIES)
    f("--metrics-port", "Prometheus metrics HTTP port (0: none)")
    f("--metrics-host",
      "address of the metrics endpoint; with TLS it speaks HTTPS (client certificates as "
      "--tls-client-ca), with --api-keys it needs 'Authorization: Bearer <admin key>'; a "
      "non-loopback address needs one of them or --insecure")
    f("--http-port",
      "port of the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, "
      "/v1/models, /health) on the same engine, keys and TLS as gRPC (0: any free port; "
      "default: none)")
    f("--http-host",
      "address of the HTTP API; a non-loopback address needs --api-keys or TLS, or --insecure")
    f = settings.field_flags(p, d, group="sampling")
    f("--temperature", "default sampling temperature (0: greedy)")
    f("--top-k", "default top-k (0: off)")
    f("--top-p", "default top-p (1: off)")
    f("--min-p", "default min-p (0: off)")
    f("--repeat-penalty", "default repeat penalty over the last --repeat-last-n tokens (1: off)")
    f("--repeat-last-n", "default number of last tokens the penalties look at (0: no penalties)")
    f("--presence-penalty", "default presence penalty (0: off)")
    f("--frequency-penalty", "default frequency penalty (0: off)")
    f = settings.field_flags(p, d, group="speculative", prefix="--spec-")
    f("--speculative",
      "speculative decoding for requests that do not say (with the lookup drafter, the draft "
      "model, or both)",
      field="enabled")
    f("--spec-n-max", "default tokens drafted per step (0: no speculative decoding by default)")
    f("--spec-n-min", "default minimum draft of the draft model")
    f("--spec-p-min", "default draft-model confidence below which drafting stops")
    f("--spec-lookup",
      "the lookup drafter by default: propose the continuation of the longest recent repeat of "
      "the slot's own text (prompt, output, earlier turns); no model, any target")
    f("--spec-lookup-min", "shortest repeat, in tokens, the lookup drafter continues")
    f("--spec-lookup-cost",
      "the price of one looked-up token in target decode steps (its place in the verification "
      "pass), for --spec-adaptive")
    f("--spec-adaptive",
      "each slot drafts the length (0..n_max) its measured acceptance pays for, none where the "
      "draft is useless (--no-spec-adaptive: always n_max)")
    f("--spec-head-cost",
      "the price of one head-drafted token in target decode steps (the head's forward pass plus "
      "its place in the verification pass), for --spec-adaptive")
    f("--spec-draft-cost",
      "the price of one drafted token in target decode steps (draft decode plus its place in the "
      "verification pass), for --spec-adaptive")
    f = settings.field_flags(p, d)
    f("--default-max-tokens", "max_tokens of a request that sets none")
    f("--max-queue-wait", "seconds a request waits for a busy slot before RESOURCE_EXHAUSTED")
    f("--max-queue", "requests waiting for a slot at most")
    f("--seed", "seed of the slots' RNGs at start-up (default: random)")
    f("--shutdown-grace", "seconds running requests get to finish on SIGTERM / SIGINT")
    f("--workers",
      "gRPC handler threads (0: slots + max-queue + 8, one per stream that can be running or "
      "waiting, plus room for the other calls)")
    f("--stream-interval-ms",
      "after the first tokens, a Generate stream sends at most one response per interval x "
      "generations running; the tokens of the steps in between are merged (0: one response per "
      "step)")
    f("--log-level", choices=("debug", "info", "warning", "error"))
    f("--log-format", choices=("json", "text"))
    f("--max-streams-per-key",
      "with --api-keys: Generate streams one key may have running or queued at once "
      "(RESOURCE_EXHAUSTED beyond), so that other keys always find a handler thread")
    f("--max-unary-per-key",
      "with --api-keys: unary calls (all but Generate) one key may have running at once "
      "(RESOURCE_EXHAUSTED beyond); with --max-streams-per-key below the handler threads, so that "
      "other keys and health checks always find one")
    f("--max-prompt-bytes",
      "longest prompt or Tokenize text in UTF-8 bytes, refused before tokenizing")
    f("--tokenize-threads", "threads that tokenize request text (--max-queue more texts may wait)")
    f("--session-ram-mb",
      "MiB of idle sessions' state (target + draft) kept in host memory; beyond it the least "
      "recently used go to the store (without a store: are dropped); 0: straight to the store")
    f("--session-write-through",
      "with a store, write each session turn's end state to it in the background right after "
      "the turn, so other replicas continue from it and a killed replica loses only the turns "
      "still being written (--no-session-write-through: only on eviction and at stop)")
    f("--session-ack-stored",
      "with write-through, a session turn's last message (done, with its timings) waits until "
      "the turn's state is stored (or its write failed): a replica killed after answering "
      "loses no answered turn, for the write's time on every turn's end")
    f("--api-keys",
      "file of API keys, one '<key> user|admin' per line (reloaded on SIGHUP); calls other than "
      "health then need 'authorization: Bearer <key>'")
    f("--insecure",
      "allow a non-loopback --host with neither --api-keys nor TLS", action="store_true")
    f("--tls-cert", "TLS certificate (PEM)")
    f("--tls-key", "TLS private key (PEM)")
    f("--tls-client-ca", "CA (PEM) whose client certificates are required (mutual TLS)")
    f("--snapshot-tls-ca",
      "CA (PEM) of the snapshot service's certificate: TLS to the snapshot service")
    f("--snapshot-tls-cert", "client certificate (PEM) for a snapshot service that requires one")
    f("--snapshot-tls-key", "key (PEM) of --snapshot-tls-cert")
    f("--snapshot-key-file", "file holding this replica's API key of the snapshot service")
    f("--chat-template",
      "Jinja chat template file for Chat, instead of the model's own (tokenizer.chat_template); "
      "Chat needs one or the other")
    settings.document_env(p, ENV_PREFIX)
    return p


def from_args(argv: Sequence[str] | None = None,
              env: Mapping[str, str] | None = None) -> Config:
    """The configuration from flags, then environment variables, then defaults."""
    p = parser()
    env = os.environ if env is None else env
    ns = settings.parse(p, argv if argv is not None else [], env, ENV_PREFIX)
    try:
        return Config(**settings.field_values(ns, Config()))
    except ValueError as exc:
        p.error(str(exc))
        raise  # unreachable: p.error exits
