#!/usr/bin/env bash
# Run the GPU verification kit on a bare GPU machine (docs/gpu.md): install the wheels carried in
# .whl/ (made here by tools/gpu_wheels.py) into /tmp/site, then run tools/gpu_check.py with its
# JSON, text summary and full log written to $OUT. Extra arguments go to gpu_check.py, e.g.
#   OUT=/tmp/out bash tools/gpu_check_device.sh --checks learner_train,weight_sync_cuda_ipc
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:?set OUT to the output directory}"
mkdir -p "$out"
start=$(date +%s)
shopt -s nullglob
wheels=(.whl/*.whl)
if [ "${#wheels[@]}" -eq 0 ]; then
  echo "gpu_check_device: no wheels in .whl/ (run tools/gpu_wheels.py and carry .whl)" >&2
  exit 2
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site "${wheels[@]}"
echo "gpu_check_device: ${#wheels[@]} wheels installed in $(( $(date +%s) - start )) s"
export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 tools/gpu_check.py --out "$out" "$@" 2>&1 | tee "$out/gpu_check.log"
echo "gpu_check_device: done in $(( $(date +%s) - start )) s"
