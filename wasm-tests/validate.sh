#!/usr/bin/env bash
# Validates every shipped Envoy config with the real Envoy binary (which instantiates
# dist/llmgw.wasm and runs its configure step), and checks that an invalid filter
# configuration is refused with a message naming the field.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v envoy >/dev/null || { echo "envoy not on PATH (./build.sh setup installs it into .venv)" >&2; exit 1; }
[ -f dist/llmgw.wasm ] || { echo "dist/llmgw.wasm missing (./build.sh build)" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail=0

for cfg in envoy/*.yaml; do
  if envoy --mode validate -c "$cfg" --log-level warn >"$tmp/out" 2>&1; then
    echo "ok: $cfg validates"
  else
    echo "FAIL: $cfg does not validate:"; cat "$tmp/out"; fail=1
  fi
done

# A bad block size must fail validation, naming the field.
sed 's/"block_size": 16/"block_size": 0/' envoy/llmgw-local.yaml >"$tmp/bad.yaml"
if envoy --mode validate -c "$tmp/bad.yaml" --log-level info >"$tmp/out" 2>&1; then
  echo "FAIL: a config with block_size 0 validated"; fail=1
elif grep -q 'field `profiles\[0\].block_size`' "$tmp/out"; then
  echo "ok: invalid block_size refused: $(grep -o 'invalid llmgw configuration.*' "$tmp/out" | head -1)"
else
  echo "FAIL: refusal does not name the field:"; cat "$tmp/out"; fail=1
fi
exit $fail
