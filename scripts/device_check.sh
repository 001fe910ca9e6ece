#!/usr/bin/env bash
# What a session runs on a lent GPU machine (docs/BENCHMARKS.md, "On a GPU"), in one go:
#   1. correctness: the engine's reference suite on CUDA (transformers on the same GPU), and PD
#      against colocated through the HTTP API with both workers on one GPU (pd_parity), together;
#   2. floor (issue 30): the Triton kernels on CUDA (bfloat16 too), decode and piecewise graphs against
#      --enforce-eager and the CPU path (pytest), then `python -m pdserve.sizing.gpu_floor` on the
#      qwen3-0.6b and qwen3-8b shapes in bfloat16: one table of decode steps at batch 1/16/64/256
#      against the HBM floor, graphs on and --enforce-eager, prefill of 8,192 tokens against peak
#      FLOPs; greedy float32 with graphs against transformers. Alone: STAGES=floor (~6 min);
#   3. timings, alone on the GPU: `pdserve calibrate` step times of qwen3-0.6b and qwen3-8b shapes
#      (random bf16 weights), each step next to the H200 roofline profile the simulator uses;
#   4. the simulator against real runs here: a profile calibrated with the servers' flags, then
#      `pdserve bench compare` (one colocated server, then PD 1+1 sharing the GPU) replayed by
#      `python -m pdserve.sizing.validate_sim`; then again with a profile fitted to the steps the
#      served engines logged (PDSERVE_STEP_LOG, `calibrate --from-step-log`);
#   5. served against offline (issue 29): qwen3-0.6b in bfloat16 at 1, 16 and 64 streams, the engine on a
#      thread of the API server and in its own process (`python -m pdserve.bench.served_vs_offline`).
#   0. review (first, ~3 min): the Triton kernel tests on CUDA (tests/test_triton_*.py: attention, FP8 KV,
#      fused norm/RoPE/SiLU kernels, whichever exist), then the attention kernels alone
#      (`python -m pdserve.bench.gpu_kernels`: split-KV decode in GB/s at head_dim 128, batch 1 and 64 x 4K
#      and 32K, an FP8 pool too; the prefix kernel on a 2,048-token chunk over 16K against SDPA, and on a
#      fresh 2,048-token prompt against causal (flash) SDPA, TFLOPS).
#   0b. steps (after review, ~2-3 min; `python -m pdserve.sizing.gpu_steps STAGE`, random weights built on the
#      GPU): capture of the qwen3-8b and small-moe shapes (decode graphs and piecewise graphs per token
#      bucket: counts, seconds, pool MiB, replay against eager);
#      one replayed decode step at batch 1 and 64 under torch.profiler (kernels per step and per layer, GEMM
#      and other ms, idle gaps, against the HBM floor); long context (1x16K, 64x4K, 16x32K: whole step minus
#      replay = host ms); one mixed step (64 decodes + a 2,048-token chunk) against those decodes alone, and
#      64 decodes + a 448-token chunk from piecewise graphs against the same step eager.
#      One table of them in gpu_steps.md. STAGES=plan is review and steps: the first GPU check (~6 min).
# STAGES picks them (default "review steps correct floor timings validate served"); TIMINGS=0 is STAGES=correct. Every stage has its own time limit; logs and profiles go to $OUT (default ./device-out).
# Python packages the machine lacks travel as wheels in ./.whl (docs/BENCHMARKS.md says which).
set -u
out=${OUT:-device-out}
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PDSERVE_CACHE_DIR=/tmp/pdserve-cache
ck=/tmp/pdserve-ck

# The whole script ends within BUDGET_S (one device call runs 600 s at most; STAGES=plan, the first
# check, 360 s): each stage's limit is cut to what is left, less the 10 s a killed stage may take to go,
# and a stage with under 15 s left is skipped, so the summary always prints before the call ends.
budget=${BUDGET_S:-$([ "${STAGES:-}" = plan ] && echo 360 || echo 570)}
deadline=$budget  # NOTE: SECONDS counts from the script's start: the wheels' install above is in it
# what is left, less the 10 s a killed command may take; never 0 (`timeout 0` is no limit at all)
left() { local l=$((deadline - SECONDS - 10)); echo $((l > 1 ? l : 1)); }

stage() {  # stage NAME LIMIT_S COMMAND...: its output to $out/NAME.log, its tail and status here
  local name=$1 limit=$2 start=$SECONDS rc
  shift 2
  if (($(left) < 15)); then
    echo "| $name | skipped: budget spent | 0 | $limit |" >>"$out/summary.md"
    echo "=== $name: skipped, ${budget} s budget spent"
    return 0
  fi
  ((limit > $(left))) && limit=$(left)
  timeout -k 10 "$limit" "$@" >"$out/$name.log" 2>&1
  rc=$?
  echo "| $name | $rc | $((SECONDS - start)) | $limit |" >>"$out/summary.md"
  echo "=== $name: status $rc after $((SECONDS - start)) s (limit $limit s)"
  tail -n "${TAIL:-25}" "$out/$name.log"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
timeout -k 5 "$(left)" python3 -m pdserve.cli make-model "$ck/qwen3-0.6b" --preset qwen3-0.6b --device cuda >/dev/null \
  || exit 1
stages=${STAGES:-review steps correct floor timings validate served}
[ "${TIMINGS:-1}" = 1 ] || stages=correct
stages=${stages/plan/review steps}
has() { [[ " $stages " == *" $1 "* ]]; }
printf '| stage | status | s | limit s |\n|---|---|---|---|\n' >"$out/summary.md"

# NOTE: before the 8B checkpoint is written in the background: the GPU is this stage's alone
if has review; then
TAIL=30 stage triton-kernels-cuda 150 python3 -m pytest -q -p no:cacheprovider -rfs tests/test_triton_*.py
TAIL=20 stage gpu-kernels 150 python3 -m pdserve.bench.gpu_kernels --save "$out/gpu_kernels.json"
fi

# NOTE: each step stage builds its model on the GPU in its own process (no checkpoint), under its own limit
if has steps; then
TAIL=8 stage steps-capture 90 python3 -m pdserve.sizing.gpu_steps capture --save "$out/steps-capture.json"
TAIL=8 stage steps-profile 75 python3 -m pdserve.sizing.gpu_steps profile --save "$out/steps-profile.json"
TAIL=8 stage steps-long 105 python3 -m pdserve.sizing.gpu_steps long --save "$out/steps-long.json"
TAIL=8 stage steps-mixed 90 python3 -m pdserve.sizing.gpu_steps mixed --save "$out/steps-mixed.json"
summary_s=$(left)
((summary_s > 20)) && summary_s=20
timeout -k 5 "$summary_s" python3 -m pdserve.sizing.gpu_steps summary "$out"/steps-{capture,profile,long,mixed}.json \
  >"$out/gpu_steps.md" 2>&1
fi

maker=
if (has timings || has floor) && (($(left) >= 15)); then
  timeout -k 5 "$(left)" python3 -m pdserve.cli make-model "$ck/qwen3-8b" --preset qwen3-8b --device cuda \
    >"$out/make-8b.log" 2>&1 &
  maker=$!
fi

if has correct; then
TAIL=30 stage pytest-cuda "${PYTEST_LIMIT:-300}" python3 -m pytest -q -p no:cacheprovider --maxfail=5 -rfs \
  tests/test_correctness.py tests/test_pd_engine.py tests/test_sampling.py tests/test_kv_dtype.py \
  tests/test_pd_cluster.py::test_pd_cluster_matches_colocated &
tests=$!
stage pd-parity 200 python3 -m pdserve.bench.pd_parity --model "$ck/qwen3-0.6b" --device cuda --dtype bfloat16 \
  --gpu-memory-utilization 0.35 --max-tokens 32 --ttft-requests 30 --save "$out/pd_parity.json"
wait $tests
fi
wait $maker

if has floor; then
TAIL=40 stage kernels-cuda 180 python3 -m pytest -q -p no:cacheprovider -rfs tests/test_triton_attention.py \
  tests/test_cuda_graphs.py tests/test_piecewise_graphs.py
TAIL=30 stage floor 420 python3 -m pdserve.sizing.gpu_floor --model "$ck/qwen3-0.6b" --model "$ck/qwen3-8b" \
  --device cuda --dtype bfloat16 --compare-device H200 --batches 1,16,64,256 --context 256 --prefill-tokens 8192 \
  --greedy-check --save "$out/floor.json"
fi

if has timings; then
# NOTE: --served-requests 0: the steps timed alone, no served PD run (no PD path costs in these profiles)
grid=(--transports '' --served-requests 0 --compare-device H200 --max-num-seqs 256 --max-num-batched-tokens 8192
      --prefill-tokens 128,512,2048,8192 --decode-batches 1,16,64,256 --device cuda --dtype bfloat16)
TAIL=40 stage calibrate-qwen3-0.6b 120 python3 -m pdserve.cli calibrate --model "$ck/qwen3-0.6b" "${grid[@]}" \
  --out "$out/h200-qwen3-0.6b.json"
TAIL=40 stage calibrate-qwen3-8b 180 python3 -m pdserve.cli calibrate --model "$ck/qwen3-8b" "${grid[@]}" \
  --out "$out/h200-qwen3-8b.json"
fi

if has validate; then
flags=(--model "$ck/qwen3-0.6b" --device cuda --dtype bfloat16 --max-num-seqs 256 --gpu-memory-utilization 0.35)
TAIL=12 stage validate-calibrate 150 python3 -m pdserve.cli calibrate "${flags[@]}" --max-num-batched-tokens 2048 \
  --transports tcp --prefill-tokens 64,256,1024 --decode-batches 1,8,32,64 --served-requests 0 \
  --out "$out/validate-profile.json"
# NOTE: every served engine logs its steps (PDSERVE_STEP_LOG): the profile fitted to them (validate-fit) has
# the step costs as served (the API server sharing the process, the GIL), which timing steps alone misses
PDSERVE_STEP_LOG="$out/steps-1p1d" TAIL=30 stage validate-runs 300 python3 -m pdserve.cli bench compare --systems colocated-chunked,pd --prefill 1 \
  --decode 1 --engine-args "${flags[*]}" --max-num-batched-tokens 2048 --skip-capacity --no-progress \
  --workload seed-mix --scale "${VALIDATE_SCALE:-0.2}" --num-prompts "${VALIDATE_PROMPTS:-200}" \
  --max-concurrency "${VALIDATE_CONCURRENCY:-32}" --save "$out/validate.json"
PDSERVE_STEP_LOG="$out/steps-1p2d" TAIL=12 stage validate-runs-1p2d 200 python3 -m pdserve.cli bench compare --systems pd --prefill 1 --decode 2 \
  --engine-args "${flags[*]/0.35/0.25}" --max-num-batched-tokens 2048 --skip-capacity --no-progress \
  --workload seed-mix --scale "${VALIDATE_SCALE:-0.2}" --num-prompts "${VALIDATE_PROMPTS:-200}" \
  --max-concurrency "${VALIDATE_CONCURRENCY:-32}" --save "$out/validate12.json"
TAIL=20 stage validate-sim 120 python3 -m pdserve.sizing.validate_sim --profile "$out/validate-profile.json" \
  --transport tcp --max-num-seqs 256 --max-num-batched-tokens 2048 --run "colocated:1=$out/validate.colocated-chunked.json" \
  --run "pd:1:1=$out/validate.pd.json" --run "pd:1:2=$out/validate12.pd.json" --save "$out/validation.json"
TAIL=12 stage validate-fit 120 python3 -m pdserve.cli calibrate "${flags[@]}" --max-num-batched-tokens 2048 \
  --transports tcp --from-step-log "$out/steps-1p1d" "$out/steps-1p2d" --out "$out/validate-served-profile.json"
TAIL=20 stage validate-sim-served 120 python3 -m pdserve.sizing.validate_sim \
  --profile "$out/validate-served-profile.json" --transport tcp --max-num-seqs 256 --max-num-batched-tokens 2048 \
  --run "colocated:1=$out/validate.colocated-chunked.json" --run "pd:1:1=$out/validate.pd.json" \
  --run "pd:1:2=$out/validate12.pd.json" --save "$out/validation-served.json"
fi

if has served; then
for streams in 1 16 64; do
  TAIL=8 stage "served-vs-offline-$streams" 150 python3 -m pdserve.bench.served_vs_offline --model "$ck/qwen3-0.6b" \
    --device cuda --dtype bfloat16 --num-kv-blocks 4096 --num-requests "$((streams * 2))" --concurrency "$streams" \
    --input-len 128 --output-len 128
done
fi
nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
if [ -s "$out/gpu_steps.md" ]; then echo "=== steps (gpu_steps.md)"; cat "$out/gpu_steps.md"; fi
echo "=== stages (summary.md)"
cat "$out/summary.md"
