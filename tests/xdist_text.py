"""A pytest plugin of the suite's (``tests/conftest.py`` loads it): what an xdist
worker sends of a test's report is text that UTF-8 can carry.

execnet encodes every string it sends as strict UTF-8. A failure whose message or
captured output holds a lone surrogate (Hypothesis makes such text, and a command
line echoes arguments a shell passed from undecodable bytes as such) could not be
sent: the worker died with ``INTERNALERROR``, the run ended with exit status 3, and
the tests still queued on that worker never ran. Such text is escaped
(``backslashreplace``) before it leaves the worker; any other report is untouched."""

from __future__ import annotations

import os
from collections.abc import Generator
from typing import Any

import pytest

__all__ = ["sendable"]


def sendable(text: str) -> str:
    """``text``, with what strict UTF-8 cannot encode escaped."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Any, None]:
    outcome = yield
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return  # one process: nothing is sent
    report: pytest.TestReport = outcome.get_result()
    report.sections = [(title, sendable(body)) for title, body in report.sections]
    if report.longrepr is not None and not isinstance(report.longrepr, tuple):
        text = str(report.longrepr)
        if sendable(text) != text:
            report.longrepr = sendable(text)  # the failure as text, as xdist shows it
