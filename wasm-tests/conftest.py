"""Shared fixtures of the end-to-end tests: the built files (found where cargo puts them, see
llmgw_testkit.paths), a process group that stops whatever a test started, and an agent runner
with the tests' default configuration."""

from pathlib import Path

import pytest

import llmgw_testkit as kit


@pytest.fixture(scope="session")
def agent_bin() -> Path:
    return kit.built("llmgw-agent")


@pytest.fixture(scope="session")
def sim_bin() -> Path:
    return kit.built("llmgw-sim")


@pytest.fixture(scope="session")
def wasm_path() -> Path:
    return kit.wasm()


@pytest.fixture(scope="session")
def envoy_bin() -> Path:
    return kit.envoy_bin()


@pytest.fixture
def procs(tmp_path):
    with kit.Procs(tmp_path) as ps:
        yield ps


# The agent tests' configuration unless a test says otherwise: replay answers within 2 s, no
# load scraping, sha256_cbor with seed "0".
AGENT_DEFAULTS = {"zmq": {"replay_timeout_ms": 2000}, "load": {"enabled": False},
                  "hash": {"algo": "sha256_cbor", "seed": "0"}}


@pytest.fixture
def start_agent(procs, agent_bin, tmp_path):
    """start_agent(replicas, wait=True, name=..., launch=..., env=..., **sections) -> kit.Agent,
    `sections` merged over AGENT_DEFAULTS."""
    def start(replicas, wait: bool = True, **kw):
        opts = {k: kw.pop(k) for k in ("name", "launch", "env", "args") if k in kw}
        agent = kit.Agent(procs, agent_bin, tmp_path, replicas, **opts, **kit.merged(AGENT_DEFAULTS, kw))
        return agent.wait_ready() if wait else agent
    return start
