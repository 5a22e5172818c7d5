"""The deployment tests' gate on the image's features, without docker: an image whose
inference service lacks restart-resume is stale and fails the session checks (a skip
would let them pass without testing anything); an image of this source passes it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.deploy.test_deploy import ROOT, require_resume


def help_flags() -> set[str]:
    out = subprocess.run([sys.executable, "-m", "inference_svc", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return {w.strip(",[]") for w in out.split() if w.startswith("--")}  # as `features` does


def test_an_image_without_restart_resume_fails_the_session_checks() -> None:
    flags = help_flags()
    require_resume(flags)  # this source's flags: the checks run
    for missing in ("--instance-id", "--snapshot-addr"):
        try:
            require_resume(flags - {missing})
        except pytest.skip.Exception as exc:  # not a subclass of the failure: caught first
            pytest.fail(f"a stale image skips the session checks instead of failing: {exc}")
        except pytest.fail.Exception as exc:
            assert f"is stale: its inference service has no {missing}" in str(exc)
        else:
            pytest.fail(f"an image without {missing} passes the gate")
