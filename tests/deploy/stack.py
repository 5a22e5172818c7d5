"""Helpers for the deployment tests: the docker engine (Python SDK), compose projects
on host networking with free loopback ports, gRPC health from the host, timings."""

from __future__ import annotations

import datetime as dt
import json
import os
import secrets
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
IMAGE = os.environ.get("WARMSLOT_IMAGE", "warmslot:latest")
SEAWEEDFS_IMAGE = os.environ.get("WARMSLOT_SEAWEEDFS_IMAGE", "warmslot-seaweedfs:latest")
ROUTER_IMAGE = os.environ.get("WARMSLOT_ROUTER_IMAGE", "warmslot-router:latest")
SHARED_NAMESPACE = "shared"  # the namespace the compose replicas share (init_secrets --shared)
SHARED_KEY_FILE = f"/secrets/namespace-{SHARED_NAMESPACE}.key"
PROJECT_PREFIX = "wsdeploytest"
UNAVAILABLE_FILE = ROOT / "build" / "deploy-engine-unavailable"


def free_port(below: int = 65536) -> int:
    """A free loopback port under `below` (SeaweedFS listens on port + 10000 too)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < below:
            return port


def compose_command() -> list[str] | None:
    """`docker compose` (v2 plugin) when the client has it, else `docker-compose` (v1)."""
    if shutil.which("docker"):
        r = subprocess.run(["docker", "compose", "version"], capture_output=True)
        if r.returncode == 0:
            return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


def health(addr: str, timeout: float = 2.0,
           credentials: grpc.ChannelCredentials | None = None) -> str:
    """grpc.health.v1 status of the whole server at `addr`, or 'UNREACHABLE'."""
    try:
        ch = (grpc.insecure_channel(addr) if credentials is None
              else grpc.secure_channel(addr, credentials))
        with ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                         timeout=timeout)
            return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    except grpc.RpcError:
        return "UNREACHABLE"


def parse_docker_time(text: str) -> float:
    """Unix time of a docker timestamp such as 2026-11-29T16:52:03.290123456Z."""
    head, _, frac = text.rstrip("Z").partition(".")
    base = dt.datetime.fromisoformat(head).replace(tzinfo=dt.UTC).timestamp()
    return base + (float("0." + frac) if frac else 0.0)


@dataclass
class Service:
    """One service of a test project: its host-network port and instance id; an inference
    replica's HTTP door port (0: a free one the service picks) or the router's HTTP door
    and stats ports."""

    name: str
    port: int
    env: dict[str, str] = field(default_factory=dict)
    hostname: str | None = None
    volumes: list[str] = field(default_factory=list)
    http_port: int = 0
    stats_port: int = 0

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"


class Secrets:
    """The deployment's certificates and keys, made on the host (deploy/init_secrets.py)
    and mounted at /secrets, so that the tests hold the CA and the admin keys."""

    def __init__(self, workdir: Path, replicas: list[str]) -> None:
        import importlib.util

        spec = importlib.util.spec_from_file_location("init_secrets",
                                                      DEPLOY / "init_secrets.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        self.dir = workdir / "secrets"
        self.replicas = replicas
        mod.make(self.dir, replicas, [SHARED_NAMESPACE])
        self.dir.chmod(0o755)  # the containers' user reads them (test files only)
        for f in self.dir.iterdir():
            f.chmod(0o644)
        self.admin_key = (self.dir / "admin.key").read_text().strip()
        self.user_key = (self.dir / "user.key").read_text().strip()
        self.snapshot_admin_key = self.admin_key  # the same admin key on both services

    def read(self, name: str) -> bytes:
        return (self.dir / name).read_bytes()

    def credentials(self, client_cert: bool = False) -> grpc.ChannelCredentials:
        """Trusting the deployment's CA; with `client_cert`, showing the services'
        certificate (the snapshot service requires one)."""
        if client_cert:
            return grpc.ssl_channel_credentials(self.read("ca.crt"), self.read("service.key"),
                                                self.read("service.crt"))
        return grpc.ssl_channel_credentials(self.read("ca.crt"))


class Project:
    """A compose project made of deploy/docker-compose.yml plus a test override that puts
    every service on host networking with free loopback ports and mounts the test's
    secrets. Unique name; `down -v` removes everything it made."""

    def __init__(self, engine: Any, workdir: Path, tag: str,
                 services: list[Service], profiles: tuple[str, ...] = ()) -> None:
        self.engine = engine
        self.name = f"{PROJECT_PREFIX}{tag}{secrets.token_hex(3)}"
        self.services = {s.name: s for s in services}
        self.secrets = Secrets(workdir, [s.hostname for s in services if s.hostname])
        self.override = workdir / f"{self.name}.override.json"
        self.override.write_text(json.dumps(self._override(), indent=2))
        cmd = compose_command()
        assert cmd is not None
        self.cmd = [*cmd, "-p", self.name, "-f", str(DEPLOY / "docker-compose.yml"),
                    "-f", str(self.override)]
        for p in profiles:  # so that `down` removes those services' containers too
            self.cmd += ["--profile", p]

    def _override(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        snapshot = self.services.get("snapshot")
        # the `s3` profile: inference replicas list every snapshot replica on the bucket
        replicas = [s.addr for n, s in self.services.items() if n.startswith("snapshot-s3")]
        weed = self.services.get("seaweedfs")
        inference = [s for n, s in self.services.items() if n.startswith("inference")]
        for s in self.services.values():
            if s.name == "router":
                # the replicas on loopback; TLS as in the compose file, names resolved once
                env = {"WARMSLOT_ROUTER_BIND": "127.0.0.1",
                       "WARMSLOT_ROUTER_GRPC_PORT": str(s.port),
                       "WARMSLOT_ROUTER_HTTP_PORT": str(s.http_port),
                       "WARMSLOT_ROUTER_STATS_PORT": str(s.stats_port),
                       "WARMSLOT_ROUTER_RESOLVER": "",
                       "WARMSLOT_ROUTER_REPLICAS": ",".join(
                           f"127.0.0.1:{r.port}:{r.http_port}" for r in inference)}
            elif s.name == "seaweedfs":
                env = {"WEED_IP": "127.0.0.1", "WEED_BIND": "127.0.0.1",
                       "WEED_S3_PORT": str(s.port)}
                for name in ("MASTER", "VOLUME", "FILER"):  # +10000: their gRPC ports
                    env[f"WEED_{name}_PORT"] = str(free_port(below=55535))
            elif s.name.startswith("snapshot"):
                env = {"WARMSLOT_SNAPSHOT_HOST": "127.0.0.1",
                       "WARMSLOT_SNAPSHOT_PORT": str(s.port),
                       "WARMSLOT_SNAPSHOT_METRICS_PORT": "0"}
                if weed is not None and s.name.startswith("snapshot-s3"):
                    env["WARMSLOT_SNAPSHOT_S3_ENDPOINT"] = f"http://{weed.addr}"
            else:
                env = {"WARMSLOT_HOST": "127.0.0.1", "WARMSLOT_PORT": str(s.port),
                       "WARMSLOT_METRICS_PORT": "0",
                       # host networking: the HTTP door on loopback, a free port each
                       "WARMSLOT_HTTP_HOST": "127.0.0.1",
                       "WARMSLOT_HTTP_PORT": str(s.http_port)}
                if snapshot is not None:
                    env["WARMSLOT_SNAPSHOT_ADDR"] = snapshot.addr
                elif replicas:
                    env["WARMSLOT_SNAPSHOT_ADDR"] = ",".join(replicas)
            if s.hostname:
                env["WARMSLOT_INSTANCE_ID"] = s.hostname
                env["WARMSLOT_SNAPSHOT_KEY_FILE"] = f"/secrets/replica-{s.hostname}.key"
            env.update(s.env)
            image = {"seaweedfs": SEAWEEDFS_IMAGE, "router": ROUTER_IMAGE}.get(s.name, IMAGE)
            svc: dict[str, Any] = {
                "image": image,
                "network_mode": "host", "environment": env,
                "healthcheck": {"interval": "1s", "timeout": "3s", "retries": 2,
                                # SeaweedFS, and a snapshot service waiting for it, may
                                # take many seconds to start on a loaded machine: failed
                                # checks count only after this
                                "start_period": "90s" if s.name == "seaweedfs"
                                or s.name.startswith("snapshot-s3") else "2s"},
                "volumes": [*s.volumes, f"{self.secrets.dir}:/secrets:ro"]}
            if s.hostname:
                svc["hostname"] = s.hostname
            out[s.name] = svc
        # the secrets step finds the test's set complete (these replicas) and keeps it
        out["secrets"] = {"image": IMAGE, "network_mode": "host",
                          "command": ["python3", "/app/deploy/init_secrets.py", "/secrets",
                                      "--shared", SHARED_NAMESPACE, *self.secrets.replicas],
                          "volumes": [f"{self.secrets.dir}:/secrets"]}
        return {"services": out}

    def credentials(self, service: str) -> grpc.ChannelCredentials:
        # every snapshot service (snapshot, snapshot-s3-N) requires a client certificate
        return self.secrets.credentials(client_cert=service.startswith("snapshot"))

    def compose(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        r = subprocess.run([*self.cmd, *args], capture_output=True, text=True, timeout=timeout)
        if r.returncode != 0:
            raise AssertionError(f"{' '.join(args)} failed ({r.returncode}):\n{r.stderr[-3000:]}"
                                 f"{self._tails()}")
        return r

    def _tails(self, lines: int = 15) -> str:
        """The last log lines of every container of the project (why an `up` failed)."""
        out = []
        for c in self.engine.containers.list(all=True, filters={
                "label": [f"com.docker.compose.project={self.name}"]}):
            tail = c.logs(tail=lines).decode(errors="replace")
            out.append(f"\n--- {c.name} ({c.status}):\n{tail}")
        return "".join(out)

    def container(self, service: str) -> Any:
        found = self.engine.containers.list(all=True, filters={"label": [
            f"com.docker.compose.project={self.name}", f"com.docker.compose.service={service}"]})
        assert found, f"no container for {service} in {self.name}"
        found[0].reload()
        return found[0]

    def logs(self, service: str) -> str:
        return self.container(service).logs().decode(errors="replace")

    def wait_serving(self, service: str, timeout: float = 300) -> float:
        """Seconds from the container's start to its first SERVING answer."""
        addr = self.services[service].addr
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if health(addr, timeout=1.0, credentials=self.credentials(service)) == "SERVING":
                now = time.time()
                started = parse_docker_time(self.container(service).attrs["State"]["StartedAt"])
                return round(now - started, 2)
            c = self.container(service)
            if c.status not in ("created", "running", "restarting"):
                raise AssertionError(f"{service} is {c.status}:\n{self.logs(service)[-3000:]}")
            time.sleep(0.05)
        raise AssertionError(f"{service} not SERVING after {timeout} s:\n"
                             f"{self.logs(service)[-3000:]}")

    def wait_docker_health(self, service: str, want: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        status = None
        while time.monotonic() < deadline:
            status = self.container(service).attrs["State"].get("Health", {}).get("Status")
            if status == want:
                return
            time.sleep(0.25)
        raise AssertionError(f"{service}: docker health {status!r}, wanted {want!r}:\n"
                             f"{self.logs(service)[-3000:]}")

    def down(self) -> None:
        subprocess.run([*self.cmd, "down", "-v", "--remove-orphans", "-t", "60"],
                       capture_output=True, timeout=300)
        self.override.unlink(missing_ok=True)


def require_image(engine: Any, image: str) -> None:
    """Skips the test (saying why) when the image was not built locally."""
    import docker

    try:
        engine.images.get(image)
    except docker.errors.ImageNotFound:
        pytest.skip(f"deployment tests: image {image} not built (deploy/build-offline.sh)")


def sweep_leftovers(engine: Any) -> None:
    """Removes what earlier runs killed mid-test left behind (containers, volumes and
    networks of PROJECT_PREFIX* projects)."""
    for c in engine.containers.list(all=True, filters={"label": "com.docker.compose.project"}):
        if c.labels.get("com.docker.compose.project", "").startswith(PROJECT_PREFIX):
            c.remove(force=True)
    for v in engine.volumes.list():
        if v.name.startswith(PROJECT_PREFIX):
            v.remove(force=True)
    for n in engine.networks.list():
        if n.name.startswith(PROJECT_PREFIX):
            n.remove()


def error_lines(logs: str) -> list[dict[str, Any]]:
    """The JSON log lines at level error."""
    out = []
    for line in logs.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("level") == "error":
            out.append(rec)
    return out
