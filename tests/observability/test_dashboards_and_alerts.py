"""The monitoring manifests (k8s/monitoring): the Grafana dashboard, in a ConfigMap the Grafana
sidecar picks up, and the PrometheusRule's alerts load, hold what the issue asks for, and query
only metrics the services really export: every metric name in every PromQL expression is checked
against a live /metrics scrape of the real router, thinker, talker, code2wav and gateway."""

from __future__ import annotations

import json
import re
import subprocess
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.k8s.manifests import find_kubectl

MONITORING = Path(__file__).resolve().parents[2] / "k8s" / "monitoring"
DASHBOARD = MONITORING / "dashboards" / "omni-serve.json"
RULES = MONITORING / "prometheusrule.yaml"

# PromQL words that look like metric names but are not (functions are told by the "(" after them).
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset",
            "inf", "nan", "Inf", "NaN"}
_STRING = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_NAME = re.compile(r"(?<![\w.:$])[a-zA-Z_:][a-zA-Z0-9_:]*(?![\w(])(?!\s*\()")


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects: identifiers that are not functions, keywords,
    label names (inside {} or a by/on/without list), durations (inside []) or strings."""
    expr = _STRING.sub('""', expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range and subquery durations ($__rate_interval too)
    expr = _GROUPING.sub("", expr)
    expr = re.sub(r"\b\d+(?:\.\d+)?(?:e[+-]?\d+)?[smhdwy]?\b", "", expr)  # numbers and durations after offset
    return {name for name in _NAME.findall(expr) if name not in KEYWORDS}


def test_metric_names_are_read_out_of_promql_robustly():
    expr = ('histogram_quantile(0.95, sum by (namespace, le) (rate(omni_router_ttfp_seconds_bucket'
            '{namespace=~"$namespace", outcome="ok"}[$__rate_interval]))) > 2 and on (pod) '
            'changes(process_start_time_seconds[15m] offset 1h) >= 1e3 or absent(up{job="x"}) unless foo:bar_total')
    assert metric_names(expr) == {"omni_router_ttfp_seconds_bucket", "process_start_time_seconds", "up", "foo:bar_total"}
    assert metric_names("sum(rate(a_total[5m])) / sum(rate(b_total{x='y'}[5m]))") == {"a_total", "b_total"}


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_exprs(board: dict) -> list[str]:
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", ())]
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            inner = re.fullmatch(r"label_values\((\w+),\s*\w+\)", variable["definition"])
            assert inner, variable["definition"]
            exprs.append(inner.group(1))
    return exprs


def rules() -> dict:
    (rule,) = list(yaml.safe_load_all(RULES.read_text()))
    return rule


def rule_exprs(rule: dict) -> list[str]:
    return [r["expr"] for group in rule["spec"]["groups"] for r in group["rules"]]


def test_the_dashboard_has_a_panel_for_each_measure_the_issue_lists():
    board = dashboard()
    text = "\n".join(dashboard_exprs(board))
    for metric in ("omni_router_ttft_seconds_bucket", "omni_router_ttfp_seconds_bucket", "omni_router_rtf_bucket",
                   "omni_router_requests_total", "omni_router_underruns_total", "omni_stage_queue_depth",
                   "omni_router_queue_depth", "omni_stage_batch_size_sum", "omni_stage_cache_slots_used",
                   "omni_stage_step_seconds_bucket", "omni_router_replica_state", "omni_router_migrations_total",
                   "omni_stage_migrations_total", "omni_prefix_cache_hit_tokens_total",
                   "omni_prefix_cache_lookup_tokens_total", "omni_prefix_cache_blocks", "omni_prefix_cache_evictions_total"):
        assert metric in text, metric
    for quantile in ("0.5", "0.9", "0.99"):
        assert f"histogram_quantile({quantile}, sum by (le) (rate(omni_router_ttfp_seconds_bucket" in text
    assert "sum by (outcome) (rate(omni_router_requests_total" in text
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)) and board["uid"] == "omni-serve"
    for panel in board["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], panel["title"]


def test_the_rules_alert_on_what_the_issue_lists():
    rule = rules()
    assert (rule["apiVersion"], rule["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    alerts = {r["alert"]: r for group in rule["spec"]["groups"] for r in group["rules"]}
    assert set(alerts) == {"OmniTTFPHigh", "OmniUnderrunsRising", "OmniStageNoHealthyReplica", "OmniAdmissionQueueFull",
                           "OmniReplicaCrashLooping"}
    assert "omni_router_ttfp_seconds_bucket" in alerts["OmniTTFPHigh"]["expr"]
    assert "omni_router_underruns_total" in alerts["OmniUnderrunsRising"]["expr"]
    assert "omni_router_replica_healthy" in alerts["OmniStageNoHealthyReplica"]["expr"]
    assert "omni_router_queue_limit" in alerts["OmniAdmissionQueueFull"]["expr"]
    assert "process_start_time_seconds" in alerts["OmniReplicaCrashLooping"]["expr"]
    for name, alert in alerts.items():
        assert alert["labels"]["severity"] in ("warning", "critical"), name
        assert alert["annotations"]["summary"] and alert["annotations"]["description"], name


def test_the_kustomization_ships_the_dashboard_in_a_configmap_for_the_grafana_sidecar():
    out = subprocess.run([find_kubectl(), "kustomize", str(MONITORING)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    objects = {(o["kind"], o["metadata"]["name"]): o for o in yaml.safe_load_all(out.stdout)}
    assert set(objects) == {("ConfigMap", "omni-serve-dashboard"), ("PodMonitor", "omni-serve"),
                            ("PrometheusRule", "omni-serve")}
    config_map = objects["ConfigMap", "omni-serve-dashboard"]
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(config_map["data"]["omni-serve.json"]) == dashboard()
    assert objects["PrometheusRule", "omni-serve"]["spec"] == rules()["spec"]


def exported_names(text: str) -> set[str]:
    """The series names a /metrics page exports, histogram and counter suffixes included; from each
    family's type, so a labelled metric with no sample yet (no migration so far) still counts."""
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
                "summary": ("", "_sum", "_count", "_created"), "gauge": ("",), "untyped": ("",)}
    names = set()
    for family in text_string_to_metric_families(text):
        names |= {family.name + suffix for suffix in suffixes.get(family.type, ("",))}
        names |= {sample.name for sample in family.samples}
    return names


@pytest.mark.slow  # the traced stack (tests/observability/conftest.py)
def test_every_promql_expression_queries_only_metrics_the_running_services_export(traced_stack):
    scraped = set()
    exporters = {}
    for name, url in traced_stack.metrics_urls.items():
        with urllib.request.urlopen(url, timeout=10) as response:
            names = exported_names(response.read().decode())
        assert names, name
        exporters[name] = names
        scraped |= names
    assert {"omni_router_ttfp_seconds_bucket", "omni_router_underruns_total"} <= exporters["router"]
    assert "omni_stage_step_seconds_bucket" in exporters["talker-0"] and "omni_gateway_requests_total" in exporters["gateway"]
    queried = {}  # metric name -> the first expression that reads it
    for expr in dashboard_exprs(dashboard()) + rule_exprs(rules()):
        names = metric_names(expr)
        assert names, f"no metric read out of {expr!r}"
        for metric in names:
            queried.setdefault(metric, expr)
    unknown = {metric: expr for metric, expr in queried.items() if metric not in scraped}
    assert not unknown, f"queried but exported by no service: {unknown}"
