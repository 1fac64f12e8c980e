"""The test kit's own pieces that need no process: the agent's TOML writer (read back with
tomllib), the decision-header parser, the filling of the shipped Envoy bootstrap, the target
directory lookup."""

import json
import tomllib
from pathlib import Path

import pytest

import llmgw_testkit as kit


def test_agent_config_round_trips_through_a_toml_parser():
    text = kit.agent_config(
        7001, 7002, [{"name": 'r"0\\', "models": ["m", "ü"], "dp_ranks": 2, "up": True, "weight": 0.5,
                      "hash": {"algo": "sha256", "seed": None, "block_size": 16}},
                     {"name": "r1", "address": "127.0.0.1:1"}],
        feed={"token": "t\nx"}, hash={"algo": "sha256_cbor", "seed": "0"},
        discovery=[{"name": "pool", "dns": "localhost", "port": 3}], **{"odd key": {"a.b": 1}})
    doc = tomllib.loads(text)
    assert doc["feed"] == {"listen": "127.0.0.1:7001", "token": "t\nx"}
    assert doc["http"] == {"listen": "127.0.0.1:7002"}
    assert doc["hash"] == {"algo": "sha256_cbor", "seed": "0"}
    assert doc["discovery"] == [{"name": "pool", "dns": "localhost", "port": 3}]
    assert doc["odd key"] == {"a.b": 1}
    r0, r1 = doc["replicas"]
    assert r0 == {"name": 'r"0\\', "models": ["m", "ü"], "dp_ranks": 2, "up": True, "weight": 0.5,
                  "hash": {"algo": "sha256", "block_size": 16}}  # None: left out
    assert r1 == {"name": "r1", "address": "127.0.0.1:1"}
    assert "replicas" not in tomllib.loads(kit.agent_config(1, 2, []))


def test_agent_config_refuses_what_toml_cannot_say():
    with pytest.raises(TypeError, match=r"replicas\.x"):
        kit.agent_config(1, 2, [{"name": "r", "x": object()}])


def test_merged_replaces_keys_within_sections():
    base = {"zmq": {"replay_timeout_ms": 2000}, "load": {"enabled": False}}
    out = kit.merged(base, {"zmq": {"verify_on_reconnect": True}, "load": {"enabled": True}, "parity": {"x": 1}})
    assert out == {"zmq": {"replay_timeout_ms": 2000, "verify_on_reconnect": True}, "load": {"enabled": True},
                   "parity": {"x": 1}}
    assert base == {"zmq": {"replay_timeout_ms": 2000}, "load": {"enabled": False}}


def test_decision_header_parser():
    d = kit.parse_decision("outcome=exact; replica=127.0.0.1:8001; matched=3/4; vm=1")
    assert d == ("exact", "127.0.0.1:8001", 3, 4) and d.matched == 3
    assert kit.speculative_blocks("outcome=exact; replica=127.0.0.1:8001; matched=3/4; vm=1") == 0
    d = kit.parse_decision("outcome=exact; replica=[::1]:8001; matched=5/9; speculative=2; vm=1")
    assert d == ("exact", "[::1]:8001", 5, 9)
    assert kit.speculative_blocks("outcome=exact; replica=[::1]:8001; matched=5/9; speculative=2; vm=1") == 2
    for bad in (None, "", "outcome=exact; replica=127.0.0.1:1; matched=x/4"):
        with pytest.raises(AssertionError, match="x-llmgw-decision"):
            kit.parse_decision(bad)


def test_shipped_config_fills_ports_wasm_and_filter_configuration(tmp_path):
    cfg = kit.filter_config({"name": "t", "block_size": 4}, explain_header=True)
    text = kit.shipped_config(tmp_path / "llmgw.wasm", 1111, 2222, 3333, cfg, stats_flush_interval="0.2s")
    for port in (1111, 2222, 3333):
        assert f"port_value: {port}" in text
    for default in ("port_value: 9901", "port_value: 10000", "port_value: 9090", "filename: dist/llmgw.wasm"):
        assert default not in text
    assert f"filename: {(tmp_path / 'llmgw.wasm').resolve()}" in text
    assert "\nstats_flush_interval: 0.2s\nstats_config:" in text
    on_admin = kit.shipped_config(tmp_path / "llmgw.wasm", 1111, 2222, 3333, cfg, stats_flush_on_admin=True)
    assert "\nstats_flush_on_admin: true\nstats_config:" in on_admin and "stats_flush_interval" not in on_admin
    with pytest.raises(ValueError):
        kit.shipped_config(tmp_path / "llmgw.wasm", 1, 2, 3, cfg, stats_flush_interval="1s", stats_flush_on_admin=True)
    value = next(line for line in text.splitlines() if line.strip().startswith("value: \""))
    assert json.loads(json.loads(value.split("value: ", 1)[1])) == cfg
    assert cfg["profiles"][0]["block_size"] == 4 and cfg["profiles"][0]["hash_algo"] == "sha256_cbor"


def test_target_dir_follows_cargo_target_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("CARGO_TARGET_DIR", str(tmp_path / "t"))
    assert kit.target_dir() == tmp_path / "t"
    assert kit.binary_path("llmgw-agent") == tmp_path / "t" / "release" / "llmgw-agent"
    with pytest.raises(FileNotFoundError, match="llmgw-agent not built"):
        kit.built("llmgw-agent")
    (tmp_path / "t" / "debug").mkdir(parents=True)
    (tmp_path / "t" / "debug" / "llmgw-agent").write_text("")
    assert kit.built("llmgw-agent") == tmp_path / "t" / "debug" / "llmgw-agent"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CARGO_TARGET_DIR", "t")  # relative: to the current directory, as cargo reads it
    assert kit.target_dir() == tmp_path / "t"


def live_members(pgid: int) -> list[int]:
    """Processes of group `pgid` that are still running (zombies not counted: an orphan is reaped
    by whatever init the machine has, whenever it does)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


def test_procs_stop_the_whole_process_group(tmp_path):
    with kit.Procs(tmp_path) as procs:
        # A shell with a child of its own.
        p = procs.start(["sh", "-c", "sleep 60 & echo started; wait"], "sh")
        kit.wait_until(lambda: "started" in (tmp_path / "sh.log").read_text(), 10, "the shell")
        assert len(live_members(p.pid)) == 2
    assert p.poll() is not None and not procs.procs
    # SIGKILL reaches the orphaned child asynchronously: on a busy machine it may still be running
    # for a moment after stop() returns (seen once in a full run); without the group kill it would
    # outlive this wait by a minute.
    kit.wait_until(lambda: live_members(p.pid) == [], 5, "the group's last process to end")


def test_wait_until_returns_the_value_and_names_what_timed_out():
    assert kit.wait_until(lambda: 42, 1, "x") == 42
    with pytest.raises(TimeoutError, match=r"waiting for the thing \(last error: boom\)"):
        kit.wait_until(lambda: (_ for _ in ()).throw(OSError("boom")), 0.2, "the thing")


def test_tenants_send_the_same_text_under_their_own_cache_salts():
    from llmgw_testkit.workloads import Conversations, SharedPrefix, as_completion, make_sessions
    shape = SharedPrefix(groups=2, system_words=6, question_words=(2, 4), per_group=12, vocab=50)
    plain = make_sessions(shape, 3, "m", 4)
    salted = make_sessions(SharedPrefix(**{**shape.__dict__, "tenants": 3}), 3, "m", 4)
    assert all("cache_salt" not in s[0] for s in plain)
    salts = {s[0]["cache_salt"] for s in salted}
    assert salts == {"tenant-0", "tenant-1", "tenant-2"}
    # The same system prompt goes out under several tenants' salts: same text, no shared blocks.
    by_system: dict[str, set] = {}
    for s in salted:
        by_system.setdefault(s[0]["messages"][0]["content"], set()).add(s[0]["cache_salt"])
    assert len(by_system) == 2 and all(len(v) > 1 for v in by_system.values())
    conv = make_sessions(Conversations(4, 3, (3, 5), (2, 3), 2, tenants=2), 1, "m", 4)
    assert all(len({b["cache_salt"] for b in c}) == 1 for c in conv), "a conversation keeps its tenant"
    comp = as_completion(salted[0][0])
    assert "messages" not in comp and comp["cache_salt"] == salted[0][0]["cache_salt"]
    assert comp["prompt"].startswith("system: ") and comp["prompt"].endswith("assistant:")


def test_staggered_system_prompts_begin_one_after_another_and_overlap():
    from llmgw_testkit.workloads import SharedPrefix, make_sessions
    shape = SharedPrefix(groups=8, system_words=6, question_words=(2, 4), per_group=24, vocab=50, stagger=0.25)
    sessions = make_sessions(shape, 3, "m", 4)
    order: list[str] = []
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for i, s in enumerate(sessions):
        system = s[0]["messages"][0]["content"]
        if system not in first:
            order.append(system)
            first[system] = i
        last[system] = i
    assert len(order) == 8 and len(sessions) == 8 * 24
    # Each begins before the one begun before it is done (several are asked at a time), the last
    # past the middle of the run, when the first is done.
    assert all(first[b] < last[a] for a, b in zip(order, order[1:]))
    assert first[order[-1]] > len(sessions) // 2 and last[order[0]] < len(sessions) // 2
    # Without the stagger, every prompt is asked from the start.
    plain = make_sessions(SharedPrefix(**{**shape.__dict__, "stagger": None}), 3, "m", 4)
    assert len({s[0]["messages"][0]["content"] for s in plain[:40]}) == 8
    with pytest.raises(ValueError, match="unique prompts"):
        make_sessions(SharedPrefix(**{**shape.__dict__, "unique_words": (2, 3)}), 3, "m", 4)
