"""The shipped Prometheus rules load, and every alert fires on its condition
and stays quiet otherwise (promtool 3.5.0, built from Go modules by
.ci/otel-bins/build.sh: the Prometheus release docker-compose.yml ships)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from otel_servers import prometheus_binaries

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def promtool() -> str:
    return str(prometheus_binaries()[1])


def test_rules_are_valid():
    res = subprocess.run([promtool(), "check", "rules", str(DEPLOY / "alerts.yml")],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


def test_every_alert_has_unit_tests_that_pass():
    rules = yaml.safe_load((DEPLOY / "alerts.yml").read_text())
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r}
    tests = yaml.safe_load((DEPLOY / "alerts.test.yml").read_text())
    tested = {t["alertname"] for case in tests["tests"] for t in case["alert_rule_test"]}
    firing = {t["alertname"] for case in tests["tests"] for t in case["alert_rule_test"]
              if t.get("exp_alerts")}
    quiet = {t["alertname"] for case in tests["tests"] for t in case["alert_rule_test"]
             if not t.get("exp_alerts")}
    assert alerts == tested == firing == quiet
    res = subprocess.run([promtool(), "test", "rules", "alerts.test.yml"], cwd=DEPLOY,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "SUCCESS" in res.stdout, res.stdout + res.stderr
