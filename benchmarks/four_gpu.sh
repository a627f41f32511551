#!/usr/bin/env bash
# The four-GPU rows of the open issues, a part per device call (each fits the 10-minute limit):
#   benchmarks/four_gpu.sh PART OUT_DIR
# PART: pcp      issue 42: 128K prefill, chunks 8,192 and 32,768: 1, pcp4, tp4, pcp2xtp2
#       decode   issue 44: 128K decode, batch 1: 1, tp4, pcp4, pcp2xtp2, tp4xdcp2; one KV head
#                64 x 32K: tp4 against tp4 x dcp4
#       moe      issue 43: 12-layer MoE at batch 128 and 512: tp4, dp4 + EP (+ DBO)
#       startup  issue 41: tp4 and MoE tp4, warm, 0 compiles after ready
#       served   issue 42: a 128K prompt arriving while 32 requests decode, a pcp4 and a tp4 server:
#                its TTFT, the decoders' ITL p99 while it prefills against their p50
#       moe-profile  issue 43: every rank's timeline of three decode steps at batch 512, tp4 and
#                dp4 + EP (LONGSERVE_TRACE: where the host's step goes)
#       profile  issue 42: where 8K chunks' steps go at pcp4 and on one GPU, every rank's timeline
#                (LONGSERVE_TRACE; read by trace_gaps.py: cuDNN's per-shape builds, collectives, skew)
#       pd-tests issue 45: the P/D engine tests over NCCL (every layout: producer on GPUs 0-1, the
#                test's engines on 2-3, float32); pd-tests2: on two GPUs (producer on 0, the test's
#                engines on 1), the cases of one GPU a side (no layout case, no DCP consumer)
#       pd-transfer  issue 45: the raw transfer against a plain copy, the handover (+ its traces)
#       allreduce  issue 44: NCCL against symmetric memory (one-/two-shot) at four ranks in CUDA graphs,
#                and the ALGORITHMS[4] row of distributed/symm_all_reduce.py those times give
#       cmp-LAYOUT  issue 45: one bench_pd.sh layout of the mixed-workload comparison (cmp-tp4,
#                cmp-dp2-tp2, cmp-pd-pcp2-tp2, cmp-pd-tp2-tp2; rates $PD_RATES, default 3,5; bench_pd.sh
#                reads PRODUCER, CONSUMER, PROXY (e.g. "--local-prefill-tokens 4096") and CONNECT)
# Each run's log goes to OUT_DIR/PART-*.log; its tables are printed at the end, and OUT_DIR is packed
# into OUT_DIR.tgz (the lent machines return 8 files of $OUT: give an OUT_DIR outside it, copy the .tgz).
set -uo pipefail
part=$1 out=$2
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# the lent machines keep no bytecode for their site-packages (every process compiled the modules it
# imported: `from longserve import LLM` 4.0 s, cold and warm alike): cache it where a user's would be
export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-/tmp/longserve-pycache}
cd "$(dirname "$0")"
cap=(python bench_capacity.py --tokens 131072 --bw 4.8e12 --fail-on-compile)
case $part in
  pcp)
    for chunk in 8192 32768; do
      "${cap[@]}" --layouts 1,pcp4,tp4,pcp2xtp2 --chunk "$chunk" --decode 8 > "$out/pcp-$chunk.log" 2>&1
    done ;;
  decode)
    "${cap[@]}" --layouts 1,tp4,pcp4,pcp2xtp2,tp4xdcp2 --chunk 32768 --decode 48 > "$out/decode.log" 2>&1
    for layout in "--tp 4" "--tp 4 --dcp 4"; do
      # shellcheck disable=SC2086
      python bench_capacity.py --model builtin:llama3-8b-1kv-shape --batch 64 --tokens 32000 --pcp 1 \
        $layout --chunk 32768 --decode 32 --bw 4.8e12 >> "$out/decode-1kv.log" 2>&1
    done ;;
  moe)
    for args in "--tp 4" "--dp 4 --ep" "--dp 4 --ep --dbo"; do
      # shellcheck disable=SC2086
      python bench_dp.py --mode moe --num-layers 12 --input-len 256 --output-len 64 --bw 4.8e12 \
        --batches 128 512 $args >> "$out/moe.log" 2>&1
    done ;;
  startup)
    python bench_startup.py --runs tp4:qwen3-0.6b-shape tp4:qwen3-30b-a3b-shape --repeat 2 \
      > "$out/startup.log" 2>&1 ;;
  served)
    for layout in "-pcp 4" "-tp 4"; do
      # shellcheck disable=SC2086
      python bench_serving.py --workload long-under-decode --short-num 32 --short-len 1024 --long-num 1 \
        --long-len 131072 --output-len 1024 --rates inf --skip-offline --fail-on-compile --client-procs 4 \
        --out "$out/served$(echo "$layout" | tr -d ' -').json" -- --model builtin:llama3-8b-shape \
        --load-format dummy --max-model-len 140000 $layout ${SERVED_FLAGS:-} >> "$out/served.log" 2>&1
    done ;;
  moe-profile)
    for args in "--tp 4" "--dp 4 --ep"; do
      tag=$(echo "$args" | tr -d ' -')
      # steps 70-72: past the engine's warm-up, the warm-up generate and the prompts' chunks
      # shellcheck disable=SC2086
      LONGSERVE_TRACE="$out/moe-$tag:70:3" python bench_dp.py --mode moe --num-layers 12 --input-len 256 \
        --output-len 64 --bw 4.8e12 --batches 512 $args > "$out/moe-profile-$tag.log" 2>&1
      python trace_skew.py "$out/moe-$tag" >> "$out/moe-profile-$tag.log" 2>&1
      for f in "$out/moe-$tag"/rank*.json; do
        python trace_gaps.py "$f" > "${f%.json}.txt" 2>&1 && gzip -f "$f"
      done
    done ;;
  profile)
    for layout in "--pcp 4" "--pcp 1"; do
      tag=$(echo "$layout" | tr -d ' -')
      # every rank's steps 16-18 (the start-up's ~8 warm-up steps, then 8K chunks at a ~64-88K prefix)
      # shellcheck disable=SC2086
      LONGSERVE_TRACE="$out/$tag:16:3" python bench_capacity.py --tokens 131072 --chunk 8192 --decode 4 \
        $layout > "$out/profile-$tag.log" 2>&1
      python trace_skew.py "$out/$tag" >> "$out/profile-$tag.log" 2>&1
      for f in "$out/$tag"/rank*.json; do
        python trace_gaps.py "$f" > "${f%.json}.txt" 2>&1 && gzip -f "$f"
      done
    done ;;
  pd-tests)
    (cd .. && LONGSERVE_TEST_PD_DEVICE=cuda LONGSERVE_TEST_PRODUCER_GPUS=0,1 CUDA_VISIBLE_DEVICES=2,3 \
      timeout 540 python -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kv_disagg.py) \
      > "$out/pd-tests.log" 2>&1 ;;
  pd-tests2)
    (cd .. && LONGSERVE_TEST_PD_DEVICE=cuda LONGSERVE_TEST_PRODUCER_GPUS=0 CUDA_VISIBLE_DEVICES=1 \
      timeout 540 python -m pytest -v -p no:cacheprovider -o addopts="" -k "not layouts and not empty_shard" \
      tests/test_kv_disagg.py) > "$out/pd-tests2.log" 2>&1 ;;
  allreduce)
    python bench_allreduce.py > "$out/allreduce.log" 2>&1 ;;
  pd-transfer)
    CUDA_VISIBLE_DEVICES=0,1 python bench_kv_transfer.py --mode raw > "$out/pd-transfer.log" 2>&1
    CUDA_VISIBLE_DEVICES=0,1 python bench_kv_transfer.py --mode engine --requests 3 --connect-eagerly \
      --profile "$out/pd-prof" >> "$out/pd-transfer.log" 2>&1
    gzip -f "$out"/pd-prof/*.json ;;
  cmp-*)  # bench_pd.sh writes the servers' logs to $part.log
    ./bench_pd.sh "${part#cmp-}" "$out/$part.json" --rates "${PD_RATES:-3,5}" --client-procs 4 \
      > "$out/$part-bench.log" 2>&1 ;;
  *) echo "PART: pcp, decode, moe, startup, served, profile, moe-profile, pd-tests(2), pd-transfer, allreduce or cmp-LAYOUT" >&2; exit 2 ;;
esac
tail -n 12 "$out"/"$part"*.log
tar czf "${out%/}.tgz" -C "$out" .
