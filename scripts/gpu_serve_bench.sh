#!/usr/bin/env bash
# Issue-6 serving benchmark on the GPU machine, in one call: `nvllm serve` on Qwen2.5-7B shapes (random bf16
# weights) and `nvllm bench serve` with ShareGPT prompts at a fixed request rate against it.
#   bash scripts/gpu_serve_bench.sh [RATE] [NUM_PROMPTS]
# Needs: .carry/qwen2.5 (vocab.json + merges.txt) and .carry/sharegpt/ShareGPT_V3_filtered_500.json from
# ../shared/data; FastAPI/uvicorn/pydantic wheels in .whl when the machine lacks them.
set -euo pipefail
RATE=${1:-8}
N=${2:-200}
OUT=${OUT:-.}
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1
MODEL=$(python3 -c "import sys; sys.path.insert(0, 'scripts'); from pathlib import Path; import gpu_bench; print(gpu_bench.build_model_dir(Path('.carry/qwen2.5')))")
python3 -m nvllm.cli serve --model "$MODEL" --served-model-name qwen2.5-7b-dummy --load-format dummy \
  --dtype bfloat16 --max-model-len 4096 --port 8000 --log-stats-interval 10 --uvicorn-log-level warning \
  > "$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 180); do
  curl -sf http://127.0.0.1:8000/health >/dev/null && break
  kill -0 $SERVER 2>/dev/null || { tail -20 "$OUT/server.log"; exit 1; }
  sleep 1
done
READY=$(mktemp)  # its mtime: kernels Triton compiles after this were compiled under live requests
python3 -m nvllm.cli bench serve --base-url http://127.0.0.1:8000 --model qwen2.5-7b-dummy --tokenizer "$MODEL" \
  --dataset sharegpt --dataset-path .carry/sharegpt/ShareGPT_V3_filtered_500.json --num-prompts "$N" \
  --output-len 200 --ignore-eos --request-rate "$RATE" --metric-percentiles 50,90,99 \
  --goodput ttft:200 tpot:20 --save-result "$OUT/serve_bench.json" --no-progress
if [ -n "${TRITON_CACHE_DIR:-}" ]; then
  LATE=$(find "$TRITON_CACHE_DIR" -name '*.json' ! -name '__grp__*' -newer "$READY" | xargs -r -n1 basename | sort)
  echo "Triton kernels compiled after start-up: $(echo -n "$LATE" | grep -c .) ${LATE//$'\n'/ }"
fi
