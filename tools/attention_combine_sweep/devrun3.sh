mkdir -p $OUT/s3
python -m benchmarks.sweep_attention --combine --json $OUT/s3/sweep_attention_combine.json --reps 20 2>&1 | grep -v Warning | tee $OUT/s3/sweep_attention_combine.log
python -m pytest tests/kernels/test_attention.py -q -p no:cacheprovider -m gpu 2>&1 | tail -3 | tee $OUT/s3/gpu_attention_tests.log
R="--contexts 1K 192K --widths 6 --no-adaptive --baseline none --profile key --no-eager"
for rep in 1 2; do
for v in "base" "new 128 4 128 4" "new 32 4 32 4" "new 64 4 64 4"; do
  tag=$(echo $v | tr ' ' _)
  echo "== rep $rep variant $v" | tee -a $OUT/s3/rank.log
  python devrank.py $v --out /tmp/rank_$tag $R 2>&1 | grep "W6:" | tee -a $OUT/s3/rank.log
  mkdir -p /tmp/recs/rec_${tag}_$rep && cp /tmp/rank_$tag/record.json /tmp/recs/rec_${tag}_$rep/
done
done
tar czf $OUT/s3/recs.tgz -C /tmp recs
