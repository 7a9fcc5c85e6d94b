#!/bin/bash
# kvchat's GPU checks in one call of the device tool (not run by CI: CI has no GPU).
# Prepare with .ci/gpu/wheels.sh here; on the device, from the repo root, after
# /tmp/cu13.part1 was copied by the call before: `bash .ci/gpu/check.sh`.
# What it runs, most wanted first, each within what is left of LIMIT seconds:
#   doctor; issue 24's table (kvchat serve against mlx_lm.server, 1 and 8 clients);
#   single-stream decode against mlx_lm.generate; cached = uncached replies; the suite
#   (failures with their tracebacks in suite.txt); `kvchat bench --quick` if time is left.
# Everything lands in $OUT (log.txt, conc.json, decode.json, suite.txt, bench.json).
# Here, to try the script itself: LOCAL=1 LIMIT=300 bash .ci/gpu/check.sh
set -u
START=$(date +%s)
LIMIT=${LIMIT:-520}
O=${OUT:-/tmp/gpu-out}
mkdir -p "$O"
exec > >(tee -a "$O/log.txt") 2>&1
left() { echo $((LIMIT - ($(date +%s) - START))); }
say() { echo "== [$(($(date +%s) - START))s] $*"; }
cap() { # cap SECONDS COMMAND...: at most SECONDS, and never past LIMIT
  local t=$1
  shift
  [ "$t" -gt "$(left)" ] && t=$(left)
  [ "$t" -lt 10 ] && { say "no time left for: $*"; return 124; }
  timeout -s INT -k 10 "$t" "$@"
}
export PYTHONUNBUFFERED=1 KVCHAT_CACHE_DIR=/tmp/kvcache
if [ -z "${LOCAL:-}" ]; then
  say install
  W=/tmp/mlx_cuda_13-$(cat .gpu2/mlx-version)-py3-none-manylinux_2_35_x86_64.whl
  cat /tmp/cu13.part1 .gpu2/cu13.part2 > "$W" || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .gpu2/*.whl "$W" || exit 1
  export PYTHONPATH=/tmp/site
  python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . 2>&1 | tail -3
  PY=python3 N=14 MODEL=demo:qwen2.5-0.5b FIRST=340 MAX=128 DEC=256
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
else
  PY=.venv/bin/python N=2 MODEL=demo FIRST=60 MAX=8 DEC=32
fi
KV=("$PY" -c "from kvchat.cli import main; main()")
$PY -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device(), mx.device_info())"
say doctor
KVCHAT_HOME=/tmp/kvh "${KV[@]}" doctor

say "issue 24's table: kvchat serve and mlx_lm.server, 1 and 8 clients, same folder"
cap 180 "$PY" -m kvchat.bench.serve concurrency --model $MODEL --loads 1,8 \
  --first-tokens $FIRST --max-tokens $MAX --rounds 2 > "$O/conc.json"
tail -c 1200 "$O/conc.json"

say "single-stream decode: kvchat ask against mlx_lm generate, alternating"
KVCHAT_HOME=/tmp/kvh cap 75 "$PY" .ci/gpu/decode.py $MODEL $DEC > "$O/decode.json"
cat "$O/decode.json"

say "replies with the cache against without it"
for m in demo $MODEL; do
  for c in cached --no-cache; do
    KVCHAT_HOME=/tmp/kvh cap 30 "${KV[@]}" replay .ci/gpu/replay.json --model $m --max-tokens 32 \
      --json $([ $c = cached ] || echo $c) | "$PY" -c "import json,sys; d=json.load(sys.stdin);\
print('$m $c', [t['reply'] for t in d['turns']], [t['reused_tokens'] for t in d['turns']])"
  done
done

say "suite (-n $N)"
cap $(($(left) - 20)) "$PY" -m pytest -n $N --dist loadfile -q -rfEs --tb=short -p no:cacheprovider \
  --timeout 150 > "$O/suite.txt" 2>&1
say "suite rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed" "$O/suite.txt" | tail -n 80

if [ "$(left)" -gt 60 ]; then
  say "kvchat bench --quick (completes? its figures are not the point here)"
  KVCHAT_HOME=/tmp/kvb cap $(($(left) - 5)) "${KV[@]}" bench --quick --json > "$O/bench.json"
  say "bench rc=$?"
fi
say done
