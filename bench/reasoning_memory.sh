#!/usr/bin/env bash
# Peak RSS of the reasoning workers (Ray actors) over 100 GRPO steps of the CPU job, with glibc's
# default number of malloc arenas on 2 cores (16) against the 2 that m2flow's actors use.
#   bash bench/reasoning_memory.sh      (~9 min on 2 cores; run on an idle machine)
set -uo pipefail
cd "$(dirname "$0")/.."
out=$(mktemp -d)
for arenas in 16 2; do
  MALLOC_ARENA_MAX=$arenas .venv/bin/m2flow-train --config-name reasoning_arith_grpo_tiny \
    warm_start.steps=0 algorithm.filter_groups=false runner.num_steps=100 runner.eval_interval=0 \
    runner.checkpoint_interval=0 runner.log_dir="$out" runner.progress_bar=false >"$out/$arenas.log" 2>&1 &
  pid=$!; peak=0; peak_r=0
  while kill -0 $pid 2>/dev/null; do
    l=$(pgrep -f "ray::ReasoningLearner" | head -1); r=$(pgrep -f "ray::ReasoningRollout" | head -1)
    [ -n "$l" ] && v=$(ps -o rss= -p "$l" 2>/dev/null) && [ -n "$v" ] && [ "$v" -gt $peak ] && peak=$v
    [ -n "$r" ] && v=$(ps -o rss= -p "$r" 2>/dev/null) && [ -n "$v" ] && [ "$v" -gt $peak_r ] && peak_r=$v
    sleep 2
  done
  echo "MALLOC_ARENA_MAX=$arenas: learner peak RSS $((peak / 1024)) MB, rollout $((peak_r / 1024)) MB; $(grep -o 'done: [^(]*' "$out/$arenas.log")"
done
rm -rf "$out"
