"""The gRPC server: thin handlers over the engine and the slot manager, the shared
status interceptor (exceptions to status codes, API keys), health, reflection,
metrics, and a graceful stop."""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from inference_svc import __version__, chat, log
from inference_svc.api import access
from inference_svc.config import Config
from inference_svc.core import Model, ModelLoadError, StreamDecoder, Tokenizer
from inference_svc.core.head import Head
from inference_svc.core.params import TokenLogprob
from inference_svc.engine.executor import Engine, GenJob
from inference_svc.engine.slot_owner import SlotOwner
from inference_svc.errors import Unavailable, status_of
from inference_svc.metrics import Metrics
from inference_svc.pb import inference_pb2 as pb
from inference_svc.pb import inference_pb2_grpc as pb_grpc
from inference_svc.prompts import BoundedTokenizer
from inference_svc.sessions.host import SessionHost, delete_key, visible_owner
from inference_svc.sessions.names import TURN_IDS_HEADER
from inference_svc.storage import autosave, slotfile
from inference_svc.storage.fallback import Fallback
from inference_svc.storage.slots import SlotManager
from inference_svc.storage.snapshot_failover import FailoverStore, parse_addrs
from inference_svc.storage.snapshot_store import SnapshotStore
from inference_svc.storage.store import LocalStore, SlotStore
from inference_svc.types import (
    Chunk,
    Finished,
    GenerateParams,
    RequestContext,
    check_tokens,
    logprobs_to_pb,
    session_from_pb,
)
from snapshot_svc.clientlib import auth, tls
from snapshot_svc.clientlib.interceptor import StatusInterceptor
from snapshot_svc.clientlib.streams import StreamLimit

if TYPE_CHECKING:
    from inference_svc.api.http_door import HttpDoor

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inference"].full_name
SNAPSHOT_PROTOCOL = (1, 2)  # snapshot protocol versions this service speaks
FALLBACK_RETRY_S = 5.0  # pause between uploads of the fallback while the store is down
FALLBACK_CLOSE_S = 1.0  # the stop waits this long for an upload of the fallback to end


def _time_remaining(context: grpc.ServicerContext) -> float | None:
    t = context.time_remaining()
    return None if t is None or t > 1e7 else max(float(t), 0.0)


@dataclass
class Runtime:
    """What the handlers need once the models are loaded."""

    engine: Engine
    slots: SlotManager
    sessions: SessionHost
    rc: RequestContext
    store: SlotStore | None


@dataclass
class Generation:
    """A queued generation: its job (job.cancel() stops it) and its responses."""

    job: GenJob
    responses: Iterator[pb.GenerateResponse]


class InferenceServicer(pb_grpc.InferenceServicer):
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.runtime: Runtime | None = None  # None while the models load
        self.streams = StreamLimit(cfg.max_streams_per_key)

    def _rt(self) -> Runtime:
        rt = self.runtime
        if rt is None:
            raise Unavailable("the server is loading its models")
        return rt

    def Generate(self, request: pb.GenerateRequest,
                 context: grpc.ServicerContext) -> Iterator[pb.GenerateResponse]:
        yield from self._stream(lambda rc: GenerateParams.from_pb(request, rc), context)

    def Chat(self, request: pb.ChatRequest,
             context: grpc.ServicerContext) -> Iterator[pb.GenerateResponse]:
        read: list[SessionHost] = []  # the host that read the session for this turn

        def params_of(rc: RequestContext) -> GenerateParams:
            history: tuple[chat.Message, ...] = ()
            session = session_from_pb(request)  # checked before the store is asked
            if request.append and session is not None:
                left = _time_remaining(context)
                host = self._rt().sessions
                history = host.conversation(
                    session, None if left is None else time.monotonic() + left,
                    request.turn_id)
                read.append(host)
            return GenerateParams.from_chat(request, rc, history, session)

        try:
            yield from self._stream(params_of, context)
        finally:
            for host in read:
                host.forget_read(request.session)

    def _stream(self, params_of: Callable[[RequestContext], GenerateParams],
                context: grpc.ServicerContext) -> Iterator[pb.GenerateResponse]:
        # before anything runs: a client whose stream is cut later knows that this server
        # keeps turn ids, so sending a session turn again replaces it (client.resendable)
        context.send_initial_metadata(((TURN_IDS_HEADER, "1"),))
        with self.generation(params_of, auth.CURRENT.get(), _time_remaining(context)) as gen:
            context.add_callback(gen.job.cancel)
            yield from gen.responses

    @contextlib.contextmanager
    def generation(self, params_of: Callable[[RequestContext], GenerateParams],
                   caller: auth.Principal | None,
                   time_remaining: float | None) -> Iterator[Generation]:
        """One generation as both doors (gRPC, HTTP) run it: with API keys one of the
        caller's streams (without keys the queue's limits apply, --max-queue), the
        request checked and completed with the defaults (params_of), queued on the
        engine; leaving the block cancels it if it still runs. auth.CURRENT must hold
        the caller (a session belongs to it)."""
        with self.streams.hold(caller) if caller is not None else contextlib.nullcontext():
            rt = self._rt()
            params = params_of(rt.rc)
            job = rt.engine.generate(params, time_remaining)
            try:
                yield Generation(job, _responses(job, self.cfg.stream_interval_ms / 1e3,
                                                 rt.engine.n_running, rt.rc.tokenizer))
            finally:
                job.cancel()

    def Tokenize(self, request: pb.TokenizeRequest,
                 context: grpc.ServicerContext) -> pb.TokenizeResponse:
        return pb.TokenizeResponse(tokens=self._rt().rc.tokenizer.encode_ids(request.text))

    def Detokenize(self, request: pb.DetokenizeRequest,
                   context: grpc.ServicerContext) -> pb.DetokenizeResponse:
        rc = self._rt().rc
        tokens = list(request.tokens)
        check_tokens(tokens, rc.n_vocab, "tokens")
        return pb.DetokenizeResponse(text=rc.tokenizer.decode(tokens))

    def GetInfo(self, request: pb.GetInfoRequest,
                context: grpc.ServicerContext) -> pb.GetInfoResponse:
        rt = self._rt()
        eng, cfg = rt.engine.owner, self.cfg  # the models and slots served
        s, sp = cfg.sampling, cfg.speculative
        tok = eng.tokenizer
        resp = pb.GetInfoResponse(
            model=_model_info(eng.target, cfg.model), n_slots=eng.n_slots, n_ctx=eng.n_ctx,
            n_vocab=eng.target.n_vocab,
            # version 3 for a model whose sliding-window layers outgrow their rings, 4 for
            # a q8_0 KV cache
            slot_file_version=slotfile.target_version(slotfile.DTYPE_BY_NAME[cfg.kv_type],
                                                      eng.target.hparams.n_swa > 0),
            draft_file_version=slotfile.draft_version(slotfile.DTYPE_BY_NAME[cfg.kv_type],
                                                      eng.head is not None),
            snapshot_protocol_min=SNAPSHOT_PROTOCOL[0],
            snapshot_protocol_max=min(SNAPSHOT_PROTOCOL[1], cfg.snapshot_client_max_protocol),
            store_configured=rt.store is not None,
            store=rt.store.describe() if rt.store is not None else "",
            draft_restore_policy=cfg.draft_restore_policy,
            default_sampling=pb.SamplingParams(
                temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p,
                repeat_penalty=s.repeat_penalty, repeat_last_n=s.repeat_last_n,
                presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty),
            default_speculative=pb.SpeculativeParams(
                enabled=sp.enabled and (eng.has_draft or eng.head is not None or sp.lookup),
                n_max=sp.n_max,
                n_min=sp.n_min, p_min=sp.p_min, lookup=sp.lookup),
            default_max_tokens=cfg.default_max_tokens, server_version=__version__,
            eos_id=-1 if tok.eos_id is None else tok.eos_id,
            bos_id=-1 if tok.bos_id is None else tok.bos_id)
        if eng.draft is not None and cfg.draft is not None:
            resp.draft.CopyFrom(_model_info(eng.draft, cfg.draft))
        return resp

    def ListSlots(self, request: pb.ListSlotsRequest,
                  context: grpc.ServicerContext) -> pb.ListSlotsResponse:
        return pb.ListSlotsResponse(slots=[s.to_pb() for s in self._rt().engine.list_slots()])

    def SaveSlot(self, request: pb.SaveSlotRequest,
                 context: grpc.ServicerContext) -> pb.SaveSlotResponse:
        return self._rt().slots.save(request.id_slot, request.filename,
                                     _time_remaining(context)).to_pb()

    def RestoreSlot(self, request: pb.RestoreSlotRequest,
                    context: grpc.ServicerContext) -> pb.RestoreSlotResponse:
        return self._rt().slots.restore(request.id_slot, request.filename,
                                        _time_remaining(context)).to_pb()

    def EraseSlot(self, request: pb.EraseSlotRequest,
                  context: grpc.ServicerContext) -> pb.EraseSlotResponse:
        n = self._rt().slots.erase(request.id_slot, _time_remaining(context))
        return pb.EraseSlotResponse(id_slot=request.id_slot, n_erased=n)

    def ListSessions(self, request: pb.ListSessionsRequest,
                     context: grpc.ServicerContext) -> pb.ListSessionsResponse:
        host = self._rt().sessions
        rows = host.list(visible_owner(auth.CURRENT.get()))
        return pb.ListSessionsResponse(sessions=[r.to_pb() for r in rows])

    def DeleteSession(self, request: pb.DeleteSessionRequest,
                      context: grpc.ServicerContext) -> pb.DeleteSessionResponse:
        host = self._rt().sessions
        key = delete_key(request.name, request.owner, auth.CURRENT.get())
        left = _time_remaining(context)
        n, tiers = host.delete(key, None if left is None else time.monotonic() + left)
        return pb.DeleteSessionResponse(name=key.name, n_tokens=n, removed_from=tiers)


def snapshot_security(cfg: Config) -> dict[str, Any]:
    """The snapshot client's TLS credentials and API key from the configuration."""
    creds = (tls.channel_credentials(cfg.snapshot_tls_ca, cfg.snapshot_tls_cert,
                                     cfg.snapshot_tls_key)
             if cfg.snapshot_tls_ca is not None else None)
    key = (auth.read_key_file(cfg.snapshot_key_file) if cfg.snapshot_key_file is not None
           else None)
    return {"credentials": creds, "api_key": key}


def _model_info(model: Model, path: Any) -> pb.ModelInfo:
    hp = model.hparams
    return pb.ModelInfo(name=model.name, fingerprint=model.fingerprint, path=str(path),
                        n_vocab=hp.n_vocab, n_embd=hp.n_embd, n_layer=hp.n_layer,
                        n_head=hp.n_head, n_head_kv=hp.n_head_kv, n_ctx_train=hp.n_ctx_train)


def _responses(job: GenJob, interval: float, n_streams: Callable[[], int],
               tokenizer: Tokenizer) -> Iterator[pb.GenerateResponse]:
    """Responses from the engine's output: the first new tokens at once, then at most
    one message per `interval` x (generations running) seconds carrying everything
    generated meanwhile, and the last one as soon as the generation ends. (Sending a
    message costs more CPU than a decoding step of a small model; this keeps the
    service's messages per second about constant whatever the number of streams.)"""
    last_sent = 0.0
    stream = StreamDecoder(tokenizer)  # for chunks the engine did not decode
    while True:
        items = [job.out.get()]
        if interval > 0 and last_sent:
            wait = last_sent + interval * max(1, n_streams()) - time.monotonic()
            job.ended.wait(max(0.0, wait))
        while True:
            try:
                items.append(job.out.get_nowait())
            except queue.Empty:
                break
        tokens: list[int] = []
        text: list[str] = []
        lps: list[TokenLogprob] = []
        final: Finished | None = None
        error: BaseException | None = None
        for it in items:
            chunk = it.last if isinstance(it, Finished) else it
            if isinstance(chunk, Chunk):
                tokens += chunk.tokens
                lps += chunk.logprobs or []
                if chunk.text is not None:
                    text.append(chunk.text)
                else:
                    text += [stream.push(t) for t in chunk.tokens]
            if isinstance(it, Finished):
                final = it
                text.append(stream.flush())
            elif isinstance(it, BaseException):
                error = it
        if tokens or any(text) or final is not None:
            resp = pb.GenerateResponse(text="".join(text), tokens=tokens, id_slot=job.slot,
                                       logprobs=logprobs_to_pb(lps))
            if final is not None:
                resp.done = True
                resp.stop_reason = int(final.reason)
                resp.timings.CopyFrom(final.timings.to_pb())
                resp.stop_string = final.stop_string
                if final.seed is not None:
                    resp.seed = final.seed
            yield resp
            last_sent = time.monotonic()
        if error is not None:
            raise error
        if final is not None:
            return


class Server:
    """One service instance: start() listens (health NOT_SERVING), load() brings up the
    models and the engine (SERVING), stop() shuts down gracefully."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.log = log.get()
        self.metrics = Metrics()
        self.servicer = InferenceServicer(cfg)
        self.health = health.HealthServicer()
        self.port = 0
        self.metrics_port = 0
        self._metrics_stop: Callable[[], None] | None = None
        self.http_port = 0
        self._http: HttpDoor | None = None  # the OpenAI-compatible door, with --http-port
        self._grpc: grpc.Server | None = None
        self._models: list[Model | Head] = []
        self._stopped = threading.Event()
        self._store: SlotStore | None = None
        self._fallback: Fallback | None = None
        self._slots: SlotManager | None = None
        self._engine: Engine | None = None
        self._sessions: SessionHost | None = None
        self._keys = access.key_ring(cfg.api_keys) if cfg.api_keys is not None else None
        self._gate = (auth.gate(self._keys, access.allowed) if self._keys is not None
                      else None)
        self.unary = StreamLimit(cfg.max_unary_per_key, "unary calls running",
                                 "--max-unary-per-key")

    def reload_keys(self) -> None:
        """Rereads the API key file (SIGHUP); a wrong file keeps the old keys."""
        if self._keys is not None:
            self._keys.reload_logged(self.log)

    def _set_health(self, status: int) -> None:
        for name in ("", SERVICE_NAME):
            self.health.set(name, status)

    def start(self) -> int:
        """Listens (health NOT_SERVING until load() is done). The model files are
        checked first (Config.check_models), so a model that cannot load never opens
        the port."""
        cfg = self.cfg
        cfg.check_models()
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=cfg.grpc_workers,
                                                        thread_name_prefix="grpc"),
                             interceptors=[StatusInterceptor(
                                 lambda m, code: self.metrics.requests.labels(m, code).inc(),
                                 self.log, self._gate, status_of, self.unary)],
                             options=[("grpc.so_reuseport", 0)])
        pb_grpc.add_InferenceServicer_to_server(self.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME), server)
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        addr = f"{cfg.host}:{cfg.port}"
        if cfg.tls_cert is not None and cfg.tls_key is not None:
            self.port = server.add_secure_port(addr, tls.server_credentials(
                cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca))
        else:
            self.port = server.add_insecure_port(addr)
        if self.port == 0:
            raise OSError(f"cannot listen on {cfg.host}:{cfg.port}")
        server.start()
        self._grpc = server
        if cfg.metrics_port:
            self.metrics_port, self._metrics_stop = self.metrics.serve(
                cfg.metrics_host, cfg.metrics_port, cert=cfg.tls_cert, key=cfg.tls_key,
                client_ca=cfg.tls_client_ca, keys=self._keys)
        if cfg.http_port is not None:
            from inference_svc.api.http_door import HttpDoor  # its stack loads only when used

            self._http = HttpDoor(cfg, self.servicer, self._keys, self.log,
                                  lambda m, code: self.metrics.requests.labels(m, code).inc(),
                                  self.unary)
            self.http_port = self._http.start()
        self.log.info("listening", extra=log.fields(
            host=cfg.host, port=self.port, metrics_port=self.metrics_port or None,
            http_port=self.http_port or None,
            tls=cfg.tls_cert is not None, mtls=cfg.tls_client_ca is not None,
            api_keys=len(self._keys) if self._keys is not None else None))
        return self.port

    def _load_head(self, target: Model) -> Head | None:
        """The feature head (--head) for the target: None without one. The default head
        is skipped when it does not fit the target; a head named by --head that is
        missing, corrupt or for another target stops the start (ModelLoadError)."""
        path = self.cfg.head_to_load
        if path is None:
            return None
        try:
            head = Head(path, target)
        except ModelLoadError as exc:
            if not self.cfg.head_is_default:
                raise
            self.log.info("the default head does not fit this target: no head",
                          extra=log.fields(head=str(path), reason=str(exc)))
            return None
        self._models.append(head)
        self.log.info("feature head loaded", extra=log.fields(
            head=str(path), readout=head.n_out, target=target.fingerprint))
        return head

    def load(self) -> None:
        cfg = self.cfg
        t0 = time.perf_counter()
        target = Model.load(cfg.model)
        self._models.append(target)
        draft = None
        draft_path = cfg.draft_to_load
        if draft_path is not None:
            draft = Model.load(draft_path)
            self._models.append(draft)
        elif cfg.draft is not None:
            self.log.warning("no draft model: speculative decoding is off",
                             extra=log.fields(draft=str(cfg.draft)))
        head = self._load_head(target)
        engine = Engine(cfg, SlotOwner(cfg, target, draft, head), self.metrics)
        self._engine = engine  # closed by stop() even if start-up is cut short
        store = self._open_store()
        tokenizer = BoundedTokenizer(engine.tokenizer, cfg.max_prompt_bytes,
                                     cfg.tokenize_threads, cfg.max_queue)
        rc = RequestContext(cfg, tokenizer, target.n_vocab, engine.n_ctx,
                            engine.n_slots, engine.owner.has_draft,
                            chat.load_template(cfg.chat_template, engine.tokenizer),
                            has_head=head is not None)
        slots = SlotManager(engine, store, cfg.draft_restore_policy, self.metrics)
        self._slots = slots
        fallback = self._open_fallback()  # the auto-save's and the sessions'
        engine.sessions = self._sessions = SessionHost(
            engine, slots, cfg.session_ram_mb << 20, self.metrics, fallback,
            write_through=cfg.session_write_through, ack_stored=cfg.session_ack_stored)
        if store is not None and cfg.auto_save:
            rep = autosave.restore_all(slots, cfg.instance_id, cfg.restore_timeout, fallback)
            self.log.info("auto-restore done", extra=log.fields(
                instance_id=cfg.instance_id, restored=rep.restored, cold=rep.cold,
                store_unreachable=rep.store_unreachable, from_fallback=rep.from_fallback))
            if fallback is not None and fallback.pending():  # the store is down: later
                fallback.start_uploader(store, FALLBACK_RETRY_S, cfg.snapshot_timeout)
        self.servicer.runtime = Runtime(engine, slots, self._sessions, rc, store)
        self._set_health(health_pb2.HealthCheckResponse.SERVING)
        self.log.info("serving", extra=log.fields(
            model=target.name, fingerprint=target.fingerprint[:16],
            draft=draft.name if draft else None, slots=engine.n_slots, n_ctx=engine.n_ctx,
            store=store.describe() if store else None,
            load_ms=round(1e3 * (time.perf_counter() - t0), 1)))

    def _open_store(self) -> SlotStore | None:
        cfg = self.cfg
        if cfg.snapshot_addr is not None:
            def open_snapshot_store(addr: str) -> SnapshotStore:
                return SnapshotStore(addr, timeout=cfg.snapshot_timeout,
                                     max_protocol=cfg.snapshot_client_max_protocol,
                                     logger=self.log, **snapshot_security(cfg))

            addrs = parse_addrs(cfg.snapshot_addr)
            self._store = (open_snapshot_store(addrs[0]) if len(addrs) == 1
                           else FailoverStore(addrs, open_snapshot_store))
        elif cfg.slot_save_path is not None:
            self._store = LocalStore(cfg.slot_save_path)
        return self._store

    def _open_fallback(self) -> Fallback | None:
        """The local fallback of the auto-save (snapshot service only), or None."""
        cfg = self.cfg
        if cfg.snapshot_addr is None or cfg.fallback_save_path is None:
            return None
        try:
            self._fallback = Fallback(cfg.fallback_save_path, cfg.instance_id)
        except OSError as exc:
            self.log.warning("no local fallback for the auto-save", extra=log.fields(
                fallback_save_path=str(cfg.fallback_save_path), error=str(exc)))
        return self._fallback

    def stop(self, grace: float | None = None) -> bool:
        """Stops taking requests, lets running generations finish for `grace` seconds
        (then cuts them at a step boundary), saves every non-empty slot when auto-save
        is on, and frees everything. False when an auto-save failed."""
        if self._stopped.is_set():
            return True
        self._stopped.set()
        if self._grpc is None and self._engine is None and not self._models \
                and self._http is None:
            return True  # refused before it listened: nothing to drain, save, free or log
        grace = self.cfg.shutdown_grace if grace is None else grace
        self.log.info("stopping", extra=log.fields(grace_s=grace))
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        rt = self.servicer.runtime
        if rt is not None:
            rt.engine.drain(grace)
        if self._grpc is not None:
            self._grpc.stop(grace=1.0).wait()
        if self._http is not None:
            self._http.stop()
        uploads_done = self._fallback is None or self._fallback.close(FALLBACK_CLOSE_S)
        # while an upload of an older copy still waits on the store, save nothing there
        # (it could land after the save): everything goes to the fallback
        save_by = time.monotonic() + (self.cfg.auto_save_timeout if uploads_done else 0.0)
        saved: bool | None = None  # None: no auto-save ran (not serving yet, or off)
        if rt is not None and self._sessions is not None:
            saved = self._sessions.save_all(save_by)[1] == 0 if self._store else None
        if rt is not None and self._slots is not None and self._store is not None \
                and self.cfg.auto_save:
            rep = autosave.save_all(self._slots, self.cfg.instance_id, save_by,
                                    self._fallback)
            self.log.info("auto-save done", extra=log.fields(
                saved=rep.saved, to_fallback=rep.to_fallback, failed=rep.failed))
            saved = rep.ok and saved is not False
        if rt is not None:
            self.servicer.runtime = None
        if self._sessions is not None:
            self._sessions.close()
        if self._engine is not None:  # also when stopped during start-up
            self._engine.close()
            self._engine = None
        for m in reversed(self._models):
            m.close()
        self._models.clear()
        if self._store is not None and hasattr(self._store, "close"):
            self._store.close()
        if self._metrics_stop is not None:
            self._metrics_stop()
        self.log.info("stopped", extra=log.fields(auto_save_ok=saved))
        return saved is not False


def serve(cfg: Config) -> Server:
    """Starts a server and loads its models (tests, embedding)."""
    srv = Server(cfg)
    srv.start()
    try:
        srv.load()
    except BaseException:
        srv.stop(0)
        raise
    return srv

