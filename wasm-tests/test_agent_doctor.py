"""`llmgw-agent doctor` against simulated replicas (llmgw-sim) and a real Envoy's admin: every
check passes on a right configuration, and each deliberately wrong setting fails its own check
with a line naming the problem and its fix."""

import subprocess

from llmgw_testkit import EnvoyAdmin, agent_config, free_port, sim_replica, start_envoy
from llmgw_testkit.fleet import new_sims, sim_command, wait_sims


def envoy_with(procs, envoy_bin, tmp_path, name: str, clusters: list[str]) -> str:
    """An Envoy holding only an admin and these (endpoint-less) clusters; its admin URL."""
    admin = free_port()
    defs = "".join(f"""
  - name: {c}
    type: STATIC
    connect_timeout: 1s
    load_assignment: {{cluster_name: {c}}}""" for c in clusters)
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"""admin:
  address: {{socket_address: {{address: 127.0.0.1, port_value: {admin}}}}}
static_resources:
  clusters:{defs}
""")
    proc = start_envoy(procs, envoy_bin, path, name, concurrency=1)
    EnvoyAdmin(admin).wait_ready(30, proc=proc)
    return f"http://127.0.0.1:{admin}"


def doctor(agent_bin, tmp_path, name: str, replicas, admin: str, **sections) -> tuple[int, list[str]]:
    cfg = tmp_path / f"{name}.toml"
    cfg.write_text(agent_config(free_port(), free_port(), replicas, **sections))
    p = subprocess.run([agent_bin, "doctor", "--config", cfg, "--envoy-admin", admin],
                       capture_output=True, text=True, timeout=120)
    return p.returncode, p.stdout.splitlines() + p.stderr.splitlines()


def test_doctor_passes_a_right_fleet_and_names_each_wrong_setting(procs, agent_bin, sim_bin, envoy_bin, tmp_path):
    # r0 publishes KV events on its own address (as vLLM binds tcp://*:PORT); r1 publishes none.
    r0, r1 = new_sims(2)
    procs.start(sim_command(sim_bin, r0, "m", host="[::ffff:127.0.0.1]"), "r0")
    procs.start([sim_bin, "--port", r1["port"], "--name", "r1", "--model", "m"], "r1")
    wait_sims([r0, r1])
    full = envoy_with(procs, envoy_bin, tmp_path, "envoy-full", ["llmgw_agent", "llmgw_replicas", "llmgw_tokenizer"])
    short = envoy_with(procs, envoy_bin, tmp_path, "envoy-short", ["llmgw_agent", "llmgw_replicas"])

    rc, lines = doctor(agent_bin, tmp_path, "right", [sim_replica(r0, "m")], full,
                       discovery=[{"name": "pool", "dns": "127.0.0.1", "port": r0["port"], "models": ["m"]}])
    report = "\n".join(lines)
    assert rc == 0, report
    checks = [line for line in lines if not line.startswith("    ")]
    assert checks and all(line.startswith("ok") for line in checks), report
    for want in ["replica r0: /health", "replica r0: /v1/models serves m;", "discovery pool: 127.0.0.1 resolves",
                 f"discovery pool replica 127.0.0.1:{r0['port']}: /kv_event_sources lists 1 publisher(s)",
                 "envoy: cluster llmgw_agent present", "envoy: cluster llmgw_replicas present",
                 "envoy: cluster llmgw_tokenizer present"]:
        assert any(want in line for line in checks), f"{want!r} not in\n{report}"

    # One wrong setting per check.
    down = {**sim_replica(r0, "m"), "name": "wrong-address", "address": f"127.0.0.1:{free_port()}"}
    unserved = {**sim_replica(r0, "m"), "name": "wrong-model", "models": ["not-served"],
                "endpoint": f"tcp://127.0.0.1:{free_port()}", "replay_endpoint": f"tcp://127.0.0.1:{free_port()}"}
    rc, lines = doctor(agent_bin, tmp_path, "wrong", [down, unserved], short,
                       discovery=[{"name": "noapi", "dns": "127.0.0.1", "port": free_port(), "models": ["m"]},
                                  {"name": "noevents", "dns": "127.0.0.1", "port": r1["port"], "models": ["m"]}])
    report = "\n".join(lines)
    print(f"doctor on one wrong setting per check (exit {rc}):\n{report}")  # shown with pytest -s
    assert rc != 0, report
    failed = [(line, lines[i + 1] if i + 1 < len(lines) else "") for i, line in enumerate(lines)
              if line.startswith("FAIL")]
    want = {
        "replica wrong-address: /health": "fix: replicas[0].address must give the replica's vLLM API",
        "replica wrong-model: /v1/models serves m, not not-served": "fix: set replicas[1].models",
        "discovery noapi replica 127.0.0.1:": "fix: discovery[0].dns and .port must give the replica's vLLM API",
        f"discovery noevents replica 127.0.0.1:{r1['port']}: /kv_event_sources lists no ZMQ publisher":
            "fix: start vLLM with the --kv-events-config",
        "envoy: cluster llmgw_tokenizer missing": "fix: add it as envoy/llmgw-local.yaml does",
    }
    assert len(failed) == len(want), report
    for problem, fix in want.items():
        hits = [nxt for line, nxt in failed if problem in line]
        assert len(hits) == 1 and hits[0].strip().startswith(fix), f"{problem!r} / {fix!r} not in\n{report}"
