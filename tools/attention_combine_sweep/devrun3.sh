#!/usr/bin/env bash
# Session 10, call 3 (record: reports/benchmarks/h200-2026-12-01/session10/README.md): the
# attention combine sweep, the GPU attention tests, then benchmarks.rank at 1K/192K W6 for HEAD's
# combine ("base") and three pinned combine configs ("new SBfull Wfull SBring Wring"), two passes.
# Needs, beside this repository: $OUT (output folder) and, for the "base" variant, devbase/ in the
# repository root holding the attention modules of the base revision 1573ba9 (not in the repo):
#   mkdir -p devbase && git show 1573ba9:kernels/attention.py > devbase/attention.py \
#     && git show 1573ba9:kernels/attention_combine.py > devbase/attention_combine.py
# Run from the repository root: bash tools/attention_combine_sweep/devrun3.sh
# (the recorded run invoked devrank.py by its bare name from a folder holding both scripts).
mkdir -p $OUT/s3
python -m benchmarks.sweep_attention --combine --json $OUT/s3/sweep_attention_combine.json --reps 20 2>&1 | grep -v Warning | tee $OUT/s3/sweep_attention_combine.log
python -m pytest tests/kernels/test_attention.py -q -p no:cacheprovider -m gpu 2>&1 | tail -3 | tee $OUT/s3/gpu_attention_tests.log
R="--contexts 1K 192K --widths 6 --no-adaptive --baseline none --profile key --no-eager"
for rep in 1 2; do
for v in "base" "new 128 4 128 4" "new 32 4 32 4" "new 64 4 64 4"; do
  tag=$(echo $v | tr ' ' _)
  echo "== rep $rep variant $v" | tee -a $OUT/s3/rank.log
  PYTHONPATH=. python tools/attention_combine_sweep/devrank.py $v --out /tmp/rank_$tag $R 2>&1 | grep "W6:" | tee -a $OUT/s3/rank.log
  mkdir -p /tmp/recs/rec_${tag}_$rep && cp /tmp/rank_$tag/record.json /tmp/recs/rec_${tag}_$rep/
done
done
tar czf $OUT/s3/recs.tgz -C /tmp recs
