"""A pytest plugin loaded into runs of vLLM's own tests by
tests/test_vllm_own_tests.py (``-p kvobs_suite_plugin``).

- ``KVOBS_SUITE_ON=1``: kvobs-otel is instrumented (as vLLM's plugin loader
  would, with the process's OTEL_*/KVOBS_OTEL_* settings) before any test
  builds a connector; the run fails at once if it did not take.
- Every test gets ``KVOBS_SUITE_TEST_TIMEOUT_S`` (SIGALRM, the main thread):
  a test that hangs costs that test, alike in the stock and the observed run,
  not the whole run.
"""

from __future__ import annotations

import os
import signal

import pytest

LIMIT_S = float(os.environ.get("KVOBS_SUITE_TEST_TIMEOUT_S", "120"))


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("KVOBS_SUITE_ON") == "1":
        import kvobs_otel

        if not kvobs_otel.instrument(default_enabled=True):
            raise pytest.UsageError("kvobs-otel did not instrument vLLM (see the log above)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    def expired(signum: int, frame: object) -> None:
        raise TimeoutError(f"{item.nodeid}: still running after {LIMIT_S:g} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, LIMIT_S)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
