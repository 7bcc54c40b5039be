#!/usr/bin/env bash
# How the shipped SmolLM2-135M-Instruct head is made and measured, on one host with N GPUs.
# Each phase is bounded in time (resumable tools), so it fits a 10-minute job:
#
#   benchmarks/smollm2_head.sh distil   # the target writes chat prompts, then answers them + the prompt file
#   benchmarks/smollm2_head.sh train    # data-parallel training over every GPU (torchrun)
#   benchmarks/smollm2_head.sh eval     # tau (fp32) on MT-bench and Vicuna-bench, speed (bf16, batch 1)
#
# Environment: DATA (folder with train_prompts.jsonl, mt_bench.jsonl, vicuna_bench.jsonl),
# WORK (run folder, default /root/smol-head), RESULTS (where eval writes its JSON, default WORK/results),
# SELF_PROMPTS (default 24000; 0: none), PROCS_PER_GPU (8), DISTIL_S (seconds for distilling, 420),
# SELF_S (of which writing prompts, default 30%), SEED (0; another SEED writes other prompts and samples
# other answers), TRAIN_S (480), STEPS (1800), BATCH (global, 128), LR (5e-4), VOCAB (draft vocabulary,
# 8192), INIT_HEAD (default: the shipped head), NEW_VOCAB (1: fine-tune INIT_HEAD onto a vocabulary
# chosen from this run's answers), TARGET (default: the embedded SmolLM2), NG (GPUs to use, default:
# all), MAX_NEW (answer tokens, 256), PROMPT_FILE (prompts answered besides the self-written ones, default
# DATA/train_prompts.jsonl; empty: none), PRIOR_RUN (a folder with an earlier distil's prompts.jsonl and
# examples.jsonl, kept ahead of this run's, so the first 16 held-out answers stay the same), EVAL_EXTRA (tree
# configs measured besides the default tree and chains of 3 and 5, e.g. "dynamic:6:8:59"), DRAFT_MLP (the
# head's MLP width, default: INIT_HEAD's; wider than INIT_HEAD's widens it).
set -euo pipefail
cd "$(dirname "$0")/.."
: "${DATA:?set DATA to the folder with the prompt files}"
WORK=${WORK:-/root/smol-head}
RESULTS=${RESULTS:-$WORK/results}
NG=${NG:-$(python3 -c 'import torch; print(torch.cuda.device_count())')}
PP=${PROCS_PER_GPU:-8}
P=$((NG * PP))
E3="python3 -m cli.main"
TARGET=${TARGET:+--target $TARGET}  # default: the embedded SmolLM2
INIT=${INIT_HEAD-hub/heads/smollm2-135m-instruct}  # INIT_HEAD= (empty): a fresh head
INIT=${INIT:+--init-head $INIT}
[ "${NEW_VOCAB:-0}" = 1 ] && INIT="$INIT --new-vocab"
[ -z "${DRAFT_MLP:-}" ] || INIT="$INIT --draft-intermediate-size $DRAFT_MLP"
SEED=${SEED:-0}
mkdir -p "$WORK" "$RESULTS"

wait_all() {  # wait for every background job; fail if any failed
  local rc=0
  for pid in $(jobs -p); do wait "$pid" || rc=1; done
  return $rc
}

distil() {
  local budget=${DISTIL_S:-420} count=${SELF_PROMPTS:-24000}
  [ "$count" -gt 0 ] || SELF_S=0  # SELF_PROMPTS=0: the prompt file alone
  local t_self=${SELF_S:-$((budget * 3 / 10))}
  local t_answer=$((budget - t_self - 20))
  mkdir -p "$WORK/self" "$WORK/shards"
  for i in $(seq 0 $((count > 0 ? P - 1 : -1))); do  # disjoint seeds: attempt k of process i: seed i*10^7 + k
    CUDA_VISIBLE_DEVICES=$((i % NG)) $E3 self-prompts $TARGET --out "$WORK/self/$i.jsonl" --count $((count / P)) \
      --seed $((SEED * 1000000000 + i * 10000000)) --batch 256 --kv-cache-gib 4 --time-limit-s "$t_self" \
      >"$WORK/self/$i.log" 2>&1 &
  done
  wait_all
  cat "$WORK"/self/*.jsonl >"$WORK/self.jsonl" 2>/dev/null || true
  echo "self-written prompts: $(wc -l <"$WORK/self.jsonl")"
  local prompt_file=${PROMPT_FILE-$DATA/train_prompts.jsonl}
  cat ${prompt_file:+"$prompt_file"} "$WORK/self.jsonl" >"$WORK/all_prompts.jsonl"
  python3 - "$WORK/all_prompts.jsonl" "$WORK/shards" "$P" <<'PY'
import sys
lines = open(sys.argv[1]).read().splitlines()
n = int(sys.argv[3])
size = -(-len(lines) // n)
for i in range(n):
    open(f"{sys.argv[2]}/{i}.jsonl", "w").write("".join(l + "\n" for l in lines[i * size:(i + 1) * size]))
PY
  for i in $(seq 0 $((P - 1))); do
    [ -s "$WORK/shards/$i.jsonl" ] || continue
    CUDA_VISIBLE_DEVICES=$((i % NG)) $E3 train-draft $TARGET --generate-only --prompts "$WORK/shards/$i.jsonl" \
      --out "$WORK/shards/run$i" --seed "$SEED" --gen-batch 256 --max-new-tokens "${MAX_NEW:-256}" --kv-cache-gib 6 \
      --time-limit-s "$t_answer" >"$WORK/shards/$i.log" 2>&1 &
  done
  wait_all
  # Answered prefix of every shard, in shard order: the prompt file and examples stay aligned.
  mkdir -p "$WORK/run"
  python3 - "$WORK/shards" "$P" "$WORK/run/prompts.jsonl" "$WORK/run/examples.jsonl" "${PRIOR_RUN:-}" <<'PY'
import os, sys
d, n, prior = sys.argv[1], int(sys.argv[2]), sys.argv[5]
with open(sys.argv[3], "w") as prompts, open(sys.argv[4], "w") as examples:
    if prior:  # an earlier run's answers first, line for line
        ps, ex = (open(f"{prior}/{name}.jsonl").read().splitlines() for name in ("prompts", "examples"))
        assert len(ps) == len(ex), f"{prior}: {len(ps)} prompts but {len(ex)} examples"
        prompts.write("".join(l + "\n" for l in ps))
        examples.write("".join(l + "\n" for l in ex))
        print(f"kept {len(ex)} answers of {prior}")
    total = answered = 0
    for i in range(n):
        if not os.path.exists(f"{d}/{i}.jsonl"):
            continue
        ps = open(f"{d}/{i}.jsonl").read().splitlines()
        path = f"{d}/run{i}/examples.jsonl"
        ex = open(path).read().splitlines() if os.path.exists(path) else []
        prompts.write("".join(l + "\n" for l in ps[:len(ex)]))
        examples.write("".join(l + "\n" for l in ex))
        total, answered = total + len(ps), answered + len(ex)
print(f"answered {answered} of {total} prompts")
PY
}

train() {
  local log="$RESULTS/train.log"
  if ! torchrun --standalone --nproc-per-node "$NG" -m cli.main train-draft $TARGET \
      --prompts "$WORK/run/prompts.jsonl" --out "$WORK/run" $INIT \
      --draft-vocab "${VOCAB:-8192}" --ttt-steps 7 --steps "${STEPS:-1800}" --batch "${BATCH:-128}" --lr "${LR:-5e-4}" \
      --max-new-tokens "${MAX_NEW:-256}" --eval-every 200 --kv-cache-gib 16 --time-limit-s "${TRAIN_S:-480}" \
      2>&1 | tr '\r' '\n' >"$log"; then
    tail -n 30 "$log"
    return 1
  fi
  grep -E "eval:|time limit|resumed|examples" "$log" || true
  grep -E "it/s|s/it" "$log" | tail -n 1
}

evaluate() {
  local head=${HEAD:-$WORK/run/head}
  local tau="--draft $head --max-tokens 256 --batch 80 --dtype float32"
  local tau_gpus=$((NG > 1 ? NG - 1 : 1))  # the last GPU times batch 1 alone (when there are two or more)
  local extra="" c
  for c in ${EVAL_EXTRA:-}; do extra="$extra --config $c"; done
  # no --config: the served default tree, then chains of 3 and 5
  CUDA_VISIBLE_DEVICES=0 $E3 eval-draft $TARGET $tau --prompts "$DATA/mt_bench.jsonl" \
    --out "$RESULTS/tau_mt_bench.json" >"$RESULTS/tau_mt_bench.log" 2>&1 &
  CUDA_VISIBLE_DEVICES=$((1 % tau_gpus)) $E3 eval-draft $TARGET $tau --prompts "$DATA/vicuna_bench.jsonl" \
    --out "$RESULTS/tau_vicuna_bench.json" >"$RESULTS/tau_vicuna_bench.log" 2>&1 &
  [ -z "$extra" ] || CUDA_VISIBLE_DEVICES=$((2 % tau_gpus)) $E3 eval-draft $TARGET $tau --prompts "$DATA/mt_bench.jsonl" \
    $extra --out "$RESULTS/tau_mt_bench_extra.json" >"$RESULTS/tau_mt_bench_extra.log" 2>&1 &
  [ "$NG" -ge 2 ] || { wait_all || { tail -n 20 "$RESULTS"/*.log; return 1; }; }
  CUDA_VISIBLE_DEVICES=$((NG - 1)) $E3 eval-draft $TARGET --draft "$head" --max-tokens 256 --batch 1 --dtype bfloat16 \
    --prompts "$DATA/mt_bench.jsonl" --limit 8 --config chain:3 --config dynamic:7:10:59 \
    --out "$RESULTS/speed_mt_bench_bf16_b1.json" >"$RESULTS/speed_mt_bench_bf16_b1.log" 2>&1 &
  wait_all || { tail -n 20 "$RESULTS"/*.log; return 1; }
  for f in "$RESULTS"/*.log; do echo "== $f"; grep -v "^\[" "$f" | tail -n 8; done
}

case "${1:-}" in
  distil) distil ;;
  train) train ;;
  eval) evaluate ;;
  *) echo "usage: $0 distil|train|eval" >&2; exit 2 ;;
esac
