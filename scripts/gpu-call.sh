#!/usr/bin/env bash
# One call of the lent GPU machine (run from the repository root there, $OUT set by the device tool): the GPU
# suite, then the GPU figures in order of priority, each bounded so that the whole call ends inside its budget
# and brings back what finished (a figure cut short loses only itself: results.json is written after each).
#   GPU_CALL_BUDGET_S  seconds for the whole call (default 540; the device tool's limit is 600)
#   GPU_SUITE_S        seconds for the suite (default 240; 0 skips it)
#   GPU_FIGURES        figures in order (default: gpu-loop gpu-input gpu-sharded gpu-compile gpu-checkpoint)
set -u
: "${OUT:?run this through the device tool, which sets OUT}"
deadline=$((SECONDS + ${GPU_CALL_BUDGET_S:-540}))
export PYTHONPATH=. PYTHONUNBUFFERED=1
{ date -u; nvidia-smi; python3 -c "import sys, torch; print(sys.version); print(torch.__version__, torch.version.cuda,
torch.backends.cudnn.version(), torch.cuda.get_device_name(), torch.cuda.nccl.version())"
  python3 -m pip list 2>/dev/null | grep -i -E "^(torch|torchvision|accelerate|lightning|pytest)[ -]"; } >"$OUT/machine.txt" 2>&1
suite_s=${GPU_SUITE_S:-240}
if [ "$suite_s" -gt 0 ]; then
  timeout -k 10 "$suite_s" python3 -m pytest -v -ra -m gpu -p no:cacheprovider tests/gpu -n 8 --timeout=200 \
    --durations=0 --junitxml="$OUT/gpu-suite.xml" >"$OUT/gpu-suite.log" 2>&1
  echo "suite rc=$? after ${SECONDS}s" | tee -a "$OUT/gpu-suite.log"
  grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" "$OUT/gpu-suite.log" | grep -v "^\[gw" | tail -40
fi
# Whatever the suite left running (a test cut short leaves its torchrun, whose workers have sessions of their own)
# would share the GPU with the figures: ended first.
pkill -9 -f "torch.distributed.run|-m trainer|tests.workers" 2>/dev/null
nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | xargs -r kill -9 2>/dev/null
# What each figure takes, a margin added: one that cannot finish in what is left is not started (its partial run
# would be lost anyway). gpu-loop and gpu-checkpoint as the H100 took them (2026-11-25); gpu-input (now 6 runs, was
# 4) and gpu-sharded (now 2 more, profiled) scaled from their H100 lengths; gpu-compile never ran: an estimate.
declare -A needs=([gpu-loop]=220 [gpu-checkpoint]=60 [gpu-sharded]=200 [gpu-input]=210 [gpu-compile]=300)
for figure in ${GPU_FIGURES:-gpu-loop gpu-input gpu-sharded gpu-compile gpu-checkpoint}; do
  left=$((deadline - SECONDS))
  [ "$left" -ge "${needs[$figure]:-60}" ] || { echo "not started: $figure needs about ${needs[$figure]:-60}s, ${left}s left"; continue; }
  echo "== $figure (at most ${left}s), at ${SECONDS}s"
  timeout -k 10 "$left" python3 -m bench.gpu --output-dir "$OUT/bench" --only "$figure" >>"$OUT/gpu-bench.log" 2>&1
  echo "$figure rc=$? at ${SECONDS}s" | tee -a "$OUT/gpu-bench.log"
done
cat "$OUT/bench/results.md" 2>/dev/null | grep -E "^\|" | head -30
