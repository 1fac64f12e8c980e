"""`llmgw-agent doctor` against simulated replicas (llmgw-sim) and a real Envoy's admin: every
check passes on a right configuration, and each deliberately wrong setting fails its own check
with a line naming the problem and its fix."""

import subprocess

from llmgw_testkit import (Agent, EnvoyAdmin, agent_config, filter_config, free_port, shipped_config, sim_replica,
                           start_envoy)
from llmgw_testkit.fleet import new_sims, sim_command, start_router, wait_sims


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


def connect(sim: dict, name: str | None = None, **over) -> dict:
    """The agent's entry for `sim`, connecting to the publisher it binds (as vLLM's)."""
    return {**sim_replica(sim, "m"), "mode": "connect", **({"name": name} if name else {}), **over}


def test_doctor_passes_a_right_fleet_and_names_each_wrong_setting(procs, agent_bin, sim_bin, envoy_bin, wasm_path,
                                                                   tmp_path):
    # r0 publishes KV events on its own address (as vLLM binds tcp://*:PORT); r1 publishes none;
    # r2 hashes with another PYTHONHASHSEED; r3 with blocks of 32 tokens; r4 as r0. (The
    # configuration refuses two replicas on one event endpoint: each wrong one has its own.)
    r0, r1, r2, r3, r4 = new_sims(5)
    procs.start(sim_command(sim_bin, r0, "m", host="[::ffff:127.0.0.1]"), "r0")
    procs.start([sim_bin, "--port", r1["port"], "--name", "r1", "--model", "m"], "r1")
    procs.start(sim_command(sim_bin, r2, "m", host="[::ffff:127.0.0.1]", seed="1"), "r2")
    procs.start(sim_command(sim_bin, r3, "m", host="[::ffff:127.0.0.1]", block_size=32), "r3")
    procs.start(sim_command(sim_bin, r4, "m", host="[::ffff:127.0.0.1]"), "r4")
    wait_sims([r0, r1, r2, r3, r4])
    # A gateway as shipped, its filter fed by an agent mirroring r0.
    agent = Agent(procs, agent_bin, tmp_path, [connect(r0)]).wait_ready()
    listen, admin = free_port(), free_port()
    _, gateway = start_router(procs, envoy_bin, tmp_path, "envoy-full",
                              shipped_config(wasm_path, listen, admin, agent.feed, filter_config()), admin, feed=True)
    full = f"http://127.0.0.1:{admin}"
    short = envoy_with(procs, envoy_bin, tmp_path, "envoy-short", ["llmgw_agent", "llmgw_replicas"])

    rc, lines = doctor(agent_bin, tmp_path, "right", [connect(r0)], full,
                       discovery=[{"name": "pool", "dns": "127.0.0.1", "port": r0["port"], "models": ["m"]}])
    report = "\n".join(lines)
    print(f"doctor on a right fleet (exit {rc}):\n{report}")  # shown with pytest -s
    assert rc == 0, report
    checks = [line for line in lines if not line.startswith("    ")]
    assert checks and all(line.startswith("ok") for line in checks), report
    for want in ["replica r0: /health", "replica r0: /v1/models serves m;", "discovery pool: 127.0.0.1 resolves",
                 f"discovery pool replica 127.0.0.1:{r0['port']}: /kv_event_sources lists 1 publisher(s)",
                 "r0: /metrics reports prefix caching on, hash algorithm sha256_cbor, block size 16",
                 "KV-event batch(es) received on tcp://127.0.0.1:", "r0: hash parity: ", "r0: replay socket ",
                 "envoy: cluster llmgw_agent present", "envoy: cluster llmgw_replicas present",
                 "envoy: cluster llmgw_tokenizer present", "envoy: every filter VM ("]:
        assert any(want in line for line in checks), f"{want!r} not in\n{report}"

    # One wrong setting per check.
    down = connect(r0, "wrong-address", address=f"127.0.0.1:{free_port()}",
                   endpoint=f"tcp://127.0.0.1:{free_port()}", replay_endpoint=f"tcp://127.0.0.1:{free_port()}")
    unserved = connect(r0, "wrong-model", models=["not-served"])
    no_events = connect(r1, "wrong-endpoint", endpoint=f"tcp://127.0.0.1:{free_port()}")
    no_replay = connect(r4, "wrong-replay", replay_endpoint=f"tcp://127.0.0.1:{free_port()}")
    rc, lines = doctor(agent_bin, tmp_path, "wrong",
                       [down, unserved, no_events, no_replay, connect(r2, "wrong-seed"), connect(r3, "wrong-block-size")],
                       short,
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
        "wrong-endpoint: no KV-event batch on tcp://127.0.0.1:": "fix: start vLLM with the --kv-events-config",
        "wrong-replay: replay socket tcp://127.0.0.1:": "fix: set replay_endpoint to vLLM's kv-events replay_endpoint",
        "wrong-seed: hash parity: ": "fix: start every replica with the PYTHONHASHSEED",
        "wrong-block-size: /metrics reports block_size=32 where [hash].block_size = 16":
            "fix: start vLLM with --block-size 16",
        "envoy: cluster llmgw_tokenizer missing": "fix: add it as envoy/llmgw-local.yaml does",
        "envoy: no filter VM reports llmgw_feed_connected": "fix: the llmgw filter is not loaded",
    }
    for problem, fix in want.items():
        hits = [nxt for line, nxt in failed if problem in line]
        assert len(hits) == 1 and hits[0].strip().startswith(fix), f"{problem!r} / {fix!r} not in\n{report}"
    assert len(failed) == len(want), report
