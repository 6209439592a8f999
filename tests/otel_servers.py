"""Start, wait for and stop the real telemetry servers the tests run on loopback.

Jaeger v2, the project's Collector distribution, and Prometheus 3.5.0 with
promtool (the release docker-compose.yml ships) are built from Go modules by
``.ci/otel-bins/build.sh`` (once, cached outside the repo). Every server is a
child process of the test, listens where its config (plus the ``env`` given
here) says, logs to a file, and is killed by ``Server.stop()`` (and, as a last
resort, at interpreter exit).

Configs use the Collector's ``${env:VAR:-default}`` substitution, so a test
passes ports and endpoints in ``env``; the same YAML that deploy/ ships runs
unchanged. ``OTEL_*`` variables of the test process are *not* inherited (Jaeger
traces its own query API with an OTLP exporter that reads them, which would
send Jaeger's spans into the pipeline under test); pass them in ``env`` if wanted.

API::

    jaeger_bin, otelcol_bin = otel_binaries()       # builds once per session
    prometheus_bin, promtool_bin = prometheus_binaries()
    port = free_port()
    wait_http(url, timeout=30.0)                    # -> body bytes of the first 2xx
    s = start_jaeger(config_path, env, ready_url=None, args=())
    s = start_collector(config_path, env, ready_url=None, args=())
    s = start_prometheus(config_path, tsdb_dir, port)
    s.stop(); s.log_text(); s.alive(); with s: ...
    validate_collector_config(config_path, env)     # `otelcol validate`, raises on error
    pki = make_pki(tmp_dir)                         # openssl: CA, server/client certs, wrong CA
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvobs_otel.tools.harness.server import free_port  # noqa: F401  (one port picker for tests and tools)

ROOT = Path(__file__).resolve().parent.parent
BUILD_SCRIPT = ROOT / ".ci" / "otel-bins" / "build.sh"

# Both programs are Collector builds; this line means every component started.
READY_LOG_LINE = "Everything is ready. Begin running and processing data."

_live: dict[int, Server] = {}


# -- binaries ---------------------------------------------------------------------
# build.sh prints NAME=path for each program; each can be given instead in an
# environment variable (.ci/setup-servers.sh exports all four).
BINARY_ENV = {"JAEGER": "KVOBS_JAEGER_BIN", "OTELCOL": "KVOBS_OTELCOL_BIN",
              "PROMETHEUS": "KVOBS_PROMETHEUS_BIN", "PROMTOOL": "KVOBS_PROMTOOL_BIN"}


@functools.cache
def _build_script_paths() -> dict[str, Path]:
    """Runs build.sh (a no-op once built; at most once per session) and returns
    the four paths it prints, by name (JAEGER, OTELCOL, PROMETHEUS, PROMTOOL)."""
    proc = subprocess.run(["bash", str(BUILD_SCRIPT)], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{BUILD_SCRIPT} failed (exit {proc.returncode}):\n"
                           f"{proc.stderr[-6000:]}")
    out = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)
    missing = set(BINARY_ENV) - set(out)
    if missing:
        raise RuntimeError(f"build.sh printed no {sorted(missing)}:\n{proc.stdout}")
    paths = {name: Path(out[name]) for name in BINARY_ENV}
    for p in paths.values():
        if not os.access(p, os.X_OK):
            raise RuntimeError(f"build.sh reported {p}, which is not an executable")
    return paths


def built_binary(name: str) -> Path:
    """One of the programs build.sh builds (``JAEGER``, ``OTELCOL``, ``PROMETHEUS``,
    ``PROMTOOL``): the file its environment variable (``BINARY_ENV``) names if
    that exists, else what build.sh reports (building it first if needed)."""
    pre = os.environ.get(BINARY_ENV[name])
    if pre and Path(pre).is_file():
        return Path(pre)
    return _build_script_paths()[name]


@functools.cache
def otel_binaries() -> tuple[Path, Path]:
    """(jaeger, otelcol) paths. Runs build.sh (a no-op once built) unless both
    KVOBS_JAEGER_BIN and KVOBS_OTELCOL_BIN name existing binaries."""
    return built_binary("JAEGER"), built_binary("OTELCOL")


@functools.cache
def prometheus_binaries() -> tuple[Path, Path]:
    """(prometheus, promtool) paths: Prometheus 3.5.0 built from Go modules, the
    release docker-compose.yml ships. Runs build.sh unless both
    KVOBS_PROMETHEUS_BIN and KVOBS_PROMTOOL_BIN name existing binaries."""
    return built_binary("PROMETHEUS"), built_binary("PROMTOOL")


# -- small helpers ----------------------------------------------------------------
def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    """(status, body); HTTP error statuses are returned, not raised."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def poll(fn, timeout: float = 30.0, interval: float = 0.3):
    """Call ``fn`` until it returns something truthy or ``timeout`` passes;
    its last value (the caller asserts on it)."""
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def wait_for(fn, what, timeout: float = 30.0, interval: float = 0.3):
    """``poll``, failing the test when ``fn`` never becomes truthy: a wait
    whose condition never comes is a failure, not a silent pass. ``what``
    names it: a string, or a callable giving one (with the figures then)."""
    value = poll(fn, timeout, interval)
    assert value, f"timed out after {timeout:g} s waiting for {what() if callable(what) else what}"
    return value


def get_json(url: str) -> dict:
    status, body = http_get(url, timeout=10)
    assert status == 200, (url, status, body[:300])
    return json.loads(body)


def wait_http(url: str, timeout: float = 30.0, *, server: Server | None = None,
              interval: float = 0.2) -> bytes:
    """Poll ``url`` until it answers 2xx; return the body. Raises TimeoutError
    (with the server's log tail if given) or RuntimeError if ``server`` died."""
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        if server is not None and not server.alive():
            raise RuntimeError(f"{server.name} exited with {server.proc.returncode} "
                               f"before {url} answered:\n{server.log_tail()}")
        try:
            status, body = http_get(url, timeout=min(5.0, max(0.5, timeout)))
            if 200 <= status < 300:
                return body
            last = f"HTTP {status}: {body[:200]!r}"
        except OSError as e:  # refused, reset, timeout
            last = e
        if time.monotonic() > deadline:
            tail = f"\n{server.log_tail()}" if server is not None else ""
            raise TimeoutError(f"{url} not ready after {timeout}s (last: {last}){tail}")
        time.sleep(interval)


def child_env(env: Mapping[str, str] | None) -> dict[str, str]:
    """os.environ without OTEL_* (see the module doc), plus ``env``."""
    out = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out.update({k: str(v) for k, v in (env or {}).items()})
    return out


# -- processes --------------------------------------------------------------------
class Server:
    """A child process with its log file. ``stop()`` is idempotent."""

    def __init__(self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None,
                 log_dir: Path | None = None) -> None:
        self.name = name
        self.argv = [str(a) for a in argv]
        log_dir = Path(log_dir or tempfile.mkdtemp(prefix=f"kvobs-{name}-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(self.argv, env=child_env(env), stdin=subprocess.DEVNULL,
                                     stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.pid = self.proc.pid
        _live[self.pid] = self

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_text(self) -> str:
        """Everything the process wrote so far (stdout and stderr); also after stop()."""
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def wait_log(self, needle: str, timeout: float = 30.0) -> None:
        """Wait until ``needle`` appears in the log (or the process dies)."""
        deadline = time.monotonic() + timeout
        while needle not in self.log_text():
            if not self.alive():
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n"
                                   f"{self.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: {needle!r} not logged after {timeout}s:\n"
                                   f"{self.log_tail()}")
            time.sleep(0.1)

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM (graceful shutdown, flushes exporters), then SIGKILL. Returns the
        exit code. Only this process (and its own process group) is signalled."""
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        _live.pop(self.pid, None)
        if not self._log.closed:
            self._log.close()
        return self.proc.returncode

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"Server({self.name!r}, pid={self.pid}, log={str(self.log_path)!r})"


@atexit.register
def _stop_leftovers() -> None:
    for server in list(_live.values()):
        with contextlib.suppress(Exception):  # best effort at exit
            server.stop(timeout=3)


def start_process(name: str, argv: Sequence[str], env: Mapping[str, str] | None = None, *,
                  ready_url: str | None = None, ready_log: str | None = None,
                  timeout: float = 60.0, log_dir: Path | None = None) -> Server:
    """Start ``argv`` and wait for ``ready_log`` in its log and/or a 2xx from
    ``ready_url``. On failure the process is stopped and the error carries its log."""
    server = Server(name, argv, env, log_dir)
    try:
        deadline = time.monotonic() + timeout
        if ready_log:
            server.wait_log(ready_log, timeout)
        if ready_url:
            wait_http(ready_url, max(1.0, deadline - time.monotonic()), server=server)
    except BaseException:
        server.stop(timeout=3)
        raise
    return server


def _config_arg(config_path: str | os.PathLike[str]) -> str:
    return f"--config=file:{Path(config_path).resolve()}"


def start_jaeger(config_path: str | os.PathLike[str], env: Mapping[str, str] | None = None, *,
                 ready_url: str | None = None, args: Sequence[str] = (),
                 timeout: float = 60.0, log_dir: Path | None = None) -> Server:
    """Jaeger v2 with ``config_path``. Ready when it logs that every component
    started, and (if given) ``ready_url`` answers 2xx, e.g. the query API's
    ``/api/services`` or healthcheckv2's ``/status``. ``args``: extra flags such as
    ``--set=service.telemetry.metrics.level=none``."""
    jaeger, _ = otel_binaries()
    return start_process("jaeger", [jaeger, _config_arg(config_path), *args], env,
                         ready_url=ready_url, ready_log=READY_LOG_LINE,
                         timeout=timeout, log_dir=log_dir)


def start_collector(config_path: str | os.PathLike[str], env: Mapping[str, str] | None = None,
                    *, ready_url: str | None = None, args: Sequence[str] = (),
                    timeout: float = 60.0, log_dir: Path | None = None) -> Server:
    """The project's Collector (otelcol-kvobs) with ``config_path``. Ready as for
    Jaeger; ``ready_url`` is typically the health_check extension's ``/``."""
    _, otelcol = otel_binaries()
    return start_process("otelcol", [otelcol, _config_arg(config_path), *args], env,
                         ready_url=ready_url, ready_log=READY_LOG_LINE,
                         timeout=timeout, log_dir=log_dir)


def validate_collector_config(config_path: str | os.PathLike[str],
                              env: Mapping[str, str] | None = None, *,
                              binary: str = "otelcol") -> str:
    """``<binary> validate --config=...`` (binary: "otelcol" or "jaeger"); returns
    its output, raises AssertionError with the output if the config is refused."""
    jaeger, otelcol = otel_binaries()
    exe = {"otelcol": otelcol, "jaeger": jaeger}[binary]
    proc = subprocess.run([str(exe), "validate", _config_arg(config_path)],
                          env=child_env(env), capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise AssertionError(f"{binary} validate {config_path} failed:\n{out}")
    return out


def start_prometheus(config_path: str | os.PathLike[str], tsdb_dir: str | os.PathLike[str],
                     port: int, *, args: Sequence[str] = (), timeout: float = 60.0,
                     log_dir: Path | None = None,
                     binary: str | os.PathLike[str] | None = None) -> Server:
    """Prometheus (``binary``, default: the one build.sh builds, see
    ``prometheus_binaries``) on 127.0.0.1:``port`` with ``config_path`` (rule
    files resolve relative to it), storage in ``tsdb_dir``; ready on ``/-/ready``."""
    Path(tsdb_dir).mkdir(parents=True, exist_ok=True)
    if binary is None:
        binary, _ = prometheus_binaries()
    argv = [binary, f"--config.file={Path(config_path).resolve()}",
            f"--storage.tsdb.path={Path(tsdb_dir).resolve()}",
            f"--web.listen-address=127.0.0.1:{port}", *args]
    return start_process("prometheus", argv, None,
                         ready_url=f"http://127.0.0.1:{port}/-/ready",
                         timeout=timeout, log_dir=log_dir)


# -- TLS material (made with the openssl CLI at test time) -------------------------
# Everything is generated into a directory the test owns (a pytest tmp dir): no
# key is ever stored in the repository. Keys are EC P-256 (fast to make),
# certificates are valid for two days.
_PKI_CNF = """\
[req]
distinguished_name = dn
prompt = no
[dn]
CN = unused
[ca_ext]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
[server_ext]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = serverAuth
subjectAltName = IP:127.0.0.1, DNS:localhost
authorityKeyIdentifier = keyid
subjectKeyIdentifier = hash
[client_ext]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = clientAuth
authorityKeyIdentifier = keyid
subjectKeyIdentifier = hash
"""


@dataclass(frozen=True)
class Pki:
    ca: Path                   # the CA the Collector and the exporters trust
    server_cert: Path          # for 127.0.0.1 and localhost (SAN), signed by ``ca``
    server_key: Path
    client_cert: Path          # clientAuth, signed by ``ca``
    client_key: Path
    wrong_ca: Path             # an unrelated CA
    wrong_client_cert: Path    # clientAuth, signed by ``wrong_ca``
    wrong_client_key: Path


def _openssl(*args: str | Path, cwd: Path) -> None:
    proc = subprocess.run(["openssl", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=60, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(map(str, args))} failed:\n{proc.stderr}")


def _pki_ca(d: Path, name: str, cnf: Path) -> tuple[Path, Path]:
    cert, key = d / f"{name}.pem", d / f"{name}.key"
    _openssl("req", "-x509", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
             "-nodes", "-keyout", key, "-out", cert, "-days", "2", "-sha256",
             "-subj", f"/CN=kvobs-otel test {name}", "-config", cnf, "-extensions", "ca_ext",
             cwd=d)
    return cert, key


def _pki_leaf(d: Path, name: str, cn: str, ext: str, ca: tuple[Path, Path],
              cnf: Path) -> tuple[Path, Path]:
    cert, key, csr = d / f"{name}.pem", d / f"{name}.key", d / f"{name}.csr"
    _openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
             "-keyout", key, "-out", csr, "-subj", f"/CN={cn}", "-config", cnf, cwd=d)
    _openssl("x509", "-req", "-in", csr, "-CA", ca[0], "-CAkey", ca[1], "-set_serial",
             str(secrets.randbits(63) | 1), "-days", "2", "-sha256",
             "-extfile", cnf, "-extensions", ext, "-out", cert, cwd=d)
    csr.unlink()
    return cert, key


def make_pki(directory: str | Path) -> Pki:
    """A CA, a server and a client certificate it signed, and an unrelated CA with
    a client certificate of its own, all as PEM files in ``directory``."""
    # The TLS tests need the openssl CLI: its absence is an error, not a skip.
    assert shutil.which("openssl"), "the openssl CLI is not installed (apt-get install openssl)"
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    cnf = d / "openssl.cnf"
    cnf.write_text(_PKI_CNF)
    ca = _pki_ca(d, "ca", cnf)
    server = _pki_leaf(d, "server", "127.0.0.1", "server_ext", ca, cnf)
    client = _pki_leaf(d, "client", "kvobs-otel client", "client_ext", ca, cnf)
    wrong = _pki_ca(d, "wrong-ca", cnf)
    wrong_client = _pki_leaf(d, "wrong-client", "kvobs-otel client", "client_ext", wrong, cnf)
    for key in d.glob("*.key"):
        key.chmod(0o600)
    return Pki(ca=ca[0], server_cert=server[0], server_key=server[1], client_cert=client[0],
               client_key=client[1], wrong_ca=wrong[0], wrong_client_cert=wrong_client[0],
               wrong_client_key=wrong_client[1])
