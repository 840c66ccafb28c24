#!/usr/bin/env bash
# On a machine with an NVIDIA GPU (Linux, CUDA 12): install mlx[cuda12] into its own
# virtualenv, then run the engine-vs-raw, host-overhead and constrained benches on the
# default model (SmolLM2-135M) and on a ~0.5B random-weight llama with the same
# vocabulary, and print one report (every table under its heading; also in $OUT).
#
#   bash bench/device_check.sh            # OUT=bench-device VENV=.venv-cuda
#   QUICK=1 bash bench/device_check.sh    # fewer rows and repeats (~3 min after install)
#
# Each bench compares against a baseline measured in the same run (the raw
# BatchGenerator, plain rows); name the card beside the numbers in docs/benchmarks.md.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-cuda}
OUT=${OUT:-bench-device}
mkdir -p "$OUT"
if [[ ! -x "$VENV/bin/python" ]]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --upgrade pip
  "$VENV/bin/pip" install --quiet -e '.[dev]' 'mlx[cuda12]'
fi
PY="$VENV/bin/python"
"$PY" - <<'PYEOF' | tee "$OUT/device.txt"
import mlx.core as mx
device = mx.default_device()
print(f"mlx {mx.__version__}, default device: {device}")
if device != mx.gpu:
    raise SystemExit("no GPU for MLX here: mlx[cuda12] did not find a CUDA device")
PYEOF
if [[ -n "${QUICK:-}" ]]; then
  ROWS=1,16; REPEATS=1
else
  ROWS=1,4,16,32; REPEATS=3
fi
small=$("$PY" -m testkit.host_regime_model)
half=$("$PY" -m testkit.host_regime_model --layers 24 --hidden 1280 --heads 20)
run() {  # run NAME COMMAND...: the command's output to $OUT/NAME.txt and the report
  local name=$1; shift
  echo "### $name" | tee "$OUT/$name.txt"
  "$@" 2>&1 | tee -a "$OUT/$name.txt"
  echo
}
default=$("$PY" -c 'from engine.models.default_model import default_model_gguf as g; print(g())')
for model in "$default" "$half"; do
  tag=$([[ $model == "$default" ]] && echo smollm2-135m || echo llama-0.5b)
  run "engine-vs-raw-$tag" "$PY" bench/engine_throughput.py --model "$model" --speculation 0 \
      --concurrency "$ROWS" --repeats "$REPEATS"
  run "host-overhead-$tag" "$PY" bench/host_overhead.py --model "$model" --rows "$ROWS" \
      --repeats "$REPEATS"
  run "constrained-$tag" "$PY" bench/constrained.py --model "$model" --repeats "$REPEATS"
done
run host-overhead-2x128 "$PY" bench/host_overhead.py --model "$small" --rows "$ROWS" \
    --repeats "$REPEATS"
echo "== one report: $OUT/report.md"
cat "$OUT"/device.txt "$OUT"/engine-vs-raw-*.txt "$OUT"/host-overhead-*.txt \
    "$OUT"/constrained-*.txt > "$OUT/report.md"
cat "$OUT/report.md"
