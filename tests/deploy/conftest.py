"""Prints the deployment figures the tests collected (also in build/deploy-report.json)."""

from __future__ import annotations

import json

import pytest


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    from tests.deploy.test_deploy import REPORT

    if REPORT:
        terminalreporter.section("deployment figures (build/deploy-report.json)")
        terminalreporter.write_line(json.dumps(REPORT, indent=2))
