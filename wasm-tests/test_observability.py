"""The alerting rules and the dashboard (observability/): observability/check_metrics.py accepts
the shipped files and names a metric the project does not define; every alert an operator needs
is there. (`./build.sh test` also runs the rules' unit tests under promtool.)"""

import importlib.util

import yaml

import llmgw_testkit as kit

OBS = kit.ROOT / "observability"


def checker():
    spec = importlib.util.spec_from_file_location("check_metrics", OBS / "check_metrics.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_shipped_rules_and_dashboard_name_only_defined_metrics(tmp_path):
    c = checker()
    assert c.main([]) == 0
    names = c.defined()
    # The three sources are read: the filter's (manual), the agent's, the native tokenizer's.
    for n in ["llmgw_fallbacks_total", "llmgw_feed_connected", "llmgw_agent_replica_up", "llmgw_agent_block_limit",
              "llmgw_native_tokenizer_up"]:
        assert n in names, n
    # A rule naming a metric nobody defines (a typo, a renamed metric) is reported with its place.
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"groups": [{"name": "g", "rules": [
        {"alert": "Typo", "expr": 'rate(llmgw_fallback_total{reason="stale"}[5m]) > 0'},
        {"alert": "Fine", "expr": 'histogram_quantile(0.99, rate(llmgw_decision_us_bucket[5m])) > 1000'}]}]}))
    assert c.unknown_names([bad], names) == ["bad.yaml: Typo: llmgw_fallback_total is not a metric the project defines"]
    assert c.main([str(bad)]) == 1


def test_every_needed_alert_is_shipped():
    rules = yaml.safe_load((OBS / "prometheus/llmgw-alerts.yaml").read_text())
    alerts = {r["alert"]: r["expr"] for g in rules["groups"] for r in g["rules"]}
    want = {
        "LlmgwHashParityMismatch": "llmgw_agent_parity_match_ratio",
        "LlmgwFilterHashMismatch": "llmgw_hash_mismatch_total",
        "LlmgwFeedDisconnected": "llmgw_feed_connected",
        "LlmgwAgentNoSubscribers": "llmgw_agent_subscribers",
        "LlmgwIndexFallbacksRising": "not_synced|stale",
        "LlmgwTokenizerCircuitOpen": "circuit_open",
        "LlmgwNativeTokenizerOff": "llmgw_native_tokenizer_up == 0",
        "LlmgwAgentBlocksNearLimit": "llmgw_agent_block_limit",
        "LlmgwReplicaDown": "llmgw_agent_replica_up == 0",
    }
    for name, needle in want.items():
        assert name in alerts and needle in alerts[name], name
    # Each rule has a test in the promtool unit tests.
    tests = yaml.safe_load((OBS / "prometheus/llmgw-alerts.test.yaml").read_text())
    tested = {a["alertname"] for t in tests["tests"] for a in t.get("alert_rule_test", []) if a.get("exp_alerts")}
    assert tested == set(alerts), set(alerts) ^ tested
