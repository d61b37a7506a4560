#!/usr/bin/env bash
# Issue 35's GPU figures in one session on a lent GPU machine (one GPU, world size 1, NCCL): at most 9 minutes.
#
#   bash benchmarks/device/run_issue35.sh            # through the device tool, from the repository root
#   QUICK=1 bash benchmarks/device/run_issue35.sh    # the same steps on tiny models (a rehearsal, CPU too)
#
# Each step has its own time limit and writes its own files to $OUT (the device tool brings that folder back),
# so a step that runs over loses only itself; copy the JSON files to benchmarks/results/ afterwards. Where the
# machine's torch is below fsdp_compat's range (2.11 on the lent machines), benchmarks/device/torch211 adds the
# two engine names the adapter needs from 2.13, for this run only (PYTHONPATH; never the package).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/fsdp_compat_device_out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/benchmarks/device/torch211${PYTHONPATH:+:$PYTHONPATH}"
quick=()
[ -n "${QUICK:-}" ] && quick=(--quick)

step() {  # step NAME LIMIT_S COMMAND...: run COMMAND under a time limit, its output in $OUT/NAME.txt
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    echo "=== $name (limit ${limit}s): $*"
    timeout "$limit" "$@" >"$OUT/$name.txt" 2>&1
    echo "=== $name: exit $?, $((SECONDS - start)) s"
    tail -n 25 "$OUT/$name.txt"
}

step environment 60 python -c "import torch, fsdp_compat; print('torch', torch.__version__, 'cuda', torch.version.cuda,
    'device', torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')"
nvidia-smi >>"$OUT/environment.txt" 2>&1 || true
# The five configurations, one bench.py run each (most telling first): step time, max_memory_allocated, copies
# per step, the FULL rank0_only state dict with offload_to_cpu, FSDP1 / fsdp_compat / raw fully_shard.
# Limits: the whole script stays under the device tool's 600 s a command (GPT 1.3B for the bf16 ones).
for config_limit in bf16:120 bf16_ac:120 offload_150m:75 fp32_40m:60 bf16_orig:100; do
    config=${config_limit%:*}
    step "configs_$config" "${config_limit#*:}" python benchmarks/bench.py --nproc 1 --configs "$config" --repeats 1 \
        --steps 6 --warmup 2 "${quick[@]}" --json "$OUT/gpu_configs_$config.json"
done
# Host time per phase, both FSDP1-style engines in one process (the GPT 1.3B twice: about 45 GB).
step interleaved_bf16 60 python benchmarks/interleaved.py --config bf16 --rounds 3 --steps 5 --warmup 2 \
    --state-dict-calls 3 "${quick[@]}"
echo "results in $OUT"
