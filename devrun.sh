#!/usr/bin/env bash
# interim device run (not committed)
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi -L
run() { name=$1; lim=$2; shift 2; echo "=== $name: $*"; timeout $lim "$@" > $OUT/$name.txt 2>&1; echo "rc=$?"; tail -${TAILN:-14} $OUT/$name.txt; }
export -f run
"$@"
