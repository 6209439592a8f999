"""A pytest plugin loaded into runs of vLLM's own tests by
tests/test_vllm_own_tests.py (``-p kvobs_suite_plugin``).

- ``KVOBS_SUITE_ON=1``: kvobs-otel is instrumented (as vLLM's plugin loader
  would, with the process's OTEL_*/KVOBS_OTEL_* settings) before any test
  builds a connector; the run fails at once if it did not take.
- Both runs get the same stand-in for a GPU platform where vLLM resolves
  none (``_gpu_platform_standin``).
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
    _gpu_platform_standin()
    if os.environ.get("KVOBS_SUITE_ON") == "1":
        import kvobs_otel

        if not kvobs_otel.instrument(default_enabled=True):
            raise pytest.UsageError("kvobs-otel did not instrument vLLM (see the log above)")


def pytest_unconfigure(config: pytest.Config) -> None:
    """With ``KVOBS_SUITE_REPORT``: what kvobs-otel counted (its internal
    errors and drops, by stage), as JSON, for the test that ran us."""
    report = os.environ.get("KVOBS_SUITE_REPORT")
    if os.environ.get("KVOBS_SUITE_ON") != "1" or not report:
        return
    import json

    from kvobs_otel.pipeline import current_pipeline

    p = current_pipeline()
    if p is not None:
        p.flush()
    with open(report, "w") as f:
        json.dump({"errors": p.error_counts() if p else None,
                   "drops": p.drop_counts() if p else None}, f)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    def expired(signum: int, frame: object) -> None:
        # pytest.fail raises a BaseException: a test's retry loop that
        # catches Exception does not swallow it (and the timer repeats).
        pytest.fail(f"{item.nodeid}: still running after {LIMIT_S:g} s", pytrace=False)

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, LIMIT_S, 5.0)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _gpu_platform_standin() -> None:
    """Stand-in for the GPU platform these tests are written for (vLLM's
    CI runs them on GPU machines). vLLM's CUDA wheels on a machine without a
    GPU resolve to UnspecifiedPlatform (vllm/platforms/interface.py), which
    says it cannot run the hybrid KV cache manager (support_hybrid_kv_cache)
    and names no device (device_type ""): the tests that build a VllmConfig
    then fail before reaching the connector. They only build scheduler-side
    objects and CPU tensors, so both runs (stock and observed) get a platform
    that says yes and names the CPU. Where vLLM resolves a real platform (the
    CPU build: CpuPlatform) nothing changes."""
    from vllm.platforms import current_platform
    from vllm.platforms.interface import UnspecifiedPlatform

    if type(current_platform) is UnspecifiedPlatform:
        UnspecifiedPlatform.support_hybrid_kv_cache = classmethod(lambda cls: True)
        UnspecifiedPlatform.device_type = "cpu"
