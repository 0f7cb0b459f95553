#!/usr/bin/env bash
# The embedded demo: analyze -> apply -> verify -> run on the installed transformers' Qwen3,
# shrunk to a size that runs in seconds on a CPU. Any failing step stops the demo with its
# exit code.
set -euo pipefail
PY=${1:-.venv/bin/python}
OUT=${DEMO_DIR:-demo-out}
MODEL=qwen3
OVERRIDES="num_hidden_layers=4,hidden_size=256,intermediate_size=512,num_attention_heads=4,num_key_value_heads=2,head_dim=64,vocab_size=1024,max_position_embeddings=2048"
KV=("$PY" -m kvskill)

step() {
  local title=$1; shift
  echo
  echo "== $title"
  echo "\$ kvskill $*"
  local rc=0
  "${KV[@]}" "$@" || rc=$?
  if [ $rc -ne 0 ]; then echo "demo: step '$title' failed with exit $rc" >&2; exit $rc; fi
}

step "analyze" analyze "$MODEL" --config-overrides "$OVERRIDES"
step "apply" apply "$MODEL" --mode framework --config-overrides "$OVERRIDES" --out "$OUT" --force
# verify and run check every operator call against the NPU's limits (block size 128; the
# report's "NPU limits" line says what was and was not checked: float32 is a CPU-only
# convenience, so the dtype limits are checked only by the bfloat16 run below)
step "verify" verify "$OUT"
step "run" run "$OUT" --random-weights --num-requests 8 --prompt-len 48 --max-tokens 16 --ignore-eos
step "run (bfloat16: the NPU's dtypes checked too)" run "$OUT" --random-weights --num-requests 2 \
  --prompt-len 16 --max-tokens 4 --ignore-eos --dtype bfloat16
echo
echo "demo: done"
