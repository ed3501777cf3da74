#!/usr/bin/env bash
# The GPU check of issue 25 on the lent machine, in two device calls one right after the other
# (benchmarks/device_kit.py packs what they carry; its docstring gives the two calls):
#   bash benchmarks/device_check.sh 1   carry .device/call1: small wheels, data, tokenizer; runs bench_device.py
#   bash benchmarks/device_check.sh 2   carry .device/call2: the rest of Ray's wheel; runs the mission's command
#       (run.py --algo tree_grpo --env HotpotQA-v0, every GPU default, Qwen2.5-1.5B's shape with random weights) for 2
#       iterations and gpu_run_summary.py on it (learner device, seconds per phase, busy share, peak), then FSDP at
#       world 1 with 2 micro-batches a step against its plan (bench_learner_sharding.py --gpu)
#   bash benchmarks/device_check.sh precision   carry .device/call1/wheels and .device/call1/models (no Ray): one call,
#       gpu_check.py (a Qwen2.5-1.5B-shape bf16-over-float32 learner step with checkpointing against its memory
#       plan, checkpointing under flex_attention, the offloaded reference), then bench_device.py for SmolLM2-135M's
#       shape (CUDA graphs, tokens/s, busy share, learner steps); sized by CHECK_TIMEOUT and BENCH_TIMEOUT
#   bash benchmarks/device_check.sh engine      carry .device/call1/wheels and .device/call1/models (no Ray): one call,
#       gpu_check.py's fixed-batch learning check (Qwen2.5-1.5B's shape, bf16 over float32 masters), then the
#       rollout engine on SmolLM2-135M's shape at temperature 1 (flat: the sampler's worst case) and 0.05 (about
#       1.4 nats, a trained model's); logs only (8 files come back)
#   bash benchmarks/device_check.sh sharding    carry .device/call1/wheels and .device/call1/models (no Ray): one call,
#       bench_learner_sharding.py --gpu (Qwen2.5-1.5B's shape, DDP and FSDP at world 1; SHARDING_ARGS add options),
#       then the rollout engine at temperature 0.05 with a host cProfile of one more rollout
#   bash benchmarks/device_check.sh engine-ab   carry .device/call1/wheels, .device/call1/models and .device/old (a
#       baseline's tree: git archive REV | tar -x -C .device/old): the engine's CUDA tests, then the rollout engine
#       of the baseline and of this tree on the same machine, per temperature (this tree's with a host profile)
#   bash benchmarks/device_check.sh learn       carry .device/learn (device_kit.py --learn: the CPU demo's cached start
#       and world, a CPU demo's metrics.jsonl and demo.json), right after calls 1 and 2 on the same warm machine (it
#       needs the Ray they install; INSTALL_ONLY=1 makes them install only): experiments/demo.py --no-mlflow
#       --iterations 8 --curve-every 8 (evaluated before and after only) with every GPU default (learner on the GPU, bf16 compute over float32 masters, CUDA-graph
#       decode; issue 63, item 3), nvidia-smi sampled beside it, then gpu_run_summary.py --compare: the run (learner
#       device, seconds per phase, busy share, peak) and held-out exact match before and after with 95% intervals,
#       seconds per phase beside the CPU demo's; sized by LEARN_TIMEOUT; back in $OUT/learn/: learn.md, the demo's
#       summary.md, demo.json, metrics.jsonl, config.yaml, held_out_curve.png, learn.log, gpu_samples.csv
#   bash benchmarks/device_check.sh vllm-part K carry .device/vllmK (device_kit.py --vllm: vLLM 0.26.0's wheel in parts,
#       the wheels it needs beyond the image, SmolLM2's tokenizer): stores it in $KIT/vllm-kit for the last call
#   bash benchmarks/device_check.sh vllm        carry .device/vllmN, the last, right after vllm-part 1 ... N-1 on the
#       same warm machine (issue 63, item 4): stores it, joins vLLM's wheel and checks its sha256, installs every
#       wheel into $KIT/vllm (--no-deps), checks vLLM's requirements against what is installed (vllm_kit.py check),
#       runs the vLLM generator's tests on the GPU (tests/test_vllm.py, -m vllm; those that need Ray skip without
#       it), then the rollout of SmolLM2-135M's shape with random weights on the HF engine and on vLLM, same GPU,
#       same prompts (bench_generation.py --generator hf vllm: tokens/s each); sized by VLLM_TEST_TIMEOUT and
#       VLLM_BENCH_TIMEOUT; back in $OUT: vllm_check.log, vllm_tests.log, generation_vllm.md / .json / .log
# Arguments after the call's name go to bench_device.py / run.py / demo.py / bench_generation.py, after the defaults
# (so they override them).
# What comes back lies in $OUT (the device tool's folder): bench_device_MODEL.md / .log, run_metrics.jsonl, run.log,
# run_summary.md, gpu_samples.csv, fsdp_k2.md / .json, gpu_check.md / .log, learn/.
# Sized to the session's device time by MODELS (call 1's columns, one bench each), BENCH_TIMEOUT (seconds per bench),
# RUN_TIMEOUT (seconds of run.py in call 2) and LEARN_TIMEOUT (seconds of demo.py in the learn call); INSTALL_ONLY=1
# makes calls 1 and 2 install their wheels and nothing more (the learn call's sequence).
set -uo pipefail
KIT=${KIT:-/tmp/treegrpo-kit}  # survives between calls while the machine stays warm (KIT=...: a rehearsal elsewhere)
OUT=${OUT:-$KIT/out}
mkdir -p "$KIT" "$OUT"
export PYTHONPATH=$KIT/site:$PWD PYTHONUNBUFFERED=1 TREEGRPO_CACHE_DIR=$KIT/cache TREEGRPO_DATA_DIR=$KIT/data \
       RAY_AUTH_MODE=disabled
MODELS=${MODELS:-smollm2-135m-random llama-3.2-1b-random}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-270}
RUN_TIMEOUT=${RUN_TIMEOUT:-540}
CHECK_TIMEOUT=${CHECK_TIMEOUT:-200}
LEARN_TIMEOUT=${LEARN_TIMEOUT:-420}
VLLM_TEST_TIMEOUT=${VLLM_TEST_TIMEOUT:-200}
VLLM_BENCH_TIMEOUT=${VLLM_BENCH_TIMEOUT:-240}
INSTALL_ONLY=${INSTALL_ONLY:-0}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"

install_into() {  # wheels into a folder that goes ahead of the image's packages: install_into DIR WHEEL...
  local target=$1
  shift
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$target" "$@"
}

install() {  # wheels into $KIT/site
  install_into "$KIT/site" "$@"
}

store_vllm() {  # a vLLM call's folder into $KIT/vllm-kit (the parts, wheels and tokenizer add up there)
  [ -f "$1/vllm.calls" ] || { echo "$1: not a vLLM call's folder (python benchmarks/device_kit.py --vllm)"; return 1; }
  mkdir -p "$KIT/vllm-kit" && cp -r "$1/." "$KIT/vllm-kit/" && echo "$1 stored ($(cat "$1/vllm.calls") calls in all)"
}

call=${1:-}
shift || true
case "$call" in
1)
  cp .device/call1/ray.whl.0 "$KIT/" || exit 1
  install .device/call1/wheels/*.whl || exit 1
  mkdir -p "$KIT/data" "$KIT/cache/models"
  tar xzf .device/call1/data.tgz -C "$KIT/data" && cp -r .device/call1/models/. "$KIT/cache/models/" || exit 1
  [ "$INSTALL_ONLY" = 1 ] && { echo "call 1: installed (INSTALL_ONLY=1: no bench)"; exit 0; }
  for model in $MODELS; do  # one at a time: a timeout loses only its own table
    timeout "$BENCH_TIMEOUT" python3 benchmarks/bench_device.py --model "$model" --output "$OUT/bench_device_$model.md" "$@" 2>&1 \
      | tee "$OUT/bench_device_$model.log"
  done
  ;;
2)
  [ -f "$KIT/ray.whl.0" ] || { echo "no $KIT/ray.whl.0: call 1 did not run on this machine"; exit 1; }
  cp .device/call2/ray.whl.* "$KIT/" && wheel=$(python3 benchmarks/device_kit.py --join "$KIT" ray) || exit 1
  install "$wheel" || exit 1
  [ "$INSTALL_ONLY" = 1 ] && { echo "call 2: Ray installed (INSTALL_ONLY=1: no run)"; exit 0; }
  # The mission's command as a GPU user runs it, every GPU default and no option added (issue 62): Qwen2.5-1.5B's
  # shape with random weights (the real weights do not fit a call; SmolLM2's tokenizer, the one the kit carries, so
  # the vocabulary is its 49,152 rows), saved as a model dir; nvidia-smi sampled beside it.
  python3 - "$KIT/qwen2.5-1.5b-random" <<'PY' || exit 1
import dataclasses, sys, torch
from benchmarks.bench_learner_sharding import build_model
from policies.model_shape import PRESETS
from policies.models import model_cache_dir, smollm2_tokenizer
tokenizer = smollm2_tokenizer(model_cache_dir())
model = build_model(dataclasses.replace(PRESETS["qwen2.5-1.5b-instruct"], vocab=len(tokenizer)), seed=0)
model.config.bos_token_id, model.config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
model.to(torch.bfloat16).save_pretrained(sys.argv[1]); tokenizer.save_pretrained(sys.argv[1])
PY
  rm -rf "$KIT/run"
  nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader,nounits -lms 500 > "$OUT/gpu_samples.csv" &
  sampler=$!
  timeout "$RUN_TIMEOUT" python3 experiments/run.py --algo tree_grpo --env HotpotQA-v0 --model "$KIT/qwen2.5-1.5b-random" \
    --iterations 2 --no-mlflow --output "$KIT/run" "$@" 2>&1 | tee "$OUT/run.log"
  kill "$sampler"
  cp "$KIT/run/metrics.jsonl" "$OUT/run_metrics.jsonl"
  cp "$KIT/run/config.yaml" "$OUT/run_config.yaml"
  python3 benchmarks/gpu_run_summary.py "$KIT/run" "$OUT/run.log" "$OUT/gpu_samples.csv" --output "$OUT/run_summary.md"
  # FSDP at world 1 with K = 2 micro-batches a step: its peak against the plan
  timeout "$CHECK_TIMEOUT" python3 -m benchmarks.bench_learner_sharding --gpu --shardings fsdp --micro-batches 2 \
    --json "$OUT/fsdp_k2.json" --report "$OUT/fsdp_k2.md" 2>&1 | tee "$OUT/fsdp_k2.log"
  ;;
precision)
  install .device/call1/wheels/*.whl || exit 1
  mkdir -p "$KIT/cache/models" && cp -r .device/call1/models/. "$KIT/cache/models/" || exit 1
  # the precision check first: a run that cannot learn is the worst defect, speed comes second
  timeout "$CHECK_TIMEOUT" python3 benchmarks/gpu_check.py --output "$OUT/gpu_check.md" 2>&1 | tee "$OUT/gpu_check.log"
  timeout "$BENCH_TIMEOUT" python3 benchmarks/bench_device.py --model smollm2-135m-random \
    --output "$OUT/bench_device_smollm2-135m-random.md" "$@" 2>&1 | tee "$OUT/bench_device_smollm2-135m-random.log"
  ;;
engine)
  install .device/call1/wheels/*.whl || exit 1
  mkdir -p "$KIT/cache/models" && cp -r .device/call1/models/. "$KIT/cache/models/" || exit 1
  timeout "$CHECK_TIMEOUT" python3 benchmarks/gpu_check.py --checks learn 2>&1 | tee "$OUT/gpu_learn.log"
  # no profiled rollout: the profiler's teardown outlasted a 100 s timeout on an H100
  for temperature in ${ENGINE_TEMPERATURES:-1.0 0.05}; do
    timeout "$BENCH_TIMEOUT" python3 benchmarks/bench_device.py --model smollm2-135m-random --rollout-only \
      --no-busy-share --temperature "$temperature" "$@" 2>&1 | tee "$OUT/engine_T$temperature.log"
  done
  ;;
sharding)
  install .device/call1/wheels/*.whl || exit 1
  mkdir -p "$KIT/cache/models" && cp -r .device/call1/models/. "$KIT/cache/models/" || exit 1
  timeout "$CHECK_TIMEOUT" python3 -m benchmarks.bench_learner_sharding --gpu --json "$OUT/sharding_gpu.json" \
    --report "$OUT/sharding_gpu.md" ${SHARDING_ARGS:-} 2>&1 | tee "$OUT/sharding_gpu.log"
  timeout "$BENCH_TIMEOUT" python3 benchmarks/bench_device.py --model smollm2-135m-random --rollout-only \
    --no-busy-share --temperature 0.05 --host-profile "$OUT/engine_host_profile.txt" "$@" 2>&1 \
    | tee "$OUT/engine_profiled.log"
  ;;
engine-ab)
  install .device/call1/wheels/*.whl || exit 1
  mkdir -p "$KIT/cache/models" && cp -r .device/call1/models/. "$KIT/cache/models/" || exit 1
  [ -d .device/old/policies ] || { echo "no .device/old: the baseline's tree (git archive REV | tar -x -C .device/old)"; exit 1; }
  timeout "$CHECK_TIMEOUT" python3 -m pytest --noconftest -q -p no:cacheprovider -rs tests/test_ragged_attention.py \
    tests/test_static_decode.py tests/test_kv_cache.py 2>&1 | tee "$OUT/engine_tests.log"
  for temperature in ${ENGINE_TEMPERATURES:-0.05 1.0}; do  # the baseline, then this tree, per temperature
    (cd .device/old && PYTHONPATH=$KIT/site:$PWD timeout "$BENCH_TIMEOUT" python3 benchmarks/bench_device.py \
      --model smollm2-135m-random --rollout-only --no-busy-share --temperature "$temperature" "$@") 2>&1 \
      | tee "$OUT/engine_old_T$temperature.log"
    timeout "$BENCH_TIMEOUT" python3 benchmarks/bench_device.py --model smollm2-135m-random --rollout-only \
      --no-busy-share --temperature "$temperature" --host-profile "$OUT/engine_new_profile_T$temperature.txt" "$@" \
      2>&1 | tee "$OUT/engine_new_T$temperature.log"
  done
  ;;
learn)
  python3 -c "import ray, gymnasium, pydantic" 2>/dev/null \
    || { echo "no Ray here: the learn call runs right after calls 1 and 2 on the same warm machine, which install it" \
              "into $KIT/site (INSTALL_ONLY=1 bash benchmarks/device_check.sh 1, then 2; benchmarks/device_kit.py)"; exit 1; }
  [ -d .device/learn/cache/warm_starts ] \
    || { echo "no .device/learn/cache: python benchmarks/device_kit.py --learn packs it"; exit 1; }
  mkdir -p "$KIT/cache" && cp -r .device/learn/cache/. "$KIT/cache/" || exit 1  # the start and the world, cached
  rm -rf "$KIT/demo" "$OUT/learn" && mkdir -p "$OUT/learn"
  nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader,nounits -lms 500 \
    > "$OUT/learn/gpu_samples.csv" 2>/dev/null &
  sampler=$!
  # the CPU demo's task and start, as a GPU user runs it: no device option, so every GPU default applies
  # (--curve-every 8: held-out exact match before and after only, as the issue asks: each evaluation of the 175
  # held-out questions runs on the machine's CPU, about a minute; --iterations N below 8 needs --curve-every N too)
  timeout "$LEARN_TIMEOUT" python3 experiments/demo.py --no-mlflow --iterations 8 --curve-every 8 \
    --output "$KIT/demo" "$@" 2>&1 | tee "$OUT/learn/learn.log"
  kill "$sampler" 2>/dev/null
  for name in summary.md demo.json metrics.jsonl config.yaml held_out_curve.png; do
    [ -f "$KIT/demo/$name" ] && cp "$KIT/demo/$name" "$OUT/learn/$name"
  done
  compare=()
  [ -f .device/learn/cpu_demo/metrics.jsonl ] && compare=(--compare .device/learn/cpu_demo)
  python3 benchmarks/gpu_run_summary.py "$KIT/demo" "$OUT/learn/learn.log" "$OUT/learn/gpu_samples.csv" \
    ${compare[@]+"${compare[@]}"} --output "$OUT/learn/learn.md"
  ;;
vllm-part)
  store_vllm ".device/vllm${1:?usage: bash benchmarks/device_check.sh vllm-part K}" || exit 1
  ;;
vllm)
  stored=0
  for folder in .device/vllm[0-9]*; do  # the last call's, and any earlier one still in this copy of the tree
    [ -d "$folder" ] && store_vllm "$folder" && stored=1
  done
  [ "$stored" = 1 ] || { echo "no .device/vllmN carried: python benchmarks/device_kit.py --vllm packs them"; exit 1; }
  wheel=$(python3 benchmarks/device_kit.py --join "$KIT/vllm-kit" vllm) || exit 1  # names the parts not stored
  rm -rf "$KIT/vllm"
  install_into "$KIT/vllm" "$KIT"/vllm-kit/wheels/*.whl "$wheel" || exit 1  # one pip: namespace packages merge
  mkdir -p "$KIT/cache/models" && cp -r "$KIT/vllm-kit/models/." "$KIT/cache/models/" || exit 1
  if [ -f "$KIT/vllm-kit/data.tgz" ]; then mkdir -p "$KIT/data" && tar xzf "$KIT/vllm-kit/data.tgz" -C "$KIT/data"; fi
  # vLLM ahead of the rest; FlashInfer is not carried (vllm_kit.OMITTED), so its sampler, vLLM's default, is off;
  # no network there: no hub look-ups, no usage reports
  export PYTHONPATH=$KIT/vllm:$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
         VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
  python3 benchmarks/vllm_kit.py check 2>&1 | tee "$OUT/vllm_check.log"
  python3 -c "import vllm; print('vllm', vllm.__version__, 'from', vllm.__file__)" 2>&1 | tee -a "$OUT/vllm_check.log"
  timeout "$VLLM_TEST_TIMEOUT" python3 -m pytest -v -rs -p no:cacheprovider -m vllm tests/test_vllm.py 2>&1 \
    | tee "$OUT/vllm_tests.log"
  # SynthHop-v0 (bench_device.py's world, generated here), 32 prompts, 128-token steps, bf16: bench_device.py's
  # rollout, so the HF engine's figure can be read against its earlier ones; one untimed rollout of each shape first
  timeout "$VLLM_BENCH_TIMEOUT" python3 benchmarks/bench_generation.py --generator hf vllm \
    --model smollm2-135m-random --env SynthHop-v0 --questions 32 --max-step-tokens 128 --warmup-rollouts 1 \
    --json "$OUT/generation_vllm.json" --output "$OUT/generation_vllm.md" "$@" 2>&1 | tee "$OUT/generation_vllm.log"
  ;;
*)
  echo "usage: bash benchmarks/device_check.sh 1|2|precision|engine|sharding|engine-ab|learn|vllm-part K|vllm" \
       "(see benchmarks/device_kit.py)"; exit 2
  ;;
esac
