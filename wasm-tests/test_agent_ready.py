"""The agent's /readyz against simulated replicas (llmgw-sim): not ready while a configured
model has no replica up with its KV events flowing, ready once every model has one, not ready
again when one goes away; /healthz stays liveness throughout."""

from llmgw_testkit import request, sim_replica, wait_until
from llmgw_testkit.fleet import new_sims, sim_command, wait_sims


def readyz(agent) -> tuple[int, str]:
    status, _, body = request("GET", f"{agent.base}/readyz", timeout=2)
    return status, body.decode()


def wait_readyz(agent, want_status: int, want_lines: list[str], what: str) -> None:
    """Waits until /readyz answers want_status with a line after its first starting with each of
    want_lines, and no other."""
    last = [None]

    def check():
        last[0] = readyz(agent)
        status, body = last[0]
        got = body.splitlines()[1:]
        return (status == want_status and len(got) == len(want_lines)
                and all(g.startswith(w) for g, w in zip(got, want_lines)))
    try:
        wait_until(check, 20, what)
    except TimeoutError as e:
        raise AssertionError(f"{e}; last /readyz: {last[0]}\n{agent.log()[-3000:]}") from None


def test_readyz_follows_each_models_replicas(start_agent, procs, sim_bin):
    m, n = new_sims(2)
    replicas = [sim_replica(m, "model-m"), sim_replica(n, "model-n")]
    agent = start_agent(replicas)  # waits for /healthz: alive before any replica is
    assert agent.healthz() == (200, b"ok\n")
    status, body = readyz(agent)
    assert status == 503, body
    assert body.splitlines() == [
        "not ready:",
        "model model-m: no replica up with KV events flowing (r0#0 KV events not connected)",
        "model model-n: no replica up with KV events flowing (r1#0 KV events not connected)",
    ]

    procs_m = procs.start(sim_command(sim_bin, m, "model-m", blocks=64, seed=0, decode_ms=1), "r0")
    wait_sims([m])
    wait_readyz(agent, 503, ["model model-n: no replica up with KV events flowing (r1#0 "], "only model-n not ready")

    procs.start(sim_command(sim_bin, n, "model-n", blocks=64, seed=0, decode_ms=1), "r1")
    wait_sims([n])
    wait_readyz(agent, 200, [], "ready with both replicas")
    assert readyz(agent) == (200, "ready\n")

    # model-m's only replica goes away: not ready again, naming it; still alive.
    procs.stop(procs_m)
    # (its publisher disconnected at once, the replica marked down after the grace period)
    wait_readyz(agent, 503, ["model model-m: no replica up with KV events flowing (r0#0 "],
                "model-m not ready after its replica stopped")
    assert agent.healthz() == (200, b"ok\n")
