#!/usr/bin/env bash
# What to run on a machine with a CUDA GPU, in the repository root, each step under its own
# time limit so that one that hangs leaves the others their time; everything lands in OUT:
#
#   1. the tests that need a GPU (bitsandbytes and torchao configuration, decode steps
#      replayed from CUDA graphs for every architecture of the generality suite);
#   2. a decode step two ways: the model's forward over a DynamicCache and djl-stream's
#      runtime (python -m benchmarks.decode_step --device cuda);
#   3. make bench's run on the GPU (python -m benchmarks.run --device cuda);
#   4. djl-stream beside transformers serve --continuous-batching on the GPU
#      (python -m benchmarks.peers --device cuda --installed: both from this interpreter,
#      whose packages must include transformers' serving extras: fastapi, openai);
#   5. option.quantize's methods on the GPU (python -m benchmarks.quantization --device cuda);
#   6. the tests of servers, isolation and concurrent clients, whose tiny model loads on
#      the GPU where there is one.
#
# STEPS picks some of them, by name (default: all, in this order): tests decode_step bench
# peers quantization server_tests. BENCH_REPETITIONS sets make bench's
# repetitions (default 3), QUANT_METHODS the quantization step's methods (default: all). A lent GPU machine's minutes are few:
#   STEPS="tests bench peers" benchmarks/on_a_gpu.sh OUT
#
# MODEL_DIR is the model served (default: model/). Where its weights cannot be copied to
# the GPU machine, RANDOM_WEIGHTS=1 makes a copy of it with random weights of the same
# shapes (benchmarks/random_weights.py): its speed figures hold, its text means nothing.
#
# Usage: benchmarks/on_a_gpu.sh OUT [MODEL_DIR]
set -u
out=${1:?usage: benchmarks/on_a_gpu.sh OUT [MODEL_DIR]}
model=${2:-model}
python=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

steps=" random_weights ${STEPS:-tests decode_step bench peers quantization server_tests} "

step() {  # step NAME SECONDS COMMAND...: run it (if STEPS names it), its output into OUT/NAME.log
    local name=$1 seconds=$2; shift 2
    case "$steps" in *" $name "*) ;; *) return 0 ;; esac
    echo "== $name ($(date +%T), at most ${seconds} s): $*"
    timeout --kill-after=10 "$seconds" "$@" >"$out/$name.log" 2>&1
    echo "== $name: exit $? at $(date +%T)"
    tail -n 25 "$out/$name.log"
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $python -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
} >"$out/machine.txt" 2>&1
cat "$out/machine.txt"

if [ "${RANDOM_WEIGHTS:-0}" = 1 ]; then
    random=/tmp/djl-stream-random-weights
    step random_weights 120 $python -m benchmarks.random_weights "$model" "$random" --dtype bf16
    model=$random
fi

# The tests read the embedded model's tokenizer from model/; where model/ was not set up
# (its weights and tokenizer are made by make model, which needs the embedded package), they
# read it from the model directory served, which holds the same tokenizer.
[ -f model/config.json ] || export DJL_STREAM_TEST_MODEL_DIR=$model

step tests 240 $python -m pytest -q -p no:cacheprovider tests/test_quantization.py tests/test_cuda_graphs.py
step decode_step 150 $python -m benchmarks.decode_step --model-dir "$model" --device cuda \
    --rows 1,4,16,64 --steps 40 --repetitions 3
step bench 300 $python -m benchmarks.run --model-dir "$model" --device cuda \
    --concurrency 1,4,16,64 --repetitions "${BENCH_REPETITIONS:-3}" --output "$out/BENCHMARKS.md" \
    --plot "$out/concurrency.png"
step peers 240 $python -m benchmarks.peers --model-dir "$model" --device cuda --installed \
    --peers "djl-stream,djl-stream w8a8,transformers serve" \
    --clients 1,4,16 --repetitions 2 --output "$out/peers.md"
step quantization 200 $python -m benchmarks.quantization --model-dir "$model" --device cuda \
    --methods "${QUANT_METHODS:-none,int8,w8a8,bitsandbytes8,bitsandbytes4}" --tokens 16 --steps 24 --repetitions 2 \
    --output "$out/quantization.md"
step server_tests 300 $python -m pytest -q -p no:cacheprovider tests/test_isolation.py \
    tests/test_server_concurrency.py tests/test_server.py
