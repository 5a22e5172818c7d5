"""The compose deployment, in docker: deploy/docker-compose.yml plus a test override that
puts every container on host networking with free loopback ports.

Run by `make test-deploy` (and `make test`), which builds the image first with
deploy/build-offline.sh; skipped, with the reason, when no docker engine can be started.

- the image: non-root, size;
- bad input: a missing model, an unreachable snapshot service -> one log line, health
  NOT_SERVING, the container neither exits nor restarts;
- the stack: snapshot healthy, then inference healthy; a generation through the port;
- restart of the inference container: a long session on slot 0 resumes (the next turn
  processes only its new tokens, output identical to a control computed before);
- `down` (volume kept) and `up`: the snapshot volume and the session are still there;
- security: the default compose configuration runs TLS and keys, the snapshot service
  unpublished, the replicas in one shared snapshot namespace (docker-compose.isolated.yml:
  each its own); in the running stack a call without TLS, without a key or with a key
  lacking the right is refused, and replicas with their own namespaces (the isolated
  option) cannot reach each other's snapshots.

The session checks need restart-resume (--snapshot-addr, --instance-id, auto-save and
auto-restore in the inference service); an image without it is stale and fails them.
Figures (image size, start-to-SERVING times, stop times) go to build/deploy-report.json.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.deploy.stack import (
    IMAGE,
    ROOT,
    UNAVAILABLE_FILE,
    Project,
    Service,
    compose_command,
    error_lines,
    free_port,
    health,
    sweep_leftovers,
)

pytestmark = [pytest.mark.timeout(1500)]

REPORT: dict[str, Any] = {}
GEN = 32  # tokens generated per turn
NEW = 100  # new prompt tokens of a checked turn


# --- engine, image, models -----------------------------------------------------------


@pytest.fixture(scope="session")
def engine() -> Any:
    if os.environ.get("WARMSLOT_DEPLOY_TEST") != "1":
        pytest.skip("deployment tests: run by `make test-deploy` (and `make test`), which "
                    "builds the image first")
    import docker

    if compose_command() is None:
        pytest.skip("deployment tests: neither `docker compose` nor `docker-compose` found")
    try:
        client = docker.from_env(version="auto", timeout=300)
        client.ping()
    except Exception as exc:  # any failure here means: no engine
        why = UNAVAILABLE_FILE.read_text().strip() if UNAVAILABLE_FILE.exists() else str(exc)
        pytest.skip(f"deployment tests: no docker engine ({why})")
    try:
        client.images.get(IMAGE)
    except docker.errors.ImageNotFound:
        pytest.skip(f"deployment tests: image {IMAGE} not built (deploy/build-offline.sh)")
    sweep_leftovers(client)
    return client


@pytest.fixture(scope="session")
def features(engine: Any) -> set[str]:
    """The inference service's flags, as the image has them."""
    out = engine.containers.run(IMAGE, ["python3", "-m", "inference_svc", "--help"],
                                remove=True).decode()
    return {w.strip(",[]") for w in out.split() if w.startswith("--")}


def require_resume(features: set[str]) -> None:
    """The source has restart-resume, so an image without its flags was not built from
    this tree (a failed or skipped build left an older one): a failure, never a skip."""
    missing = {"--snapshot-addr", "--instance-id"} - features
    if missing:
        pytest.fail(f"the image {IMAGE} is stale: its inference service has no "
                    f"{', '.join(sorted(missing))}, which this source has; rebuild it with "
                    f"deploy/build-offline.sh")


@dataclass
class Models:
    env: dict[str, str]
    volumes: list[str]
    session_tokens: int
    note: str


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> Models:
    """The bundled models when they exist; else a random pair mounted into the container."""
    want = int(os.environ.get("WARMSLOT_DEPLOY_SESSION_TOKENS", "0"))
    if (ROOT / "models" / "target.gguf").exists() and (ROOT / "models" / "draft.gguf").exists():
        return Models({}, [], want or 3500, "bundled models")
    from tests.factory import Shape
    from tests.fixtures.servicekit import write_pair

    d = tmp_path_factory.mktemp("deploy-models")
    write_pair(d, Shape(n_vocab=300, n_embd=64, n_layer=2, n_head=4, n_head_kv=2, n_ff=96,
                        n_ctx=2048))
    d.chmod(0o755)
    for f in d.iterdir():
        f.chmod(0o644)
    return Models({"WARMSLOT_MODEL": "/test-models/target.gguf",
                   "WARMSLOT_DRAFT": "/test-models/draft.gguf"},
                  [f"{d}:/test-models:ro"], want or 1500,
                  "random test models (models/target.gguf is not in the repository yet)")


@pytest.fixture(scope="module", autouse=True)
def report() -> Iterator[dict[str, Any]]:
    """Writes the figures to build/deploy-report.json (conftest.py prints them)."""
    yield REPORT
    if REPORT:
        out = ROOT / "build" / "deploy-report.json"
        out.parent.mkdir(exist_ok=True)
        out.write_text(json.dumps(REPORT, indent=2) + "\n")


def test_image_runs_as_non_root_user(engine: Any) -> None:
    image = engine.images.get(IMAGE)
    assert image.attrs["Config"]["User"] == "10001:10001"
    REPORT["image"] = {"tag": IMAGE, "size_mb": round(image.attrs["Size"] / 1e6, 1)}
    out = engine.containers.run(IMAGE, ["id", "-u"], remove=True).decode().strip()
    assert out == "10001"


# --- bad input -------------------------------------------------------------------------


@pytest.fixture(scope="class")
def bad_stack(engine: Any, models: Models, tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[Project]:
    """Two inference containers with no snapshot container: one told to load a model file
    that does not exist, one pointed at a snapshot address where nothing listens."""
    project = Project(engine, tmp_path_factory.mktemp("bad"), "bad", [
        Service("inference", free_port(), hostname="bad-model",
                env={"WARMSLOT_MODEL": "/app/models/no-such-model.gguf",
                     "WARMSLOT_SNAPSHOT_ADDR": f"127.0.0.1:{free_port()}"}),
        Service("inference-1", free_port(), hostname="bad-snapshot",
                env={**models.env, "WARMSLOT_SNAPSHOT_ADDR": f"127.0.0.1:{free_port()}",
                     "WARMSLOT_DEPLOY_SNAPSHOT_WAIT": "2"}, volumes=models.volumes)])
    try:
        project.compose("up", "-d", "--no-deps", "inference", "inference-1")
        yield project
    finally:
        project.down()


def _assert_held_not_serving(project: Project, service: str, phrase: str) -> dict[str, Any]:
    project.wait_docker_health(service, "unhealthy", timeout=90)
    assert health(project.services[service].addr) == "NOT_SERVING"
    time.sleep(3)  # a crash loop would show by now
    c = project.container(service)
    assert c.status == "running" and c.attrs["RestartCount"] == 0, c.attrs["State"]
    errors = error_lines(project.logs(service))
    assert len(errors) == 1, errors
    assert phrase in errors[0]["message"], errors[0]
    return errors[0]


class TestBadInput:
    def test_missing_model_is_one_line_and_not_serving(self, bad_stack: Project) -> None:
        line = _assert_held_not_serving(bad_stack, "inference", "not found")
        assert "/app/models/no-such-model.gguf" in line["message"]

    def test_unreachable_snapshot_is_one_line_and_not_serving(self, bad_stack: Project
                                                              ) -> None:
        line = _assert_held_not_serving(bad_stack, "inference-1", "unreachable")
        assert line["snapshot_addr"] == bad_stack.services["inference-1"].env[
            "WARMSLOT_SNAPSHOT_ADDR"]


# --- the stack -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stack(engine: Any, models: Models, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[Project]:
    common = {**models.env, "WARMSLOT_SLOTS": "2", "WARMSLOT_LOG_FORMAT": "json"}
    project = Project(engine, tmp_path_factory.mktemp("stack"), "stack", [
        Service("snapshot", free_port()),
        Service("inference", free_port(), hostname="ws-a", env=common,
                volumes=models.volumes),
        Service("inference-1", free_port(), hostname="ws-b", env=common,
                volumes=models.volumes)])
    REPORT["models"] = models.note
    try:
        project.compose("up", "-d", "snapshot", "inference")
        REPORT["start_to_serving_s"] = {
            "snapshot": project.wait_serving("snapshot"),
            "inference_cold": project.wait_serving("inference")}
        yield project
    finally:
        project.down()


def client(project: Project, service: str = "inference", key: str | None = "admin") -> Any:
    from inference_svc.client import InferenceClient

    api_key = {"admin": project.secrets.admin_key, "user": project.secrets.user_key}.get(
        key or "")
    return InferenceClient(project.services[service].addr, timeout=600, api_key=api_key,
                           credentials=project.credentials(service))


def snapshot_admin(project: Project) -> Any:
    from snapshot_svc.client import SnapshotClient

    return SnapshotClient(project.services["snapshot"].addr,
                          credentials=project.credentials("snapshot"),
                          api_key=project.secrets.snapshot_admin_key)


def test_stack_is_healthy_and_serves_through_the_port(stack: Project) -> None:
    stack.wait_docker_health("snapshot", "healthy")
    stack.wait_docker_health("inference", "healthy")
    with client(stack) as c:
        info = c.info()
        assert info.n_slots == 2
        _, last = c.generate("def add(a, b):", max_tokens=8, temperature=0.0)
        assert last.done and last.timings.predicted_n > 0


def test_stack_refuses_calls_without_tls_or_key(stack: Project) -> None:
    import grpc

    from inference_svc.client import InferenceClient
    from snapshot_svc.client import SnapshotClient
    from snapshot_svc.errors import Unauthenticated, Unavailable

    addr = stack.services["inference"].addr

    def code(fn: Any) -> str:
        try:
            fn()
        except grpc.RpcError as exc:
            return exc.code().name
        return "OK"

    with InferenceClient(addr, timeout=10) as plain:
        assert code(plain.info) == "UNAVAILABLE"
    with client(stack, key=None) as anonymous:
        assert code(anonymous.info) == "UNAUTHENTICATED"
    with client(stack, key="user") as user:
        assert code(user.info) == "OK"
        assert code(user.slots) == "PERMISSION_DENIED"
    snap = stack.services["snapshot"].addr
    for creds in (None, stack.secrets.credentials(client_cert=False)):  # no TLS, no cert
        with SnapshotClient(snap, credentials=creds, retries=0, timeout=10,
                            api_key=stack.secrets.snapshot_admin_key) as sc, \
                pytest.raises(Unavailable):
            sc.list()
    with SnapshotClient(snap, credentials=stack.credentials("snapshot"), retries=0,
                        timeout=10) as sc, pytest.raises(Unauthenticated):
        sc.list()


def compose_config(*files: str) -> dict[str, Any]:
    """`compose config` of deploy/docker-compose.yml, the override and `files`, with the
    `replicas` profile."""
    import subprocess

    import yaml

    from tests.deploy.stack import DEPLOY

    cmd = compose_command()
    assert cmd is not None
    args = [a for f in ("docker-compose.yml", "docker-compose.override.yml", *files)
            for a in ("-f", str(DEPLOY / f))]
    out = subprocess.run([*cmd, *args, "--profile", "replicas", "config"], capture_output=True,
                         text=True, check=True, cwd=DEPLOY, timeout=120).stdout
    return yaml.safe_load(out)["services"]


def published(service: dict[str, Any]) -> set[tuple[str, str, str]]:
    # docker-compose 1.29 prints a port as "127.0.0.1:8080:8080/tcp", compose v2 as a mapping
    return {(str(p["host_ip"]), str(p["published"]), str(p["target"]))
            if isinstance(p, dict) else tuple(str(p).removesuffix("/tcp").split(":"))
            for p in service.get("ports", [])}


def test_default_compose_is_secure(engine: Any) -> None:
    """The compose files as shipped: TLS and keys on every service, certificates and keys
    made by the secrets step in a volume, the snapshot service's gRPC port not published
    on the host, the `replicas` profile's replicas in one shared snapshot namespace (its
    key, never keys off) behind a router that speaks TLS on both sides, every port
    published on the host's loopback only; docker-compose.isolated.yml gives each replica
    its own namespace."""
    services = compose_config()
    assert "init_secrets.py" in " ".join(services["secrets"]["command"])
    assert services["secrets"]["command"][3:5] == ["--shared", "shared"]
    snap = services["snapshot"]
    assert not any("50052" in p[1] for p in published(snap)), published(snap)
    env = snap["environment"]
    assert env["WARMSLOT_SNAPSHOT_API_KEYS"] and env["WARMSLOT_SNAPSHOT_TLS_CERT"]
    assert env["WARMSLOT_SNAPSHOT_TLS_CLIENT_CA"]  # replicas need client certificates
    replicas = ("inference", "inference-1", "inference-2")
    key_files = set()
    for name in replicas:
        env = services[name]["environment"]
        for var in ("WARMSLOT_API_KEYS", "WARMSLOT_TLS_CERT", "WARMSLOT_TLS_KEY",
                    "WARMSLOT_SNAPSHOT_CLIENT_TLS_CA", "WARMSLOT_SNAPSHOT_CLIENT_TLS_CERT"):
            assert env.get(var), (name, var)
        assert "WARMSLOT_INSECURE" not in env
        key_files.add(env["WARMSLOT_SNAPSHOT_KEY_FILE"])
    assert key_files == {"/secrets/namespace-shared.key"}
    isolated = compose_config("docker-compose.isolated.yml")
    assert {isolated[n]["environment"]["WARMSLOT_SNAPSHOT_KEY_FILE"] for n in replicas} == {
        f"/secrets/replica-inference-{i}.key" for i in range(3)}
    # the HTTP (OpenAI API) door beside gRPC, published on the host's loopback only
    for name, http in (("inference", "8080"), ("inference-1", "8180"), ("inference-2", "8280")):
        assert services[name]["environment"]["WARMSLOT_HTTP_PORT"] == "8080"
        assert ("127.0.0.1", http, "8080") in published(services[name]), name
    router = services["router"]
    env = router["environment"]
    assert (env["WARMSLOT_ROUTER_TLS_CERT"], env["WARMSLOT_ROUTER_TLS_KEY"],
            env["WARMSLOT_ROUTER_TLS_CA"]) == ("/secrets/service.crt", "/secrets/service.key",
                                               "/secrets/ca.crt")
    assert env["WARMSLOT_ROUTER_REPLICAS"] == ",".join(f"{n}:50051:8080" for n in replicas)
    assert published(router) == {("127.0.0.1", p, p) for p in ("50050", "8000", "8404")}


# --- the session -----------------------------------------------------------------------


@dataclass
class Session:
    """A long conversation on slot 0, fed with token chunks of the repository's sources."""

    stream: list[int]
    history: list[int] = field(default_factory=list)
    pos: int = 0

    def take(self, n: int) -> list[int]:
        if self.pos + n > len(self.stream):
            self.pos = 0
        chunk = self.stream[self.pos:self.pos + n]
        self.pos += n
        return chunk


def turn(c: Any, prompt: list[int], slot: int, cache: bool = True) -> tuple[list[int], Any]:
    responses, last = c.generate(prompt, id_slot=slot, max_tokens=GEN, temperature=0.0,
                                 cache_prompt=cache)
    return [t for r in responses for t in r.tokens], last.timings


@pytest.fixture(scope="module")
def session(stack: Project, models: Models, features: set[str]) -> Session:
    require_resume(features)
    text = "\n".join(p.read_text() for d in ("inference_svc", "snapshot_svc")
                     for p in sorted((ROOT / d).glob("*.py")))
    with client(stack) as c:
        s = Session(c.tokenize(text))
        s.history = s.take(1000)
        while len(s.history) < models.session_tokens:
            prompt = s.history + s.take(min(500, models.session_tokens - len(s.history)))
            out, _ = turn(c, prompt, 0)
            s.history = prompt + out
    REPORT["session_tokens"] = len(s.history)
    return s


def control_then_erase(c: Any, s: Session) -> tuple[list[int], list[int], Any, int]:
    """The next turn's prompt, its output and timings computed on slot 1 from scratch
    (the reference), then slot 1 erased; and slot 0's token count."""
    prompt = s.history + s.take(NEW)
    out, timings = turn(c, prompt, 1, cache=False)
    c.erase(1)
    n0 = next(x.n_tokens for x in c.slots() if x.id == 0)
    return prompt, out, timings, n0


def check_resumed_turn(c: Any, s: Session, prompt: list[int], expected: list[int],
                       control: Any, n0: int, what: str) -> None:
    slot0 = next(x for x in c.slots() if x.id == 0)
    assert slot0.n_tokens == n0, f"{what}: slot 0 holds {slot0.n_tokens} tokens, not {n0}"
    out, t = turn(c, prompt, 0)
    assert out == expected, f"{what}: output differs from the control"
    new = len(prompt) - n0
    assert t.prompt_n <= new + 1, f"{what}: {t.prompt_n} prompt tokens processed, not ~{new}"
    assert t.draft_prompt_n <= new + 1, f"{what}: draft processed {t.draft_prompt_n} tokens"
    REPORT.setdefault("resumed_turns", {})[what] = {
        "session_tokens": n0, "new_tokens": new, "prompt_n": t.prompt_n,
        "draft_prompt_n": t.draft_prompt_n, "prompt_ms": round(t.prompt_ms, 1),
        "control_prompt_n": control.prompt_n, "control_prompt_ms": round(control.prompt_ms, 1),
        "draft_accepted": f"{t.draft_n_accepted}/{t.draft_n}",
        "control_draft_accepted": f"{control.draft_n_accepted}/{control.draft_n}"}
    s.history = prompt + out


def session_if_resume(request: pytest.FixtureRequest, features: set[str]) -> Session | None:
    """The long session when the image can resume it; None otherwise (the test then
    checks what it can without one, and skips the rest)."""
    if {"--snapshot-addr", "--instance-id"} <= features:
        return request.getfixturevalue("session")
    return None


def test_restart_resumes_the_session(stack: Project, features: set[str],
                                     request: pytest.FixtureRequest) -> None:
    """Stop + start of the inference container: SIGTERM saves the slots, the start
    restores them before SERVING."""
    session = session_if_resume(request, features)
    if session is not None:
        with client(stack) as c:
            prompt, expected, control, n0 = control_then_erase(c, session)
    t0 = time.monotonic()
    stack.compose("stop", "inference")
    stop_s = round(time.monotonic() - t0, 2)
    c_state = stack.container("inference").attrs["State"]
    assert c_state["ExitCode"] == 0, stack.logs("inference")[-3000:]
    stack.compose("start", "inference")
    serving = stack.wait_serving("inference")
    key = "restart" if session is None else f"restart_with_{n0}_token_session"
    REPORT.setdefault("stop_s", {})[key] = stop_s
    REPORT["start_to_serving_s"][f"inference_{key}"] = serving
    require_resume(features)
    assert session is not None
    with client(stack) as c:
        check_resumed_turn(c, session, prompt, expected, control, n0, "after restart")


def test_down_and_up_keeps_the_volume_and_the_session(stack: Project, features: set[str],
                                                      request: pytest.FixtureRequest) -> None:
    marker = os.urandom(4096)
    with snapshot_admin(stack) as sc:
        sc.put("deploy-marker", marker)
    session = session_if_resume(request, features)
    if session is not None:
        with client(stack) as c:
            prompt, expected, control, n0 = control_then_erase(c, session)
    stack.compose("down")  # keeps the named volume
    stack.compose("up", "-d", "snapshot", "inference")
    REPORT["start_to_serving_s"]["snapshot_after_down_up"] = stack.wait_serving("snapshot")
    REPORT["start_to_serving_s"]["inference_after_down_up"] = stack.wait_serving("inference")
    with snapshot_admin(stack) as sc:
        assert sc.get("deploy-marker").target == marker
    require_resume(features)
    assert session is not None
    with client(stack) as c:
        check_resumed_turn(c, session, prompt, expected, control, n0, "after down and up")


def test_replicas_cannot_reach_each_others_snapshots(session: Session,
                                                     stack: Project) -> None:
    import grpc

    stack.compose("up", "-d", "--no-deps", "inference-1")
    REPORT["start_to_serving_s"]["inference_replica_cold"] = stack.wait_serving("inference-1")
    with client(stack) as a, client(stack, "inference-1") as b:
        saved = a.save(0, "session-a")
        assert saved.n_saved > 0
        with pytest.raises(grpc.RpcError) as err:  # A's namespace: absent for B
            b.restore(0, "session-a")
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        b.generate("def sub(a, b):", id_slot=0, max_tokens=4, temperature=0.0)
        b.save(0, "session-a")  # B's own snapshot of that name: no clash
        assert a.restore(0, "session-a").n_restored == saved.n_saved
    # each replica auto-saves under its own instance id, in its own namespace
    stack.compose("stop", "inference", "inference-1")
    with snapshot_admin(stack) as sc:
        names = {i.name for i in sc.list("ws-")}
    assert {"ws-a:auto-ws-a-slot0", "ws-b:auto-ws-b-slot0", "ws-a:session-a",
            "ws-b:session-a"} <= names, names
