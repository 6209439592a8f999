"""Static checks of the local observability stack (docker-compose.yml, deploy/, dashboards/).

No container runs here (test machines have no Docker engine): the files are
parsed and cross-checked against each other, so that a renamed service, a
moved port or a missing mount is caught before anyone runs `docker compose up`.
What the running stack does is the end-to-end test's business.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = ROOT / "docker-compose.yml"
DEPLOY = ROOT / "deploy"
COLLECTOR_FILE = DEPLOY / "otel-collector.yaml"
PROMETHEUS_FILE = DEPLOY / "prometheus.yml"
JAEGER_FILE = DEPLOY / "jaeger.yaml"
# The multi-machine shape of deploy/README.md (run by tests/test_topology.py).
AGENT_FILE = DEPLOY / "otel-agent.yaml"
JAEGER_BADGER_FILE = DEPLOY / "jaeger-badger.yaml"
TEMPO_FILE = DEPLOY / "tempo.yaml"
GRAFANA_PROVISIONING = DEPLOY / "grafana" / "provisioning"
DATASOURCES_FILE = GRAFANA_PROVISIONING / "datasources" / "datasources.yaml"
DASHBOARD_PROVIDERS_FILE = GRAFANA_PROVISIONING / "dashboards" / "dashboards.yaml"
DASHBOARDS_DIR = ROOT / "dashboards"
DASHBOARD_FILES = sorted(DASHBOARDS_DIR.glob("*.json"))
OTEL_BINS = ROOT / ".ci" / "otel-bins"
BUILD_SCRIPT = OTEL_BINS / "build.sh"

SERVICES = ("otel-collector", "jaeger", "tempo", "prometheus", "grafana")
IMAGES = {
    "otel-collector": "otel/opentelemetry-collector-contrib",
    "jaeger": "jaegertracing/jaeger",
    "tempo": "grafana/tempo",
    "prometheus": "prom/prometheus",
    "grafana": "grafana/grafana",
}
# Host files and folders compose mounts: exactly these (paths from the repo root).
MOUNTS = {
    "deploy/otel-collector.yaml",
    "deploy/jaeger.yaml",
    "deploy/tempo.yaml",
    "deploy/prometheus.yml",
    "deploy/alerts.yml",
    "deploy/grafana/provisioning",
    "dashboards",
}
# The Collector's ports: OTLP gRPC, OTLP HTTP, Prometheus exporter (kvobs and
# span metrics), its own metrics, health check.
COLLECTOR_PORTS = {"otlp_grpc": 4317, "otlp_http": 4318, "prometheus_exporter": 8889,
                   "telemetry": 8888, "health_check": 13133}
SCRAPE_JOBS = {"kvobs": "otel-collector:8889", "otel-collector": "otel-collector:8888"}
DATASOURCE_UIDS = {"prometheus", "jaeger", "tempo"}
ALLOWED_EXPR_VARS = {"$__rate_interval", "$__interval", "$__range"}
METRIC_PREFIXES = ("kvobs_", "traces_span_metrics_", "otelcol_")
LOOPBACK = {"localhost", "127.0.0.1", "::1", "[::1]"}


# --------------------------------------------------------------------------- helpers


def load_yaml(path: Path) -> dict:
    with path.open(encoding="utf-8") as f:
        data = yaml.safe_load(f)
    assert isinstance(data, dict), f"{path.relative_to(ROOT)}: not a YAML mapping"
    return data


_ENV_REF = re.compile(r"\$\{(?:env:)?([A-Za-z_][A-Za-z0-9_]*)(:-([^}]*))?\}")


def resolve(value: object, env: dict[str, str] | None = None) -> str:
    """Expand ``${env:NAME:-default}`` / ``${NAME:-default}`` the way the
    Collector (and Jaeger) would when started with ``env`` as its environment."""
    env = env or {}

    def sub(m: re.Match) -> str:
        name, has_default, default = m.group(1), m.group(2), m.group(3)
        if name in env:
            return env[name]
        if has_default is None:
            raise AssertionError(f"{m.group(0)} has no default and compose does not set {name}")
        return default

    return _ENV_REF.sub(sub, str(value))


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``host:port`` (host may be empty or bracketed IPv6) -> (host, port)."""
    if "://" in endpoint:
        u = urlsplit(endpoint)
        assert u.hostname and u.port, f"{endpoint!r}: no host:port"
        return u.hostname, u.port
    host, sep, port = endpoint.rpartition(":")
    assert sep and port.isdigit(), f"{endpoint!r} is not host:port"
    return host, int(port)


def service_env(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {str(k): str(v) for k, v in env.items()}


def published_ports(service: dict) -> dict[int, int | None]:
    """container port -> host port (None: not published to a fixed host port)."""
    out: dict[int, int | None] = {}
    for entry in service.get("ports") or []:
        if isinstance(entry, dict):
            out[int(entry["target"])] = int(entry["published"]) if entry.get("published") else None
            continue
        parts = str(entry).split("/")[0].split(":")
        container = int(parts[-1])
        out[container] = int(parts[-2]) if len(parts) >= 2 and parts[-2] else None
    return out


def exposed_ports(service: dict) -> set[int]:
    return {int(str(p).split("/")[0]) for p in service.get("expose") or []}


def bind_mounts(service: dict) -> Iterator[tuple[str, str]]:
    """(host source, container target) of every bind mount; named volumes skipped."""
    for entry in service.get("volumes") or []:
        if isinstance(entry, dict):
            if entry.get("type") == "bind":
                yield str(entry["source"]), str(entry["target"])
            continue
        parts = str(entry).split(":")
        source, target = parts[0], parts[1] if len(parts) > 1 else parts[0]
        if source.startswith((".", "/", "~")):
            yield source, target


def repo_path(source: str) -> str:
    assert source.startswith("./"), f"mount {source!r}: use a path relative to the repo (./...)"
    return str(Path(source[2:]))


def collector_ports(config: dict, env: dict[str, str]) -> dict[str, tuple[str, int]]:
    """Where the Collector config listens: name -> (host, port)."""
    out: dict[str, tuple[str, int]] = {}
    for name, receiver in (config.get("receivers") or {}).items():
        if name.split("/")[0] != "otlp":
            continue
        protocols = (receiver or {}).get("protocols") or {}
        for proto in ("grpc", "http"):
            if proto in protocols:
                endpoint = (protocols[proto] or {}).get("endpoint")
                assert endpoint, f"receivers.{name}.protocols.{proto}: set endpoint explicitly"
                out.setdefault(f"otlp_{proto}", split_endpoint(resolve(endpoint, env)))
    for name, exporter in (config.get("exporters") or {}).items():
        if name.split("/")[0] == "prometheus":
            out.setdefault("prometheus_exporter",
                           split_endpoint(resolve(exporter["endpoint"], env)))
    for name, ext in (config.get("extensions") or {}).items():
        if name.split("/")[0] == "health_check":
            out.setdefault("health_check", split_endpoint(resolve(ext["endpoint"], env)))
    metrics = ((config.get("service") or {}).get("telemetry") or {}).get("metrics") or {}
    if "address" in metrics:  # the older form
        out["telemetry"] = split_endpoint(resolve(metrics["address"], env))
    for reader in metrics.get("readers") or []:
        prom = ((reader.get("pull") or {}).get("exporter") or {}).get("prometheus")
        if prom:
            out["telemetry"] = (resolve(prom.get("host", ""), env),
                                int(resolve(prom["port"], env)))
    return out


def otlp_receiver_ports(config: dict, env: dict[str, str]) -> dict[str, tuple[str, int]]:
    """OTLP receiver endpoints of a Collector-shaped config (Jaeger v2, the Collector)."""
    otlp = (config.get("receivers") or {}).get("otlp") or {}
    return {proto: split_endpoint(resolve(body["endpoint"], env))
            for proto, body in (otlp.get("protocols") or {}).items() if body}


# --------------------------------------------------------------------------- PromQL checks


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_DURATION = r"(?:\d+(?:ms|[smhdwy]))+|\$__rate_interval|\$__interval|\$__range"
_RANGE = re.compile(rf"^\s*(?:{_DURATION})\s*(?::\s*(?:{_DURATION})?\s*)?$")
_VAR = re.compile(r"\$(?:\{(\w+)(?:[:}][^}]*)?\}?|(\w+))")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^()]*)\)")
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def expr_problems(expr: str) -> list[str]:
    """Cheap PromQL sanity check, no parser: balanced brackets outside string
    literals, only Grafana's interval variables, range selectors holding a
    duration, label lists of plain identifiers, ``le`` kept under
    histogram_quantile. Empty list = fine."""
    problems: list[str] = []
    if not expr or not expr.strip():
        return ["empty expr"]
    # Balance, skipping string literals.
    stack: list[tuple[str, int]] = []
    pairs = {")": "(", "]": "[", "}": "{"}
    quote: str | None = None
    i = 0
    while i < len(expr):
        c = expr[i]
        if quote:
            if c == "\\" and quote != "`":
                i += 2
                continue
            if c == quote:
                quote = None
        elif c in "\"'`":
            quote = c
        elif c in "([{":
            stack.append((c, i))
        elif c in ")]}":
            if not stack or stack[-1][0] != pairs[c]:
                problems.append(f"unmatched {c!r} at offset {i}")
            else:
                stack.pop()
        i += 1
    if quote:
        problems.append("unterminated string literal")
    problems += [f"unclosed {c!r} at offset {pos}" for c, pos in stack]
    bare = _STRING.sub('""', expr)
    # Variables: only those the dashboards' query runner fills in (Grafana
    # would expand others inside label values too, so strings count).
    for m in _VAR.finditer(expr):
        name = "$" + (m.group(1) or m.group(2))
        if name not in ALLOWED_EXPR_VARS:
            problems.append(f"variable {m.group(0)!r} (only {sorted(ALLOWED_EXPR_VARS)})")
    # Range selectors / subqueries.
    for m in re.finditer(r"\[([^\[\]]*)\]", bare):
        if not _RANGE.match(m.group(1)):
            problems.append(f"range selector [{m.group(1)}] is not a duration")
    # Label lists.
    for m in _GROUPING.finditer(bare):
        labels = [x.strip() for x in m.group(1).split(",") if x.strip()]
        bad = [x for x in labels if not _IDENT.match(x)]
        if bad:
            problems.append(f"bad label name(s) {bad} in {m.group(0)!r}")
    if "histogram_quantile" in bare:
        if "_bucket" not in bare:
            problems.append("histogram_quantile over something that is not a _bucket series")
        for m in re.finditer(r"\b(?:by)\s*\(([^()]*)\)", bare):
            if "le" not in [x.strip() for x in m.group(1).split(",")]:
                problems.append(f"{m.group(0)!r} drops the le label histogram_quantile needs")
    return problems


_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool",
             "and", "or", "unless", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """Identifiers that are metric names (not functions, labels or keywords)."""
    bare = _STRING.sub('""', expr)
    bare = _GROUPING.sub(" ", bare)
    bare = re.sub(r"\{[^{}]*\}", " ", bare)
    bare = re.sub(r"\[[^\[\]]*\]", " ", bare)
    names = set()
    for m in re.finditer(r"(?<![\w.$])([A-Za-z_:][A-Za-z0-9_:]*)\b(?!\s*\()", bare):
        if m.group(1).lower() not in _KEYWORDS:
            names.add(m.group(1))
    return names


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def compose() -> dict:
    return load_yaml(COMPOSE_FILE)


@pytest.fixture(scope="module")
def services(compose: dict) -> dict[str, dict]:
    return compose["services"]


@pytest.fixture(scope="module")
def collector_config() -> dict:
    return load_yaml(COLLECTOR_FILE)


@pytest.fixture(scope="module")
def prometheus_config() -> dict:
    return load_yaml(PROMETHEUS_FILE)


def listening_ports(name: str, services: dict[str, dict]) -> set[int]:
    """Ports a compose service listens on inside the compose network."""
    svc = services[name]
    ports = set(published_ports(svc)) | exposed_ports(svc)
    if name == "otel-collector" and COLLECTOR_FILE.exists():
        env = service_env(svc)
        ports |= {p for _, p in collector_ports(load_yaml(COLLECTOR_FILE), env).values()}
    if name == "jaeger" and JAEGER_FILE.exists():
        ports |= {p for _, p in otlp_receiver_ports(load_yaml(JAEGER_FILE),
                                                    service_env(svc)).values()}
    if name == "tempo":
        tempo = load_yaml(TEMPO_FILE)
        ports.add(int(tempo["server"]["http_listen_port"]))
        ports |= {p for _, p in otlp_receiver_ports(tempo["distributor"], {}).values()}
    return ports


def iter_dashboard_panels(dashboard: dict) -> Iterator[dict]:
    for panel in dashboard.get("panels") or []:
        yield panel
        yield from iter_dashboard_panels(panel)  # collapsed rows hold their panels


def iter_dashboard_targets() -> Iterator[tuple[str, dict, dict]]:
    """(file name, panel, target) of every panel query in dashboards/*.json."""
    for path in DASHBOARD_FILES:
        dashboard = json.loads(path.read_text(encoding="utf-8"))
        for panel in iter_dashboard_panels(dashboard):
            for target in panel.get("targets") or []:
                yield path.name, panel, target


# --------------------------------------------------------------------------- compose


def test_compose_parses_and_defines_the_stack(services: dict[str, dict]) -> None:
    missing = [s for s in SERVICES if s not in services]
    assert not missing, f"docker-compose.yml lacks services {missing}"


def test_compose_header_tells_how_to_send_and_where_to_look() -> None:
    header = "".join(
        line for line in COMPOSE_FILE.read_text(encoding="utf-8").splitlines(keepends=True)
        if line.startswith("#"))
    for needle in ("KVOBS_OTEL_ENABLED=1", "OTEL_EXPORTER_OTLP_ENDPOINT=http://localhost:4318",
                   "OTEL_EXPORTER_OTLP_ENDPOINT=http://localhost:4317", "grpc",
                   "localhost:16686", "localhost:3000", "localhost:9090", "localhost:3200"):
        assert needle in header, f"docker-compose.yml header comment should mention {needle}"


@pytest.mark.parametrize("name", SERVICES)
def test_image_is_pinned(services: dict[str, dict], name: str) -> None:
    image = services[name].get("image", "")
    repo, _, digest = image.partition("@")
    last = repo.rsplit("/", 1)[-1]
    tag = last.split(":", 1)[1] if ":" in last else ""
    assert tag or digest, f"{name}: image {image!r} has no tag"
    assert tag != "latest" and "latest" not in tag, f"{name}: pin a version, not {tag!r}"
    assert re.search(r"\d+\.\d+", tag or digest), f"{name}: tag {tag!r} is not a version"
    assert repo.rsplit(":", 1)[0].removeprefix("docker.io/") == IMAGES[name], (
        f"{name}: expected image {IMAGES[name]}, got {image}")
    if name == "jaeger":
        assert tag.startswith("2."), "Jaeger must be v2 (it reads deploy/jaeger.yaml)"


def image_tag(services: dict[str, dict], name: str) -> str:
    image = services[name]["image"]
    last = image.partition("@")[0].rsplit("/", 1)[-1]
    return last.split(":", 1)[1] if ":" in last else ""


def build_script_setting(name: str) -> str:
    """``NAME="value"`` from .ci/otel-bins/build.sh."""
    found = re.findall(rf'^{name}="([^"]*)"', BUILD_SCRIPT.read_text(), re.M)
    assert len(found) == 1, f"build.sh should set {name} once: {found}"
    return found[0]


def go_mod_version(module_dir: Path, module: str) -> str:
    found = re.findall(rf"^\s*{re.escape(module)} (v\S+)", (module_dir / "go.mod").read_text(),
                       re.M)
    assert len(found) == 1, f"{module_dir.name}/go.mod should require {module} once: {found}"
    return found[0]


def test_tests_build_the_prometheus_release_compose_ships(services: dict[str, dict]) -> None:
    """The end-to-end and alert tests run Prometheus/promtool built from Go
    modules (.ci/otel-bins/build.sh): the release docker-compose.yml ships.
    (test_otel_bins_smoke.py checks the built binaries themselves.)"""
    tag = image_tag(services, "prometheus")
    assert re.fullmatch(r"v3\.\d+\.\d+", tag), f"prom/prometheus:{tag}: expected v3.x.y"
    release = tag.removeprefix("v")
    assert build_script_setting("PROMETHEUS_RELEASE") == release
    # Prometheus 3.x's Go module is tagged v0.3<minor, 2 digits>.<patch>
    # (release 3.5.0 is module version v0.305.0).
    major, minor, patch = (int(x) for x in release.split("."))
    module_version = f"v0.{major}{minor:02d}.{patch}"
    assert build_script_setting("PROMETHEUS_VERSION") == module_version
    assert go_mod_version(OTEL_BINS / "prometheus",
                          "github.com/prometheus/prometheus") == module_version


def test_tests_build_the_collector_release_compose_ships(services: dict[str, dict]) -> None:
    tag = image_tag(services, "otel-collector")
    assert build_script_setting("OTELCOL_RELEASE") == f"v{tag}"
    for module in ("go.opentelemetry.io/collector/otelcol",
                   "github.com/open-telemetry/opentelemetry-collector-contrib/"
                   "exporter/prometheusexporter"):
        assert go_mod_version(OTEL_BINS / "otelcol", module) == f"v{tag}", module


def test_tests_build_the_jaeger_release_compose_ships(services: dict[str, dict]) -> None:
    """Jaeger tags each release twice (v1.x module, v2.y program): build.sh
    names both, and compose ships the v2 release of the module it builds."""
    assert image_tag(services, "jaeger") == build_script_setting("JAEGER_RELEASE")
    assert go_mod_version(OTEL_BINS / "jaeger", "github.com/jaegertracing/jaeger") == (
        build_script_setting("JAEGER_VERSION"))


def test_every_mounted_host_path_exists(services: dict[str, dict]) -> None:
    for name, svc in services.items():
        for source, _ in bind_mounts(svc):
            path = ROOT / repo_path(source)
            assert path.exists(), f"{name} mounts {source}, which is not in the repo"


def test_mounts_are_exactly_the_stack_files(services: dict[str, dict]) -> None:
    mounted = {repo_path(src) for svc in services.values() for src, _ in bind_mounts(svc)}
    assert mounted == MOUNTS, (
        f"unexpected mounts {sorted(mounted - MOUNTS)}, missing {sorted(MOUNTS - mounted)}")


def test_mount_targets_match_commands(services: dict[str, dict]) -> None:
    def target(name: str, source: str) -> str:
        found = [t for s, t in bind_mounts(services[name]) if repo_path(s) == source]
        assert found, f"{name} does not mount {source}"
        return found[0]

    collector_cfg = target("otel-collector", "deploy/otel-collector.yaml")
    assert collector_cfg == "/etc/otelcol-contrib/config.yaml"
    command = " ".join(map(str, services["otel-collector"].get("command") or []))
    assert not command or collector_cfg in command, "collector --config names another file"

    jaeger_cfg = target("jaeger", "deploy/jaeger.yaml")
    command = " ".join(map(str, services["jaeger"].get("command") or []))
    assert re.search(rf"--config[ =](file:)?{re.escape(jaeger_cfg)}\b", command), (
        f"jaeger command {command!r} must be --config {jaeger_cfg}")

    tempo_cfg = target("tempo", "deploy/tempo.yaml")
    command = " ".join(map(str, services["tempo"].get("command") or []))
    assert f"-config.file={tempo_cfg}" in command

    prom_cfg = target("prometheus", "deploy/prometheus.yml")
    alerts = target("prometheus", "deploy/alerts.yml")
    assert prom_cfg.startswith("/etc/prometheus/") and alerts.startswith("/etc/prometheus/")
    command = services["prometheus"].get("command") or []
    assert f"--config.file={prom_cfg}" in command

    assert target("grafana", "deploy/grafana/provisioning") == "/etc/grafana/provisioning"
    assert target("grafana", "dashboards") == "/var/lib/grafana/dashboards"


def test_otlp_of_jaeger_and_tempo_is_not_published(services: dict[str, dict]) -> None:
    """Host 4317/4318 belong to the Collector; the backends get OTLP from it."""
    collector_host = {h for h in published_ports(services["otel-collector"]).values() if h}
    for name, svc in services.items():
        if name == "otel-collector":
            continue
        clash = collector_host & {h for h in published_ports(svc).values() if h}
        assert not clash, f"{name} publishes host port(s) {clash} the Collector uses"


# --------------------------------------------------------------------------- Collector


def test_collector_ports_match_compose(collector_config: dict,
                                       services: dict[str, dict]) -> None:
    svc = services["otel-collector"]
    listening = collector_ports(collector_config, service_env(svc))
    got = {k: port for k, (_, port) in listening.items()}
    assert got == COLLECTOR_PORTS, f"collector config listens on {got}"
    published = published_ports(svc)
    for what, port in COLLECTOR_PORTS.items():
        assert published.get(port) == port, (
            f"compose must publish the collector's {what} port {port} as {port}:{port}")
    for what, (host, port) in listening.items():
        assert host not in LOOPBACK, (
            f"collector {what} listens on {host}:{port}: unreachable from other containers")


def test_collector_exporters_name_compose_services(collector_config: dict,
                                                   services: dict[str, dict]) -> None:
    exporters = collector_config.get("exporters") or {}
    raw = {name: str(body.get("endpoint", "")) for name, body in exporters.items()
           if name.split("/")[0] in ("otlp", "otlp_grpc", "otlphttp", "otlp_http")}
    assert raw, "the collector exports traces nowhere"
    text = " ".join(raw.values())
    assert "${env:KVOBS_JAEGER_OTLP_ENDPOINT:-jaeger:4317}" in text
    assert "${env:KVOBS_TEMPO_OTLP_ENDPOINT:-tempo:4317}" in text
    env = service_env(services["otel-collector"])
    for name, endpoint in raw.items():
        host, port = split_endpoint(resolve(endpoint, env))
        assert host in services, f"exporter {name} sends to {host}, not a compose service"
        assert port in listening_ports(host, services), (
            f"exporter {name} sends to {host}:{port}; {host} does not listen there")


def test_collector_env_without_default_is_set_by_compose(collector_config: dict,
                                                         services: dict[str, dict]) -> None:
    resolve(json.dumps(collector_config), service_env(services["otel-collector"]))


# --------------------------------------------------------------------------- Prometheus


def test_prometheus_scrapes_the_collector(prometheus_config: dict,
                                          services: dict[str, dict]) -> None:
    jobs: dict[str, list[str]] = {}
    for job in prometheus_config.get("scrape_configs") or []:
        targets = [t for sc in job.get("static_configs") or [] for t in sc.get("targets") or []]
        jobs[job["job_name"]] = targets
    for job, target in SCRAPE_JOBS.items():
        assert target in jobs.get(job, []), f"scrape job {job!r} should target {target}"
    for job, targets in jobs.items():
        for target in targets:
            host, port = split_endpoint(target)
            assert host in services, f"job {job}: {target} is not a compose service"
            assert port in listening_ports(host, services), (
                f"job {job}: {host} does not listen on {port}")


def test_prometheus_rule_files_are_mounted(prometheus_config: dict,
                                           services: dict[str, dict]) -> None:
    mounted = {t for _, t in bind_mounts(services["prometheus"])}
    rule_files = prometheus_config.get("rule_files") or []
    assert rule_files, "prometheus.yml loads no alert rules"
    for rule_file in rule_files:
        path = rule_file if rule_file.startswith("/") else f"/etc/prometheus/{rule_file}"
        assert path in mounted, f"rule file {rule_file} is not mounted ({sorted(mounted)})"


# --------------------------------------------------------------------------- Jaeger, Tempo


def test_jaeger_listens_where_compose_expects(services: dict[str, dict]) -> None:
    config = load_yaml(JAEGER_FILE)
    env = service_env(services["jaeger"])
    otlp = otlp_receiver_ports(config, env)
    assert otlp.get("grpc", ("", 0))[1] == 4317, f"jaeger OTLP gRPC: {otlp}"
    for proto, (host, _) in otlp.items():
        assert host not in LOOPBACK, f"jaeger OTLP {proto} on {host}: unreachable"
    query = ((config.get("extensions") or {}).get("jaeger_query") or {}).get("http") or {}
    endpoint = query.get("endpoint")
    if endpoint:  # unset: Jaeger's default, 16686 on every interface
        host, port = split_endpoint(resolve(endpoint, env))
        assert port == 16686 and host not in LOOPBACK
    assert published_ports(services["jaeger"]).get(16686) == 16686


def test_agent_sends_each_trace_whole_to_one_gateway() -> None:
    """deploy/otel-agent.yaml: traces leave only through the load-balancing
    exporter, by trace id, to gateways at the gateway's OTLP gRPC port; no
    tail sampling or span metrics on an agent (it sees part of a trace)."""
    agent = load_yaml(AGENT_FILE)
    lb = agent["exporters"]["load_balancing"]
    assert lb["routing_key"] == "traceID"
    assert "endpoint" not in lb["protocol"]["otlp"], "the resolver provides the endpoint"
    pipelines = agent["service"]["pipelines"]
    assert pipelines["traces"]["exporters"] == ["load_balancing"]
    assert "load_balancing" not in pipelines["metrics"]["exporters"]
    assert not agent.get("connectors"), "no span metrics before load balancing"
    assert not {p.split("/")[0] for p in agent.get("processors") or {}} & {"tail_sampling"}
    gateway_grpc = collector_ports(load_yaml(COLLECTOR_FILE), {})["otlp_grpc"][1]
    hostnames = yaml.safe_load(resolve(lb["resolver"]["static"]["hostnames"]))
    assert isinstance(hostnames, list) and len(hostnames) >= 2, hostnames
    assert {split_endpoint(h)[1] for h in hostnames} == {gateway_grpc}, hostnames
    # Every port set explicitly (the agent shares a node with nothing else of
    # ours, but its telemetry port must not be left to a default).
    assert set(collector_ports(agent, {})) == set(COLLECTOR_PORTS)


def test_badger_jaeger_listens_as_the_in_memory_one_and_keeps_its_data() -> None:
    """deploy/jaeger-badger.yaml can replace jaeger.yaml in place (same
    ports, same pipeline), and stores on disk, in the directory its variable names."""
    badger, memory = load_yaml(JAEGER_BADGER_FILE), load_yaml(JAEGER_FILE)
    assert otlp_receiver_ports(badger, {}) == otlp_receiver_ports(memory, {})
    assert badger["service"] == memory["service"]
    assert badger["extensions"]["jaeger_query"] == memory["extensions"]["jaeger_query"]
    (store,) = badger["extensions"]["jaeger_storage"]["backends"].values()
    assert store["badger"]["ephemeral"] is False
    dirs = store["badger"]["directories"]
    assert {resolve(d, {"JAEGER_BADGER_DIR": "/x"}) for d in dirs.values()} == {"/x/keys",
                                                                                "/x/values"}


def test_tempo_config() -> None:
    tempo = load_yaml(TEMPO_FILE)
    otlp = otlp_receiver_ports(tempo["distributor"], {})
    assert otlp == {"grpc": ("0.0.0.0", 4317), "http": ("0.0.0.0", 4318)}
    assert tempo["server"]["http_listen_port"] == 3200
    trace = tempo["storage"]["trace"]
    assert trace["backend"] == "local"
    for key in (("wal", "path"), ("local", "path")):
        assert str(trace[key[0]][key[1]]).startswith("/var/tempo/")
    assert "metrics_generator" not in tempo, "metrics-generator is meant to stay off here"


def test_tempo_data_is_a_volume(services: dict[str, dict]) -> None:
    volumes = [str(v) for v in services["tempo"].get("volumes") or []]
    assert any(v.split(":")[1:2] == ["/var/tempo"] for v in volumes), volumes
    assert published_ports(services["tempo"]).get(3200) == 3200


# --------------------------------------------------------------------------- Grafana


def test_grafana_datasources(services: dict[str, dict]) -> None:
    config = load_yaml(DATASOURCES_FILE)
    # Grafana expands $VARS in provisioning values: literal dollars are "$$".
    values = json.dumps(config)
    assert "$" not in values.replace("$$", ""), "write a literal $ as $$ in datasources.yaml"
    sources = {d["uid"]: d for d in config["datasources"]}
    assert set(sources) == DATASOURCE_UIDS
    expected = {"prometheus": ("prometheus", "prometheus", 9090),
                "jaeger": ("jaeger", "jaeger", 16686), "tempo": ("tempo", "tempo", 3200)}
    for uid, (kind, service, port) in expected.items():
        ds = sources[uid]
        assert ds["type"] == kind
        u = urlsplit(ds["url"])
        assert (u.hostname, u.port) == (service, port), f"{uid}: {ds['url']}"
        assert u.hostname in services and u.port in listening_ports(u.hostname, services)
    exemplars = sources["prometheus"]["jsonData"]["exemplarTraceIdDestinations"]
    assert {"name": "trace_id", "datasourceUid": "jaeger"}.items() <= exemplars[0].items()
    tempo = sources["tempo"]["jsonData"]
    assert tempo["tracesToMetrics"]["datasourceUid"] == "prometheus"
    assert tempo["serviceMap"]["datasourceUid"] == "prometheus"
    for ds in sources.values():
        for q in (ds.get("jsonData", {}).get("tracesToMetrics") or {}).get("queries") or []:
            # What Grafana sends once it filled in the span's tags and name.
            promql = q["query"].replace("$$", "$").replace("${__span.name}", "kv.job")
            promql = promql.replace("$__tags", 'service_name="kvobs-otel"')
            assert not expr_problems(promql), (q["name"], expr_problems(promql))


def test_grafana_dashboard_provider(services: dict[str, dict]) -> None:
    providers = load_yaml(DASHBOARD_PROVIDERS_FILE)["providers"]
    paths = {p["options"]["path"] for p in providers if p.get("type", "file") == "file"}
    assert paths == {"/var/lib/grafana/dashboards"}
    assert published_ports(services["grafana"]).get(3000) == 3000


# --------------------------------------------------------------------------- dashboards


def test_there_are_dashboards() -> None:
    names = {p.name for p in DASHBOARD_FILES}
    assert "kvobs-overview.json" in names, names


@pytest.mark.parametrize("path", DASHBOARD_FILES, ids=lambda p: p.name)
def test_dashboard_is_provisionable(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    dashboard = json.loads(text)
    assert "${DS" not in text and "__inputs" not in dashboard, (
        "export-for-sharing placeholders break file provisioning")
    assert dashboard.get("uid") and dashboard.get("title")
    assert dashboard.get("schemaVersion", 0) >= 36
    ids = [p.get("id") for p in iter_dashboard_panels(dashboard)]
    assert None not in ids, "every panel needs an id"
    assert len(ids) == len(set(ids)), f"duplicate panel ids in {path.name}"
    for var in (dashboard.get("templating") or {}).get("list") or []:
        query = var.get("query")
        query = query.get("query") if isinstance(query, dict) else query
        assert var.get("type") == "query" and str(query).startswith("label_values("), (
            f"variable {var.get('name')}: only label_values(...) queries are allowed")


def test_dashboard_uids_unique() -> None:
    uids = [json.loads(p.read_text(encoding="utf-8"))["uid"] for p in DASHBOARD_FILES]
    assert len(uids) == len(set(uids)), uids


def _target_ids() -> list[str]:
    return [f"{name}#{panel['id']}{target.get('refId', '')}"
            for name, panel, target in iter_dashboard_targets()]


@pytest.mark.parametrize(("name", "panel", "target"), list(iter_dashboard_targets()),
                         ids=_target_ids())
def test_dashboard_target(name: str, panel: dict, target: dict) -> None:
    where = f"{name} panel {panel['id']} {panel.get('title')!r}"
    ds = target.get("datasource") or panel.get("datasource") or {}
    uid = ds.get("uid") if isinstance(ds, dict) else ds
    assert uid in DATASOURCE_UIDS, f"{where}: datasource {ds!r} is not provisioned"
    expr = target.get("expr", "")
    assert expr.strip(), f"{where}: empty expr"
    problems = expr_problems(expr)
    assert not problems, f"{where}: {expr}\n  " + "\n  ".join(problems)
    names = metric_names(expr)
    assert names, f"{where}: no metric selector in {expr}"
    for metric in names:
        assert metric == "up" or metric.startswith(METRIC_PREFIXES), (
            f"{where}: unexpected metric {metric}")


def test_every_panel_with_queries_has_targets() -> None:
    for path in DASHBOARD_FILES:
        for panel in iter_dashboard_panels(json.loads(path.read_text(encoding="utf-8"))):
            if panel.get("type") != "row":
                assert panel.get("targets"), f"{path.name} panel {panel.get('id')}: no query"


def test_latency_panels_show_exemplars() -> None:
    latency = [t for _, _, t in iter_dashboard_targets() if "histogram_quantile" in t["expr"]
               and not t.get("instant")]
    assert latency and all(t.get("exemplar") for t in latency)


def test_dashboard_links_reach_the_stack(services: dict[str, dict]) -> None:
    host_ports = {h for svc in services.values() for h in published_ports(svc).values() if h}
    urls = []
    for path in DASHBOARD_FILES:
        dashboard = json.loads(path.read_text(encoding="utf-8"))
        urls += [link["url"] for link in dashboard.get("links") or [] if link.get("url")]
        for panel in iter_dashboard_panels(dashboard):
            urls += [link["url"] for link in panel.get("links") or []]
            defaults = (panel.get("fieldConfig") or {}).get("defaults") or {}
            urls += [link["url"] for link in defaults.get("links") or []]
    assert any("16686" in u for u in urls), "no link to Jaeger"
    assert any(u.startswith("/explore") for u in urls), "no Explore link"
    for url in urls:
        if url.startswith("/"):
            continue
        u = urlsplit(url)
        assert u.hostname in LOOPBACK and u.port in host_ports, (
            f"link {url} does not point at a port compose publishes")


def test_expr_checker_catches_mistakes() -> None:
    good = ('histogram_quantile(0.99, sum by (le, direction) '
            '(rate(kvobs_transfer_duration_seconds_bucket{clock="host"}[$__rate_interval])))')
    assert expr_problems(good) == []
    assert expr_problems('sum(rate(x_total{a=~"kv[.].*"}[5m:1m]))') == []
    assert expr_problems("sum(rate(x_total[$__rate_interval])") != []
    assert expr_problems("sum(rate(x_total[$__rate_interval]))) ") != []
    assert expr_problems('sum(rate(x_total{a=~"kv.*$"}[1m]))') == []  # regex anchor
    assert expr_problems('sum by (rank) (rate(x_total{rank="$rank"}[1m]))') != []
    assert expr_problems("sum by (rank) (rate(x_total{rank=$rank}[1m]))") != []
    assert expr_problems("rate(x_total[${DS_PROMETHEUS}])") != []
    assert expr_problems("rate(x_total[five])") != []
    assert expr_problems("sum by (kvobs.rank) (x)") != []
    assert expr_problems("histogram_quantile(0.5, sum by (rank) (rate(x_bucket[1m])))") != []
    assert expr_problems('x{a="unterminated}') != []
    assert expr_problems("") == ["empty expr"]
    assert metric_names(good) == {"kvobs_transfer_duration_seconds_bucket"}
    assert metric_names("sum(kvobs_receipts_open) / on (job) group_left up") == {
        "kvobs_receipts_open", "up"}
