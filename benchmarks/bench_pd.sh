#!/usr/bin/env bash
# One layout of the four-GPU disaggregation comparison (issue 45): its servers, `longserve proxy`
# in front (prefill + decode for P/D, a plain relay for the colocated layouts: every layout
# pays the same hop), then `bench_serving.py --workload mixed` through the proxy (the same
# requests at the same times for every layout). Stops every server when done or failed.
#   benchmarks/bench_pd.sh LAYOUT OUT.json [bench_serving.py flags, e.g. --rates 2,4]
# LAYOUT, four GPUs: pd-pcp2-tp2 (producer pcp=2 on GPUs 0-1, consumer tp=2 on 2-3), pd-tp2-tp2,
# tp4, dp2-tp2; two GPUs: pd-tp1-tp1 (producer on GPU 0, consumer on 1), tp2, dp2.
# MODEL (default builtin:llama3-8b-shape), ENGINE (flags for every server) and PRODUCER (flags for
# a P/D producer only, e.g. "--long-prefill-token-threshold 2048"), CONSUMER (a P/D consumer only)
# and PROXY (the proxy's, e.g. "--local-prefill-tokens 4096") from the environment; CONNECT=1: the
# consumer builds its pair groups with the producer at start (kv_connect), not at its first pull.
# The servers' logs go to OUT.log; a consumer's failed pulls show there as "loading the KV".
set -euo pipefail
layout=$1 out=$2
shift 2
MODEL=${MODEL:-builtin:llama3-8b-shape}
read -ra engine <<< "${ENGINE:---load-format dummy --max-model-len 33024}"
read -ra producer_flags <<< "${PRODUCER:-}"
read -ra consumer_flags <<< "${CONSUMER:-}"
read -ra proxy_flags <<< "${PROXY:-}"
export PYTHONPATH="$(cd "$(dirname "$0")/.." && pwd)${PYTHONPATH:+:$PYTHONPATH}"  # this checkout
longserve=(python -m longserve.entrypoints.cli)
serve=("${longserve[@]}" serve "$MODEL" "${engine[@]}" --uvicorn-log-level warning)
producer='{"kv_role": "kv_producer", "kv_lease_s": 120, "kv_port": 8300}'  # (a lease: a pull may
consumer=consumer  # wait behind others' prefills)
[[ ${CONNECT:-0} == 1 ]] && consumer='{"kv_role": "kv_consumer", "kv_connect": ["127.0.0.1:8300"]}'
trap 'kill $(jobs -p) 2>/dev/null; wait' EXIT
exec 3>"${out%.json}.log"
prefill=()
pd() {  # producer GPUs and layout, consumer GPUs and layout
  CUDA_VISIBLE_DEVICES=$1 "${serve[@]}" $2 "${producer_flags[@]}" --port 8100 --kv-transfer-config "$producer" >&3 2>&1 &
  CUDA_VISIBLE_DEVICES=$3 "${serve[@]}" $4 "${consumer_flags[@]}" --port 8200 --kv-transfer-config "$consumer" >&3 2>&1 &
  prefill=(--prefill http://127.0.0.1:8100)
}
colocated() { CUDA_VISIBLE_DEVICES=$1 "${serve[@]}" $2 --port 8200 >&3 2>&1 & }
case $layout in
  pd-pcp2-tp2) pd 0,1 "-pcp 2" 2,3 "-tp 2" ;;
  pd-tp2-tp2) pd 0,1 "-tp 2" 2,3 "-tp 2" ;;
  tp4) colocated 0,1,2,3 "-tp 4" ;;
  dp2-tp2) colocated 0,1,2,3 "-dp 2 -tp 2" ;;
  pd-tp1-tp1) pd 0 "" 1 "" ;;
  tp2) colocated 0,1 "-tp 2" ;;
  dp2) colocated 0,1 "-dp 2" ;;
  *) echo "unknown layout $layout" >&2; exit 2 ;;
esac
"${longserve[@]}" proxy "${prefill[@]}" "${proxy_flags[@]}" --decode http://127.0.0.1:8200 --port 8000 >&3 2>&1 &
started=$(jobs -p | wc -l)
until curl -sf http://127.0.0.1:8000/health >/dev/null; do
  [[ $(jobs -rp | wc -l) == "$started" ]] || { echo "a server exited: see ${out%.json}.log" >&2; exit 1; }
  sleep 2
done
python "$(dirname "$0")/bench_serving.py" --workload mixed --url http://127.0.0.1:8000 --out "$out" "$@" \
  -- --model "$MODEL" "${engine[@]}"
echo "failed pulls (recomputed): $(grep -c 'loading the KV' "${out%.json}.log" || true)"
