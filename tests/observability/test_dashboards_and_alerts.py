"""The monitoring manifests (k8s/monitoring): the Grafana dashboard, in a ConfigMap the Grafana
sidecar picks up, and the PrometheusRule's alerts hold what the issue asks for, and are checked by
Prometheus itself (Debian's prometheus package: promtool and the server, `make setup` installs it):

- `promtool check rules` loads the alert rules (the PrometheusRule's spec.groups);
- `promtool test rules` runs alert_rules_test.yaml beside this file: series that make every alert
  fire, with the labels and annotations Alertmanager would get, and series that must not;
- the slow test starts a stack of its own and a real Prometheus scraping its router, thinkers,
  talker, code2wav replicas and gateway (labelled as the PodMonitors label them), sends requests
  through them (a thinker and a code2wav replica killed mid-request, so the migration panels have
  data), and runs every dashboard query, each of which must return at least one series, so every
  metric it names is one the services export; every alert expression must evaluate, and every
  metric name the unit tests feed the alerts must be among those Prometheus scraped.

Without promtool or prometheus these tests skip with the reason (and fail under CI=true)."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from services.tools.launcher import free_port, free_port_block
from tests.k8s.manifests import find_kubectl
from tests.needs import need_command
from tests.observability.test_tracing import Call, audio_request, holding_replica, kill_and_complete
from tests.stacks import stack_of

MONITORING = Path(__file__).resolve().parents[2] / "k8s" / "monitoring"
DASHBOARD = MONITORING / "dashboards" / "omni-serve.json"
RULES = MONITORING / "prometheusrule.yaml"
RULES_TEST = Path(__file__).with_name("alert_rules_test.yaml")
RULES_FILE = "omni-serve-rules.yaml"  # the name alert_rules_test.yaml loads

# The labels the Prometheus Operator gives what the PodMonitors scrape (job: "<namespace>/<PodMonitor>").
NAMESPACE = "omni-serve"
JOBS = {"gateway": f"{NAMESPACE}/omni-gateway"}  # k8s/monitoring/gateway-podmonitor.yaml; the rest podmonitor.yaml's
DEFAULT_JOB = f"{NAMESPACE}/omni-serve"
SCRAPE_S = 1
# Grafana's variables as the dashboard would have them: $__rate_interval is max(4 x the data
# source's scrape interval, $__interval + it), 1m at Grafana's default 15 s; $namespace one namespace.
VARIABLES = {"$__rate_interval": "1m", "$namespace": NAMESPACE}


def tool(name: str) -> str:
    """promtool or prometheus: on PATH or in /usr/bin (Debian's prometheus package); without it,
    a skip with the reason, a failure under CI=true (tests/needs.py)."""
    found = shutil.which(name) or (f"/usr/bin/{name}" if os.access(f"/usr/bin/{name}", os.X_OK) else None)
    return found or need_command(name, "Debian's prometheus package checks the alert rules and dashboard queries")


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panel_targets(board: dict) -> list[tuple[str, str]]:
    """(panel title, expression) of every query of every panel."""
    return [(p["title"], t["expr"]) for p in board["panels"] for t in p.get("targets", ())]


def rules() -> dict:
    (rule,) = list(yaml.safe_load_all(RULES.read_text()))
    return rule


def alert_rules(rule: dict) -> dict[str, dict]:
    return {r["alert"]: r for group in rule["spec"]["groups"] for r in group["rules"]}


def write_rules(folder: Path) -> Path:
    """The PrometheusRule's groups as a Prometheus rules file."""
    path = folder / RULES_FILE
    path.write_text(yaml.safe_dump({"groups": rules()["spec"]["groups"]}, sort_keys=False))
    return path


def test_the_dashboard_has_a_panel_for_each_measure_the_issue_lists():
    board = dashboard()
    text = "\n".join(expr for _, expr in panel_targets(board))
    for metric in ("omni_router_ttft_seconds_bucket", "omni_router_ttfp_seconds_bucket", "omni_router_rtf_bucket",
                   "omni_router_requests_total", "omni_router_underruns_total", "omni_stage_queue_depth",
                   "omni_router_queue_depth", "omni_stage_batch_size_sum", "omni_stage_cache_slots_used",
                   "omni_stage_step_seconds_bucket", "omni_router_replica_state", "omni_router_migrations_total",
                   "omni_stage_migrations_total", "omni_prefix_cache_hit_tokens_total",
                   "omni_prefix_cache_lookup_tokens_total", "omni_prefix_cache_blocks", "omni_prefix_cache_evictions_total",
                   # realtime sessions (issue 56): open, ended by how (the limits), turns, barge-ins, turn
                   # detection's CPU per second of audio, the event loops' lag
                   "omni_session_open", "omni_session_sessions_total", "omni_session_turns_total",
                   "omni_session_barge_ins_total", "omni_session_turn_detection_cpu_seconds_total",
                   "omni_session_turn_detection_audio_seconds_total", "omni_session_loop_lag_seconds_bucket",
                   "omni_router_loop_lag_seconds_bucket"):
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
    alerts = alert_rules(rule)
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


def test_promtool_checks_the_alert_rules(tmp_path):
    out = subprocess.run([tool("promtool"), "check", "rules", str(write_rules(tmp_path))],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(alert_rules(rules()))} rules found" in out.stdout, out.stdout


def test_every_alert_fires_on_its_promtool_unit_test_series_and_holds_on_the_others(tmp_path):
    cases = yaml.safe_load(RULES_TEST.read_text())
    assert cases["rule_files"] == [RULES_FILE]
    evaluations = [e for group in cases["tests"] for e in group.get("alert_rule_test", ())]
    for name in alert_rules(rules()):
        mine = [e for e in evaluations if e["alertname"] == name]
        assert any(e["exp_alerts"] for e in mine), f"{name}: no unit test in which it fires"
        assert any(not e["exp_alerts"] for e in mine), f"{name}: no unit test in which it holds"
    write_rules(tmp_path)
    shutil.copy(RULES_TEST, tmp_path / RULES_TEST.name)
    out = subprocess.run([tool("promtool"), "test", "rules", RULES_TEST.name], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def unit_test_metric_names() -> set[str]:
    """The metric names of alert_rules_test.yaml's input series."""
    cases = yaml.safe_load(RULES_TEST.read_text())
    return {s["series"].split("{", 1)[0].strip() for group in cases["tests"] for s in group["input_series"]}


def grafana_query(expr: str) -> str:
    """`expr` with the dashboard's variables as Grafana fills them in."""
    for variable, value in VARIABLES.items():
        expr = expr.replace(variable, value)
    assert "$" not in expr, f"a variable the test does not fill in: {expr}"
    return expr


class Prometheus:
    """A Prometheus server (the real one) scraping `targets` {pod: host:port} every SCRAPE_S with
    the PodMonitors' labels and evaluating the alert rules, its data in `folder`; a context manager
    that stops it (and waits for it) on the way out."""

    def __init__(self, folder: Path, targets: dict[str, str]):
        self.folder, self.targets = folder, targets
        self.url = f"http://127.0.0.1:{free_port()}"
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> Prometheus:
        jobs: dict[str, list] = {}
        for pod, address in self.targets.items():
            jobs.setdefault(JOBS.get(pod, DEFAULT_JOB), []).append(
                {"targets": [address], "labels": {"namespace": NAMESPACE, "pod": pod}})
        config = {"global": {"scrape_interval": f"{SCRAPE_S}s", "scrape_timeout": f"{SCRAPE_S}s",
                             "evaluation_interval": f"{SCRAPE_S}s"},
                  "rule_files": [str(write_rules(self.folder))],
                  "scrape_configs": [{"job_name": job, "static_configs": static} for job, static in jobs.items()]}
        (self.folder / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False))
        self.log = open(self.folder / "prometheus.log", "wb")  # closed in __exit__
        self.process = subprocess.Popen(
            [tool("prometheus"), f"--config.file={self.folder / 'prometheus.yml'}",
             f"--storage.tsdb.path={self.folder / 'data'}", f"--web.listen-address={self.url.removeprefix('http://')}"],
            stdout=self.log, stderr=subprocess.STDOUT)
        try:
            self.wait_for(lambda: self.get("/-/ready", raw=True), 60, "ready")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
            self.process = None
        self.log.close()

    def get(self, path: str, raw: bool = False, **params):
        url = self.url + path + ("?" + urllib.parse.urlencode(params, doseq=True) if params else "")
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                body = response.read()
        except OSError:
            if raw:
                return None
            raise
        return body if raw else json.loads(body)

    def query(self, expr: str) -> dict:
        """The API's answer (status, data or error), an error answer (HTTP 400/422) included."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        try:
            with urllib.request.urlopen(url, timeout=30) as response:
                return json.load(response)
        except urllib.error.HTTPError as error:
            return json.load(error)

    def value(self, expr: str) -> float | None:
        result = self.query(expr)["data"]["result"]
        return float(result[0]["value"][1]) if result else None

    def wait_for(self, ready, timeout_s: float, what: str):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if answer := ready():
                return answer
            if self.process.poll() is not None:
                raise AssertionError(f"prometheus exited {self.process.returncode}: {self.log_tail()}")
            time.sleep(0.25)
        raise AssertionError(f"prometheus: not {what} after {timeout_s} s: {self.log_tail()}")

    def wait_scraped_since(self, since: float, timeout_s: float = 60) -> None:
        """Until every target is up and was scraped after `since` (time.time())."""
        def scraped():
            return self.value("count(up == 1)") == len(self.targets) and (self.value("min(timestamp(up))") or 0) > since
        self.wait_for(scraped, timeout_s, f"scraping all {len(self.targets)} targets")

    def log_tail(self) -> str:
        return (self.folder / "prometheus.log").read_text(errors="replace")[-3000:]


@pytest.fixture(scope="module")
def scraped_stack(tiny_checkpoint):
    """The pipeline as the traced stack (conftest.py) has it, without its OTLP collector: a router,
    two thinker replicas, a talker, two code2wav replicas and the gateway, each with a metrics port;
    `.metrics_targets` {process: host:port}. Its own, not the package's traced stack: this test
    kills replicas, and the tracing tests count the moves in their stack's logs."""
    metrics_port = free_port_block()  # the router the base, every other process the next ones, in start order
    stack = stack_of(tiny_checkpoint, thinker_replicas=2, code2wav_replicas=2, http_port=0, metrics_base_port=metrics_port,
                     router_args=("--max-migrations", "2"))
    with stack:
        others = [name for name in stack.processes if name != "router"]
        stack.metrics_targets = {"router": f"127.0.0.1:{metrics_port}",
                                 **{name: f"127.0.0.1:{metrics_port + 1 + i}" for i, name in enumerate(others)}}
        yield stack


def move_a_request_off(stack, stage: str) -> None:
    """A request whose `stage` replica is killed mid-stream completes, moved (the migration
    metrics); the replica is started again."""
    call = Call(stack, audio_request(f"prometheus-{stage}-{secrets.token_hex(4)}", frames=250), hold=True)
    victim = None
    try:
        victim, _ = holding_replica(stack, call, stage)
        kill_and_complete(stack, call, victim)
    finally:
        call.release()
        if victim is not None:
            stack.restart(victim)


@pytest.mark.slow  # a stack of its own
@pytest.mark.timeout(600)
def test_every_dashboard_query_returns_series_and_every_alert_evaluates_on_prometheus_scraping_the_stack(
        scraped_stack, tmp_path):
    targets = scraped_stack.metrics_targets
    assert {"router", "sessions", "gateway", "talker-0"} <= set(targets) and len(targets) == 8, targets
    with Prometheus(tmp_path, targets) as prometheus:
        prometheus.wait_scraped_since(time.time())  # a scrape before the traffic: the counters' rates
        calls = [Call(scraped_stack, audio_request(f"prometheus-{i}-{secrets.token_hex(4)}")) for i in range(2)]
        for call in calls:
            call.join()
            assert call.error is None and call.final is not None
        with urllib.request.urlopen(scraped_stack.http_url + "/v1/models", timeout=30) as response:
            model = json.load(response)["data"][0]["id"]
        body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4})
        request = urllib.request.Request(scraped_stack.http_url + "/v1/chat/completions", data=body.encode(),
                                         method="POST", headers={"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            assert response.status == 200
        move_a_request_off(scraped_stack, "thinker")  # the router's migration metrics
        move_a_request_off(scraped_stack, "code2wav")  # the talker's
        prometheus.wait_scraped_since(time.time() + SCRAPE_S)

        empty, failed = [], []
        for title, expr in panel_targets(dashboard()):
            answer = prometheus.query(grafana_query(expr))
            if answer["status"] != "success":
                failed.append((title, expr, answer.get("error")))
            elif not answer["data"]["result"]:
                empty.append((title, expr))
        assert not failed, f"dashboard queries Prometheus refused: {failed}"
        assert not empty, f"dashboard queries with no series on the running stack: {empty}"
        for variable in dashboard()["templating"]["list"]:
            if variable["type"] == "query":  # label_values(metric, label)
                metric, label = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", variable["definition"]).groups()
                values = prometheus.get(f"/api/v1/label/{label}/values", **{"match[]": metric})["data"]
                assert values == [NAMESPACE], (variable["name"], values)

        for name, alert in alert_rules(rules()).items():
            answer = prometheus.query(alert["expr"])
            assert answer["status"] == "success", (name, answer.get("error"))

        def evaluated():
            groups = prometheus.get("/api/v1/rules")["data"]["groups"]
            loaded = [r for g in groups for r in g["rules"]]
            return loaded if all(not r["lastEvaluation"].startswith("0001-") for r in loaded) else None
        loaded = prometheus.wait_for(evaluated, 30, "evaluating the alert rules")
        assert {r["name"] for r in loaded} == set(alert_rules(rules()))
        assert all(r["health"] == "ok" for r in loaded), [(r["name"], r.get("lastError")) for r in loaded]

        unknown = unit_test_metric_names() - set(prometheus.get("/api/v1/label/__name__/values")["data"])
        assert not unknown, f"alert_rules_test.yaml feeds the alerts metrics no service exports: {unknown}"
