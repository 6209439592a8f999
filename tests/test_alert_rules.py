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


def test_every_counter_alert_fires_on_a_series_first_scraped_above_zero():
    """increase() sees nothing in a series whose first sample is its final
    value (a short run, or a burst between a start and the first scrape): each
    alert built on it has an ``unless ... offset`` branch, and a unit test
    whose input series starts above 0 and fires."""
    rules = yaml.safe_load((DEPLOY / "alerts.yml").read_text())
    counter_alerts = {r["alert"]: r["expr"] for g in rules["groups"] for r in g["rules"]
                      if "alert" in r and "increase(" in r["expr"]}
    assert counter_alerts
    assert [a for a, e in counter_alerts.items() if "offset 10m" not in e] == []
    tests = yaml.safe_load((DEPLOY / "alerts.test.yml").read_text())
    covered = set()
    for case in tests["tests"]:
        late = [s["series"].split("{")[0] for s in case["input_series"]
                if s["values"].startswith("_")]
        for t in case["alert_rule_test"]:
            name = t["alertname"]
            if t.get("exp_alerts") and name in counter_alerts and any(
                    m in counter_alerts[name] for m in late):
                covered.add(name)
    assert set(counter_alerts) - covered == set()
