#!/usr/bin/env bash
# The GPU checks of a device call, each phase bounded, logs under $1 (default $OUT/gpu_suite):
#   goldens   the CPU reference digests on this host (python -m qualification.goldens and
#             tests/qualification/test_platform_bits.py: the same bits as the CI machines')
#   n4        pytest -m gpu on 4 workers sharing the GPU
#   n4b       the same again (a second order of the same tests)
#   capture   tests/engine/test_capture.py (a collection inside a capture, with and without the pause)
#   serial    pytest -m gpu on one worker
#   gates1    qualify --only lockstep runtime (gate 1b and gate 1 on the kernels)
#   power     python -m qualification.gate1_power --prompts 1 (planted defects through gate 1)
#   powersmall the same for the smallest quantizer-scale errors only (0.01 %, 0.03 %, 0.1 %)
#   moe       python -m benchmarks.exp_moe_rounding (the MoE kernel vs its twin, stage by stage)
#   kcontrols the kernel-level negative controls (compiled)
#   controls  every negative control (python -m negative_controls.run, 4 gate processes)
#   qualify   the full python -m qualification.qualify
#   gate1test the GPU tests of tests/qualification/test_qualification.py (gate 1 on the kernels, missing sink)
# Usage: bash tools/gpu_suite.sh DIR [PHASE ...]   (phases default to: goldens n4)
set -uo pipefail
out=${1:-$OUT/gpu_suite}; shift || true
phases=${*:-goldens n4}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
# the device copy's git metadata can be stale: the caller names the revision it sent
echo "${IQUESTRT_REVISION:-$(git rev-parse HEAD 2>/dev/null)}" > "$out/revision.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1
python -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$out/gpu.txt"
for phase in $phases; do
  start=$(date +%s)
  case $phase in
    goldens)
      timeout 120 python -m qualification.goldens 2>&1 | tee "$out/goldens.log"
      timeout 240 python -m pytest -q -p no:cacheprovider tests/qualification/test_platform_bits.py 2>&1 \
        | tail -15 | tee -a "$out/goldens.log" ;;
    n4)
      timeout 480 python -m pytest -m gpu -n 4 -p no:cacheprovider -q -rfE --timeout 300 --continue-on-collection-errors \
        --benchmark-disable 2>&1 | tee "$out/gpu_n4.log" ;;
    capture)
      timeout 240 python -m pytest -q -p no:cacheprovider tests/engine/test_capture.py 2>&1 \
        | tail -5 | tee "$out/capture.log" ;;
    n4b)
      timeout 480 python -m pytest -m gpu -n 4 -p no:cacheprovider -q -rfE --timeout 300 --continue-on-collection-errors \
        --benchmark-disable 2>&1 | tee "$out/gpu_n4b.log" ;;
    serial)
      timeout 540 python -m pytest -m gpu -p no:cacheprovider -q -rfE --timeout 300 --continue-on-collection-errors \
        --benchmark-disable --durations 15 2>&1 | tee "$out/gpu_serial.log" ;;
    gates1)
      timeout 400 python -m qualification.qualify --only lockstep runtime --out "$out/gates1" \
        2>&1 | tee "$out/gates1.log" ;;
    power)
      timeout 420 python -m qualification.gate1_power --prompts 1 --json "$out/power.json" 2>&1 \
        | tee "$out/power.log" ;;
    powersmall)
      timeout 300 python -m qualification.gate1_power --prompts 1 --scales 1e-4 3e-4 1e-3 \
        --json "$out/power_small.json" 2>&1 | tee "$out/power_small.log" ;;
    controls)
      timeout 590 python -m negative_controls.run --jobs 4 2>&1 | tee "$out/controls.log" ;;
    moe)
      timeout 200 python -m benchmarks.exp_moe_rounding --json "$out/moe.json" 2>&1 \
        | tee "$out/moe.log" ;;
    kcontrols)
      timeout 560 python -m negative_controls.run --only $(python -c "from negative_controls \
        import kernel_controls as k; print(' '.join(m.name for m in k.MUTATIONS))") 2>&1 \
        | tee "$out/kcontrols.log" ;;
    qualify)
      timeout 560 python -m qualification.qualify --out "$out/qualify" 2>&1 \
        | tee "$out/qualify.log" ;;
    gate1test)
      timeout 300 python -m pytest -m gpu -q -p no:cacheprovider -rfE tests/qualification/test_qualification.py \
        2>&1 | tee "$out/gate1test.log" ;;
    *) echo "unknown phase $phase" >&2; exit 2 ;;
  esac
  echo "phase $phase: rc ${PIPESTATUS[0]}, $(( $(date +%s) - start )) s" | tee -a "$out/phases.txt"
done
