export PYTHONPATH=$PWD
mkdir -p /tmp/site && pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > /dev/null 2>&1
( timeout 270 python -m pytest -q -p no:warnings -rf tests/gpu/test_exact_gpu.py > $OUT/exact.txt 2>&1 ) &
( timeout 270 python -m pytest -q -p no:warnings -rf tests/gpu/test_vlm_gpu.py > $OUT/vlm.txt 2>&1 ) &
wait
echo "== exact"; tail -6 $OUT/exact.txt; echo "== vlm"; tail -6 $OUT/vlm.txt
timeout 120 python benchmarks/profile_step.py --steps 3 > $OUT/profile.txt 2>&1; echo "== profile"; grep "^|" $OUT/profile.txt | head -40
PYTHONPATH=$PWD:/tmp/site timeout 110 python benchmarks/bench_agent.py --device cuda --hidden 1024 --layers 8 --new 128 --prompts 16 --n 8 > $OUT/agent.txt 2>&1; echo "== agent"; tail -12 $OUT/agent.txt
timeout 80 python benchmarks/bench_vlm.py --skip-hf > $OUT/vlm_bench.txt 2>&1; echo "== vlm bench"; tail -6 $OUT/vlm_bench.txt
