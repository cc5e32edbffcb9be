#!/bin/bash
# GPU tests at the working tree (= 637a31f), then rank-round A/B:
# tree (637a31f) vs .mid (6e8ae0c, round scalars) vs .base (06590dc), and MoE-tail chunk variants.
R=$OUT/r; mkdir -p $R; ROOT=$(pwd)
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt
python -c "import torch,triton;print(torch.__version__,triton.__version__)" >> $R/gpu.txt
for t in . .mid .base; do (cd $t && python -m iquestrt.report.provenance 2>&1 | tail -2); done > $R/digests.txt
timeout 170 python -m pytest -q -n 4 tests/kernels/test_row_chunks.py tests/kernels/test_round_scalars.py tests/kernels/test_tails.py tests/kernels/test_round_record.py > $R/t_kernels.log 2>&1; echo kernels rc=$?
timeout 150 python -m pytest -q -n 4 -m gpu tests/engine tests/qualification/test_qualification.py > $R/t_engine.log 2>&1; echo engine rc=$?
ARGS="--widths 6 8 --no-adaptive --contexts 1K 4K --baseline none --no-eager"
python -m benchmarks.rank --out $R/head_prof --widths 6 --no-adaptive --contexts 1K --baseline none --profile key > $R/head_prof.log 2>&1
(cd .base && IQUESTRT_DATA=$ROOT python -m benchmarks.rank --out $R/base_prof --widths 6 --no-adaptive --contexts 1K --baseline none --profile key) > $R/base_prof.log 2>&1
python -m benchmarks.rank --out $R/chunks $ARGS --profile none --launch tails.moe_chunk_groups=4 --launch tails.moe_chunk_groups=2 --launch tails.moe_chunk_groups=8 > $R/chunks.log 2>&1
for i in 1 2; do
  for t in . .mid .base; do
    n=$(basename $t); [ "$t" = . ] && n=head
    (cd $t && IQUESTRT_DATA=$ROOT python -m benchmarks.rank --out $R/${n}_$i $ARGS --profile none) > $R/${n}_$i.log 2>&1
  done
done
tar -czf $OUT/r.tgz -C $OUT r
