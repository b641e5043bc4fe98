#!/bin/bash
set -u
python3 -m pip install -q --no-deps --no-build-isolation -e . > $OUT/install.log 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpu.txt
timeout -k 10 150 python3 benchmarks/bench_e2e.py --device cuda --layers 8 --per-update --tp 1 --repeats 5 --timeline > $OUT/tl1.log 2>&1; echo "tl1 rc=$?" >> $OUT/gpu.txt
timeout -k 10 150 python3 benchmarks/bench_e2e.py --device cuda --layers 8 --per-update --tp 2 --trainer-etp --formats direct packed --repeats 5 --timeline > $OUT/tl2.log 2>&1; echo "tl2 rc=$?" >> $OUT/gpu.txt
cat $OUT/gpu.txt; grep -v "^trainer" $OUT/tl1.log | sed -E 's/ \| export.*\| update/ | update/' ; grep -v "^trainer" $OUT/tl2.log | sed -E 's/ \| export.*\| update/ | update/'
