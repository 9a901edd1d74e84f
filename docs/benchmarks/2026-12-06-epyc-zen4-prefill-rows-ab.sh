#!/bin/bash
# A/B: the same server code, prefill in the decoding passes (--prefill-rows 64) or in passes of its own (0)
cd "$(git rev-parse --show-toplevel)"
PY=.venv/bin/python
mkdir -p runs
$PY -m infer.serve --port 8401 --prefill-rows 0 --prefix-memory 0 > runs/ab-s0.log 2>&1 &
P0=$!
$PY -m infer.serve --port 8402 --prefill-rows 64 --prefix-memory 0 > runs/ab-s64.log 2>&1 &
P64=$!
for i in $(seq 1 120); do
  curl -s http://127.0.0.1:8401/v1/models > /dev/null && curl -s http://127.0.0.1:8402/v1/models > /dev/null && break
  sleep 2
done
for round in 1 2 3; do
  if [ $((round % 2)) = 1 ]; then order="url=http://127.0.0.1:8401,url=http://127.0.0.1:8402"; else order="url=http://127.0.0.1:8402,url=http://127.0.0.1:8401"; fi
  $PY -m infer.load --servers $order --concurrency 1 --long-prompt ${WORDS:-1500} \
      --prompts docs/benchmarks/prompts/heldout-serve.jsonl --limit 8 --max-tokens 64 \
      --json runs/ab-round$round.json > runs/ab-round$round.log 2>&1
done
kill $P0 $P64; wait
echo finished
