#!/usr/bin/env bash
# Run vLLM 0.33.0's own KV-cache tests twice -- on vLLM itself, then on kvlab through
# kvlab_adapter.py -- and compare. Not part of `make test`: it downloads vLLM's wheel
# (~340 MB) and source archive (~47 MB, which holds the tests) from PyPI, and takes about
# 20 minutes on 2 cores. Three tables: the KV-cache tests (core, events, offload tiers), the
# connectors' unit tests, and the tiers kvlab lacks, each counted apart.
#
#   scripts/vllm_tests/run.sh [WORK_DIR]        (default /tmp/kvlab-vllm-tests)
#
# The tests that pass on vLLM here (CPU only, no compiled extension) are the ones counted.
# Left out of the first table: vLLM's p2p and KVCR tiers (the third table counts them strictly:
# kvlab lacks KVCR, whose tests would otherwise run vLLM's own code), and a test that starts a
# server.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
HERE="$ROOT/scripts/vllm_tests"
WORK=${1:-/tmp/kvlab-vllm-tests}
PY="$ROOT/.venv/bin/python"
mkdir -p "$WORK" && cd "$WORK"

if [ ! -d src/vllm ]; then
  "$PY" -m pip download -q vllm==0.33.0 --no-deps -d whl
  mkdir -p src && (cd src && unzip -q ../whl/vllm-0.33.0-*.whl 'vllm/*')
fi
if [ ! -d vllm-0.33.0/tests ]; then
  url=$("$PY" - <<'PY'
import json, urllib.request
req = urllib.request.Request("https://pypi.org/simple/vllm/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
files = json.load(urllib.request.urlopen(req, timeout=60))["files"]
print(next(f["url"] for f in files if f["filename"] == "vllm-0.33.0.tar.gz"))
PY
)
  curl -sSfL --max-time 600 -o vllm-0.33.0.tar.gz "$url"
  tar xzf vllm-0.33.0.tar.gz vllm-0.33.0/tests
fi

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_TARGET_DEVICE=cpu TRITON_INTERPRET=1
export PYTHONPATH="$WORK/src:$WORK/deps:$WORK/vllm-0.33.0"
cd vllm-0.33.0
TESTS=(tests/v1/core/test_prefix_caching.py tests/v1/core/test_single_type_kv_cache_manager.py
       tests/v1/core/test_kv_cache_utils.py tests/v1/core/prefix_cache tests/distributed/test_events.py tests/v1/kv_offload)
IGNORE=(--ignore=tests/v1/core/prefix_cache/test_hybrid_prefix_cache_hit_rate.py --ignore=tests/v1/kv_offload/tiering/p2p
        --ignore=tests/v1/kv_offload/tiering/test_kvcr_tier.py)

# vLLM's imports that kvlab's environment lacks, installed beside it (never into .venv).
"$PY" -m pip install -q --target "$WORK/deps" --no-deps tblib regex pydantic pydantic-core annotated-types \
  typing-inspection transformers einops opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions \
  partial-json-parser cachetools cbor2 blake3 > /dev/null 2>&1
for _ in $(seq 1 40); do
  missing=$("$PY" -m pytest -q -p no:cacheprovider --collect-only "${TESTS[@]}" "${IGNORE[@]}" 2>&1 \
            | sed -n "s/.*No module named '\([^'.]*\).*/\1/p" | head -1 || true)
  [ -z "$missing" ] && break
  case $missing in yaml) missing=pyyaml;; zmq) missing=pyzmq;; PIL) missing=pillow;; cpuinfo) missing=py-cpuinfo;;
                   tvm_ffi) missing=apache-tvm-ffi;; google) missing=protobuf;; cv2) missing=opencv-python-headless;; esac
  echo "installing $missing (for vLLM)"
  "$PY" -m pip install -q --target "$WORK/deps" --no-deps "$missing" > /dev/null 2>&1
done

run() {  # $1: name, then pytest arguments (the test files come from $SET)
  local name=$1; shift
  echo "== $name"
  timeout 1800 "$PY" -m pytest -q -p no:cacheprovider -n 2 --timeout 120 --timeout-method=thread "$@" "${SET[@]}" \
    --junitxml="$WORK/$name.xml" > "$WORK/$name.log" 2>&1 || true
  tail -1 "$WORK/$name.log"
}
SET=("${TESTS[@]}" "${IGNORE[@]}")
run vllm
rm -f "$WORK"/adapter-report.*  # one file per pytest process: only this run's count
PYTHONPATH="$PYTHONPATH:$HERE:$ROOT" KVLAB_ADAPTER_REPORT="$WORK/adapter-report" run kvlab -p kvlab_adapter
"$PY" "$HERE/compare.py" "$WORK/vllm.xml" "$WORK/kvlab.xml"
echo
echo "vLLM modules loaded under kvlab's packages (their tests are left out above, or fail):"
cat "$WORK"/adapter-report.* 2>/dev/null | sort -u | sed -n 's/^vllm-module /  /p'

# The connectors' unit tests, counted apart: kvlab's offloading connector keeps one group's
# blocks in its own shape, where vLLM's serves every group (its config objects, sliding-window
# and EAGLE lookups, partial tails, a sync-load budget) -- most of these test that machinery.
# These files mix kvlab's parts with parts it lacks (HiSparse's worker half, vLLM's NIXL
# transport), so the adapter runs strict: a module kvlab lacks stands
# empty instead of being loaded from vLLM, and a test passes only on kvlab's code.
SET=(tests/v1/kv_connector/unit/offloading_connector tests/v1/kv_connector/unit/test_offloading_connector.py
     tests/v1/kv_connector/unit/test_hisparse_connector.py tests/v1/kv_connector/unit/test_multi_connector.py
     tests/v1/kv_connector/unit/test_example_connector.py)
echo
run vllm_connectors
PYTHONPATH="$PYTHONPATH:$HERE:$ROOT" KVLAB_ADAPTER_STRICT=1 run kvlab_connectors -p kvlab_adapter
"$PY" "$HERE/compare.py" "$WORK/vllm_connectors.xml" "$WORK/kvlab_connectors.xml"

# vLLM 0.33's P2P tier (built: manager, sessions, control channel, data path) and KVCR tier
# (not built), counted strictly: every module kvlab lacks stands empty, so no test passes on
# vLLM's code. (KVCR's tests skip without its ``kvcr`` library.)
SET=(tests/v1/kv_offload/tiering/p2p tests/v1/kv_offload/tiering/test_kvcr_tier.py)
echo
run vllm_tiers
PYTHONPATH="$PYTHONPATH:$HERE:$ROOT" KVLAB_ADAPTER_STRICT=1 run kvlab_tiers -p kvlab_adapter
"$PY" "$HERE/compare.py" "$WORK/vllm_tiers.xml" "$WORK/kvlab_tiers.xml"
