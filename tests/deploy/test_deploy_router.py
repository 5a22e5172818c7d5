"""The compose `replicas` profile, in docker: the snapshot service, three inference replicas
in one shared snapshot namespace (the shared key) and the router (HAProxy, deploy/router.py)
in front of them, TLS on both sides of it; host networking with free loopback ports
(tests/deploy/stack.py).

- a session's turns through the router land on one replica (the others do not hold it);
- that replica killed (SIGKILL): the next turn, through the router, is served by another
  replica, which restores the session from the store: it continues the exact history
  (cache_n) and its tokens equal a control computed from the whole history; the killed
  replica back: the session's turns go to it again and still continue exactly;
- a request without a session is served, on gRPC and on the HTTP door; the HTTP door routes
  X-Session-Id to the replica that holds the session;
- a stopped replica (SIGTERM) is taken out by the health check (HAProxy's stats say DOWN)
  within a bounded time, requests go on through the others, and it comes back UP.
The figures (the turn after the kill, stop to DOWN, start to UP) go to
build/deploy-report.json.

Run by `make test-deploy` with the rest of tests/deploy.
"""

from __future__ import annotations

import json
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.deploy.stack import (
    ROUTER_IMAGE,
    SHARED_KEY_FILE,
    Project,
    Service,
    free_port,
    require_image,
)
from tests.deploy.test_deploy import (  # noqa: F401 - fixtures
    REPORT,
    Models,
    engine,
    features,
    models,
    require_resume,
)

pytestmark = [pytest.mark.timeout(1500)]

REPLICAS = ("inference", "inference-1", "inference-2")
GEN = 8  # tokens generated per turn
UP_WAIT_S = 300.0  # a replica's start to UP at the router (model load on a loaded machine)
DOWN_WAIT_S = 30.0  # a stopped replica's DOWN at the router: 2 failed checks 1 s apart


def _load_router_module() -> Any:
    from tests.test_router_config import router

    return router


@pytest.fixture(scope="module")
def fleet(engine: Any, models: Models,  # noqa: F811
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Project]:
    require_image(engine, ROUTER_IMAGE)
    # one thread each: three replicas on a small machine; the shared namespace's key;
    # a session turn answered only once stored, so a kill right after loses nothing
    common = {**models.env, "WARMSLOT_SLOTS": "2", "WARMSLOT_THREADS": "1",
              "WARMSLOT_LOG_FORMAT": "json", "WARMSLOT_SNAPSHOT_KEY_FILE": SHARED_KEY_FILE,
              "WARMSLOT_SESSION_ACK_STORED": "1"}
    project = Project(engine, tmp_path_factory.mktemp("router"), "router", [
        Service("snapshot", free_port()),
        *(Service(name, free_port(), hostname=f"ws-r{i}", env=common, volumes=models.volumes,
                  http_port=free_port()) for i, name in enumerate(REPLICAS)),
        Service("router", free_port(), http_port=free_port(), stats_port=free_port())],
        profiles=("replicas",))
    try:
        project.compose("up", "-d", "snapshot", *REPLICAS, "router")
        for name in REPLICAS:
            project.wait_serving(name)
        wait_router(project, {n: "UP" for n in REPLICAS}, UP_WAIT_S)
        yield project
    finally:
        project.down()


def test_router_image_runs_as_the_services_user(engine: Any) -> None:  # noqa: F811
    """The secrets step writes the certificate's key 0600 for uid 10001 (the services'
    user): a router running as another user cannot read it and restarts in a loop (the test
    projects' secrets are world-readable, so only this shows it)."""
    import docker

    try:
        image = engine.images.get(ROUTER_IMAGE)
    except docker.errors.ImageNotFound:
        pytest.skip(f"deployment tests: image {ROUTER_IMAGE} not built")
    assert image.attrs["Config"]["User"] == "10001:10001"


def server_name(project: Project, replica: str) -> str:
    """The replica's server name in the router's configuration (host-port: every test
    replica is on 127.0.0.1)."""
    return f"127.0.0.1-{project.services[replica].port}"


def router_states(project: Project) -> dict[str, str]:
    """{replica: status} of the health-checked backend, from HAProxy's stats page."""
    router = _load_router_module()
    states = router.servers_up(f"127.0.0.1:{project.services['router'].stats_port}")
    return {n: states["grpc_session"][server_name(project, n)] for n in REPLICAS}


def wait_router(project: Project, want: dict[str, str], timeout: float) -> float:
    """Seconds until the router's stats show each replica of `want` in its status (UP or
    DOWN, the first word)."""
    t0 = time.monotonic()
    states: dict[str, str] = {}
    while time.monotonic() - t0 < timeout:
        try:
            states = router_states(project)
        except OSError:
            states = {}
        if states and all(states[n].split()[0] == s for n, s in want.items()):
            return round(time.monotonic() - t0, 2)
        time.sleep(0.1)
    raise AssertionError(f"router: {states}, wanted {want} within {timeout} s:\n"
                         f"{project.logs('router')[-3000:]}")


def connect(project: Project, service: str = "router") -> Any:
    from inference_svc.client import InferenceClient

    return InferenceClient(project.services[service].addr, timeout=120,
                           api_key=project.secrets.admin_key,
                           credentials=project.credentials(service))


def holders(project: Project, session: str) -> set[str]:
    """The replicas that hold `session` in a slot or in RAM (asked directly, not through
    the router; the store tier is shared, so every replica lists it there)."""
    from inference_svc.pb import inference_pb2 as pb

    local = (pb.SESSION_TIER_SLOT, pb.SESSION_TIER_RAM)
    out = set()
    for name in REPLICAS:
        if project.container(name).status != "running":
            continue
        with connect(project, name) as c:
            if any(s.name == session and s.tier in local for s in c.sessions()):
                out.add(name)
    return out


@dataclass
class Conversation:
    """A session's acknowledged history (its tokens) and the words its turns send."""

    name: str
    words: list[int]
    history: list[int] = field(default_factory=list)
    turns: int = 0

    def next_prompt(self) -> list[int]:
        self.turns += 1
        start = (self.turns * 7) % max(1, len(self.words) - 40)
        return self.words[start:start + 24 + self.turns]


def session_turn(c: Any, conv: Conversation, prompt: list[int]) -> tuple[list[int], Any]:
    """One turn of the session; checks that it continued the acknowledged history."""
    responses, last = c.generate(prompt, session=conv.name, max_tokens=GEN, temperature=0.0)
    out = [t for r in responses for t in r.tokens]
    assert last.timings.cache_n == len(conv.history), (
        f"{conv.name}: the turn continued {last.timings.cache_n} tokens, "
        f"the acknowledged history is {len(conv.history)}")
    conv.history += prompt + out
    return out, last.timings


@pytest.fixture(scope="module")
def words(fleet: Project, features: set[str]) -> list[int]:  # noqa: F811
    require_resume(features)
    from tests.deploy.test_deploy import ROOT

    text = "\n".join(p.read_text() for p in sorted((ROOT / "inference_svc").glob("*.py")))
    with connect(fleet) as c:
        return c.tokenize(text[:20000])


def test_session_turns_land_on_one_replica(fleet: Project, words: list[int]) -> None:
    convs = [Conversation(f"route-{i}", words) for i in range(9)]
    first: dict[str, set[str]] = {}
    with connect(fleet) as c:
        for turn in range(3):
            for conv in convs:
                session_turn(c, conv, conv.next_prompt())
                where = holders(fleet, conv.name)
                assert len(where) == 1, (conv.name, turn, where)
                assert first.setdefault(conv.name, where) == where, (conv.name, turn, where)
    spread = {next(iter(w)) for w in first.values()}
    REPORT["router_sessions_per_replica"] = {
        n: sum(w == {n} for w in first.values()) for n in REPLICAS}
    assert len(spread) >= 2, first  # consistent hashing spreads the sessions


def test_killed_replica_moves_its_session(fleet: Project, words: list[int]) -> None:
    """kill -9 of the replica that holds a session: the next turn through the router is
    served by another replica from the store, exactly; the replica back, the session's
    turns go to it again and still continue exactly."""
    from inference_svc.pb import inference_pb2 as pb

    conv = Conversation("killed", words)
    with connect(fleet) as c:
        for _ in range(3):
            session_turn(c, conv, conv.next_prompt())
        (victim,) = holders(fleet, conv.name)
        prompt = conv.next_prompt()
        # the control: the whole history and the new tokens, without a session, from
        # scratch (cache_prompt off) on whichever replica the router picks
        control, _ = c.generate(conv.history + prompt, max_tokens=GEN, temperature=0.0,
                                cache_prompt=False)
        expected = [t for r in control for t in r.tokens]
        fleet.container(victim).kill()  # SIGKILL: no auto-save, no drain
        t0 = time.monotonic()
        out, timings = session_turn(c, conv, prompt)
        moved_s = round(time.monotonic() - t0, 2)
        assert out == expected, "the moved session's turn differs from the control"
        assert timings.session_tier == pb.SESSION_TIER_STORE
        (heir,) = holders(fleet, conv.name)
        assert heir != victim
        REPORT["router_kill"] = {"victim": victim, "heir": heir, "turn_after_kill_s": moved_s,
                                 "session_tokens": len(conv.history)}
        session_turn(c, conv, conv.next_prompt())
        assert holders(fleet, conv.name) == {heir}
    fleet.compose("start", victim)
    fleet.wait_serving(victim)
    REPORT["router_kill"]["back_up_s"] = wait_router(fleet, {victim: "UP"}, UP_WAIT_S)
    with connect(fleet) as c:
        _, timings = session_turn(c, conv, conv.next_prompt())  # back on the victim
    assert timings.session_tier == pb.SESSION_TIER_STORE  # the heir's turns, from the store
    assert victim in holders(fleet, conv.name)


def _http(project: Project, path: str, body: dict[str, Any],
          headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
    ctx = ssl.create_default_context(cafile=str(project.secrets.dir / "ca.crt"))
    req = urllib.request.Request(
        f"https://127.0.0.1:{project.services['router'].http_port}{path}",
        data=json.dumps(body).encode(), method="POST",
        headers={"Content-Type": "application/json",
                 "Authorization": f"Bearer {project.secrets.admin_key}", **headers})
    try:
        with urllib.request.urlopen(req, timeout=120, context=ctx) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def test_requests_without_a_session_are_served(fleet: Project, words: list[int]) -> None:
    with connect(fleet) as c:
        for _ in range(3):
            _, last = c.generate(words[:32], max_tokens=GEN, temperature=0.0)
            assert last.done and last.timings.predicted_n > 0
            assert last.timings.session_tier == 0  # no session
    status, body = _http(fleet, "/v1/completions",
                         {"prompt": "def add(a, b):", "max_tokens": 4, "temperature": 0}, {})
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 4 and body["timings"]["session_tier"] is None


def test_http_door_routes_the_session_header(fleet: Project, words: list[int]) -> None:
    """X-Session-Id through the router's HTTP door reaches the replica that holds the
    session (gRPC and HTTP hash the same header onto the same servers): it continues the
    session from its slot."""
    conv = Conversation("http-door", words)
    with connect(fleet) as c:
        session_turn(c, conv, conv.next_prompt())
    where = holders(fleet, conv.name)
    status, body = _http(fleet, "/v1/completions",
                         {"prompt": " and then", "max_tokens": 4, "temperature": 0},
                         {"X-Session-Id": conv.name})
    assert status == 200, body
    assert body["timings"]["session_tier"] == "slot", body["timings"]
    assert body["timings"]["cache_n"] == len(conv.history)
    assert holders(fleet, conv.name) == where


def test_health_check_takes_a_stopped_replica_out(fleet: Project, words: list[int]) -> None:
    """SIGTERM: the replica's health says NOT_SERVING as it starts to drain, and the router
    takes it out (DOWN) within DOWN_WAIT_S; every request goes on through the other two;
    started again, it is UP."""
    import subprocess

    victim = "inference-2"
    wait_router(fleet, {n: "UP" for n in REPLICAS}, UP_WAIT_S)
    stop = subprocess.Popen([*fleet.cmd, "stop", "-t", "60", victim],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        down_s = wait_router(fleet, {victim: "DOWN"}, DOWN_WAIT_S)
    finally:
        stop.wait(120)
    REPORT["router_stop_to_down_s"] = down_s
    assert fleet.container(victim).status == "exited"
    with connect(fleet) as c:
        for i in range(6):  # sessions and not: all served by the two left
            _, last = c.generate(words[:16], max_tokens=2, temperature=0.0,
                                 **({"session": f"after-stop-{i}"} if i % 2 else {}))
            assert last.done
    for i in range(1, 6, 2):
        assert holders(fleet, f"after-stop-{i}") <= {"inference", "inference-1"}
    fleet.compose("start", victim)
    fleet.wait_serving(victim)
    REPORT["router_restart_to_up_s"] = wait_router(fleet, {victim: "UP"}, UP_WAIT_S)
