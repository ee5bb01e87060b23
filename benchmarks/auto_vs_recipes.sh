#!/bin/bash
# usage: benchmarks/auto_vs_recipes.sh OUT   (README "Session 30": fresh profiles of 2, 4 and 2x2
# gloo ranks, the nine auto-vs-recipes rows under the timing lock, then the pooled tables)
cd "$(dirname "$0")/.."
[ -f .venv/bin/activate ] && source .venv/bin/activate
export OMP_NUM_THREADS=1 PYTHONPATH=.
L=/tmp/autopar-timing.lock
O=$1; mkdir -p $O
for spec in "2 a0=2 2" "4 a0=4 4" "2x2 a0=2,a1=2 4"; do
  set -- $spec
  echo "calibrate $1 $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
  flock -x $L python -m autopar calibrate --mesh $2 --nproc $3 --out $O/p_$1.json > $O/cal_$1.log 2>&1
done
for m in mlp gpt llama; do
  echo "world 2 $m $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
  flock -x $L python benchmarks/cost_model.py --world 2 --models $m --no-ops --reps 3 --steps 4 --recipes ddp,megatron,fsdp --profile 2=$O/p_2.json --out $O/c2_$m > $O/c2_$m.log 2>&1
  echo "world 4 $m $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
  flock -x $L python benchmarks/cost_model.py --world 4 --models $m --no-ops --reps 3 --steps 4 --recipes ddp,megatron,fsdp,fsdp+tp --profile 4=$O/p_4.json --profile 2x2=$O/p_2x2.json --out $O/c4_$m > $O/c4_$m.log 2>&1
done
python benchmarks/cost_model.py --tables-from $O/c*/cost_model.json > $O/tables.md 2>&1
echo done $(date +%T)
