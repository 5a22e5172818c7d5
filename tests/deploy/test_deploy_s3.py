"""The compose `s3` profile, in docker: SeaweedFS, two snapshot-service replicas on one
bucket, an inference replica that lists both (`WARMSLOT_SNAPSHOT_ADDR=a,b`); host
networking with free loopback ports (tests/deploy/stack.py).

- restart of the inference container: the long session on slot 0 resumes through the
  bucket (the next turn processes only its new tokens, output identical to a control);
- one snapshot replica lost: saves, restores and a restart-resume go on through the other.

Run by `make test-deploy` with the rest of tests/deploy.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from snapshot_svc.client import SnapshotClient
from tests.deploy.stack import SEAWEEDFS_IMAGE, Project, Service, free_port, require_image
from tests.deploy.test_deploy import (  # noqa: F401 - fixtures
    NEW,
    Models,
    Session,
    check_resumed_turn,
    client,
    control_then_erase,
    engine,
    features,
    models,
    require_resume,
    turn,
)

pytestmark = [pytest.mark.timeout(1500)]

SESSION_TOKENS = 1500  # enough to show that only the new tokens are processed


@pytest.fixture(scope="module")
def s3_stack(engine: Any, models: Models,  # noqa: F811
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[Project]:
    require_image(engine, SEAWEEDFS_IMAGE)
    common = {**models.env, "WARMSLOT_SLOTS": "2", "WARMSLOT_LOG_FORMAT": "json"}
    project = Project(engine, tmp_path_factory.mktemp("s3"), "s3", [
        Service("seaweedfs", free_port(below=55535)),
        Service("snapshot-s3-1", free_port()),
        Service("snapshot-s3-2", free_port()),
        Service("inference-s3-0", free_port(), hostname="ws-s3", env=common,
                volumes=models.volumes)], profiles=("s3",))
    try:
        project.compose("up", "-d", "seaweedfs", "snapshot-s3-1", "snapshot-s3-2",
                        "inference-s3-0")
        for name in ("snapshot-s3-1", "snapshot-s3-2", "inference-s3-0"):
            project.wait_serving(name)
        yield project
    finally:
        project.down()


@pytest.fixture(scope="module")
def s3_session(s3_stack: Project, features: set[str]) -> Session:  # noqa: F811
    require_resume(features)
    from tests.deploy.test_deploy import ROOT

    text = "\n".join(p.read_text() for d in ("inference_svc", "snapshot_svc")
                     for p in sorted((ROOT / d).glob("*.py")))
    with client(s3_stack, "inference-s3-0") as c:
        s = Session(c.tokenize(text))
        s.history = s.take(1000)
        while len(s.history) < SESSION_TOKENS:
            prompt = s.history + s.take(min(500, SESSION_TOKENS - len(s.history)))
            out, _ = turn(c, prompt, 0)
            s.history = prompt + out
    return s


# the inference replica's host name, its snapshot key's namespace (deploy/init_secrets.py)
NAMESPACE = "ws-s3"


def admin_snapshot_client(stack: Project, service: str) -> SnapshotClient:
    """A snapshot client over mTLS with the deployment's admin key (sees every namespace)."""
    return SnapshotClient(stack.services[service].addr, credentials=stack.credentials(service),
                          api_key=stack.secrets.snapshot_admin_key)


def _restart_and_check(stack: Project, session: Session, what: str) -> None:
    with client(stack, "inference-s3-0") as c:
        prompt, expected, control, n0 = control_then_erase(c, session)
    stack.compose("stop", "inference-s3-0")
    state = stack.container("inference-s3-0").attrs["State"]
    assert state["ExitCode"] == 0, stack.logs("inference-s3-0")[-3000:]
    stack.compose("start", "inference-s3-0")
    stack.wait_serving("inference-s3-0")
    with client(stack, "inference-s3-0") as c:
        check_resumed_turn(c, session, prompt, expected, control, n0, what)


def test_s3_restart_resumes_the_session(s3_stack: Project, s3_session: Session) -> None:
    _restart_and_check(s3_stack, s3_session, "after restart (s3 profile)")
    # the auto-save went to the bucket, in the replica's namespace: both snapshot
    # replicas list it
    for name in ("snapshot-s3-1", "snapshot-s3-2"):
        with admin_snapshot_client(s3_stack, name) as sc:
            assert f"{NAMESPACE}:auto-ws-s3-slot0" in {
                i.name for i in sc.list(f"{NAMESPACE}:auto-")}


def test_s3_loss_of_one_snapshot_replica(s3_stack: Project, s3_session: Session) -> None:
    s3_stack.compose("stop", "snapshot-s3-1")
    assert s3_stack.container("snapshot-s3-1").status == "exited"
    t0 = time.monotonic()
    with client(s3_stack, "inference-s3-0") as c:
        saved = c.save(0, "after-replica-loss")
        restored = c.restore(1, "after-replica-loss")
        assert restored.n_restored == saved.n_saved and restored.draft_restored
        prompt = s3_session.history + s3_session.take(NEW)
        expected, _ = turn(c, prompt, 0)
        out, t = turn(c, prompt, 1)
        assert out == expected and t.prompt_n <= len(prompt) - saved.n_saved + 1
        s3_session.history = prompt + expected
        c.erase(1)
    assert time.monotonic() - t0 < 120
    with admin_snapshot_client(s3_stack, "snapshot-s3-2") as sc:
        assert sc.stat(f"{NAMESPACE}:after-replica-loss").target.size > 0
    # a stop saves and a start restores through the replica that is left
    _restart_and_check(s3_stack, s3_session, "after restart with one snapshot replica lost")
