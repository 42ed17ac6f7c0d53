#!/usr/bin/env bash
# The demo: set up, plan the GPT sample for a 2x2 (dp x tp) mesh of local CPU processes,
# inspect the plan, then train 3 steps on 4 gloo processes beside the single-device loss.
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/setup
mkdir -p build
export OMP_NUM_THREADS=1
.venv/bin/autopar plan gpt --config small --cluster cpu --mesh 2x2 --axis-names dp,tp \
  -o build/demo-plan.json
.venv/bin/autopar inspect build/demo-plan.json
.venv/bin/autopar run gpt --config small --nproc 4 --mesh 2x2 --axis-names dp,tp --steps 3 \
  --plan build/demo-plan.json
