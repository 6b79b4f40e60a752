# Sourced first in a GPU call (`source tools/gpu_setup.sh`), with .whl/ and .cache/ carried (tools/gpu_carry.sh made
# them): installs the wheels where Python finds them, puts the test tokenizer and the trimmed llama.cpp sdist where
# the tests look, and sets what the runs share (Triton's cache and the mat-vec choices under /tmp, unbuffered output). With
# LLAMA_CPP=1 it also starts building llama-server, llama-bench and llama-quantize in the background
# (about 5 minutes, at the lowest CPU priority so that timings beside it are not disturbed; tools/gpu_check.sh peer
# waits for it).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}
# Triton's cache (compiled kernels, kept autotuning results) and the mat-vec choices under /tmp, which a warm
# machine keeps from one call to the next (the tree's ignored folders seemed not to be: a second call compiled
# again); a cache brought back from an earlier session (.cache/triton-cache.tgz) seeds it
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache} PYTHONUNBUFFERED=1
# Python's bytecode under /tmp: the machine's site-packages hold none and were not written (a start's profile spent
# 12 s compiling the sources of 3,255 imported modules), where a user's installation has it from pip
export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-/tmp/pycache}; unset PYTHONDONTWRITEBYTECODE
# the modules a start imports, turned into bytecode in the background once per machine (about 22 s)
[ -d "$PYTHONPYCACHEPREFIX" ] || (setsid nohup python3 -c "import hf2q.cli, hf2q.server.launch, hf2q.engine.engine, \
  fla.ops.gated_delta_rule, uvicorn, fastapi, transformers" > /dev/null 2>&1 < /dev/null &)
export HF2Q_TUNE_CACHE=${HF2Q_TUNE_CACHE:-$TRITON_CACHE_DIR/hf2q_matvec_configs.json}
if [ ! -d "$TRITON_CACHE_DIR" ] && [ -f .cache/triton-cache.tgz ]; then
  mkdir -p "$TRITON_CACHE_DIR" && tar xzf .cache/triton-cache.tgz -C "$TRITON_CACHE_DIR"
fi
export HF2Q_TEST_CACHE=${HF2Q_TEST_CACHE:-$HOME/.cache/hf2q-tests}
mkdir -p "$HF2Q_TEST_CACHE"
tar xzf .cache/qwen35_tokenizer.tgz -C "$HF2Q_TEST_CACHE"
if [ -f .cache/trained_fixtures.tgz ]; then
  export HF2Q_TRAINED_FIXTURES=$HF2Q_TEST_CACHE/trained-carried
  mkdir -p "$HF2Q_TRAINED_FIXTURES" && tar xzf .cache/trained_fixtures.tgz -C "$HF2Q_TRAINED_FIXTURES"
fi
for sdist in .cache/llama_cpp_python-*.tar.gz; do
  [ -f "$sdist" ] || continue
  cp "$sdist" "$HF2Q_TEST_CACHE/"
  if [ "${LLAMA_CPP:-0}" = 1 ] && [ ! -e /tmp/llama.cpp/build.log ]; then  # not built, nor building
    mkdir -p /tmp/llama.cpp && tar xzf "$sdist" -C /tmp/llama.cpp --strip-components=3 --wildcards '*/vendor/llama.cpp/*'
    (cd /tmp/llama.cpp && setsid nohup nice -n 19 sh -c 'cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
      -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=ON > build.log 2>&1 && cmake --build build \
      -j 10 --target llama-bench llama-quantize llama-server >> build.log 2>&1; echo $? > build.done' > /dev/null 2>&1 &)
  fi
done
# pack_triton_cache FILE: what Triton reads back from its cache (each kernel's metadata and group files, its cubin
# and PTX, kept autotuning results) and the mat-vec choices, for `.cache/triton-cache.tgz` in a later session; the
# intermediate IR is left out, then the PTX too if the archive is over the 16 MiB a returned file may have
pack_triton_cache() {
  local keep=(-type f ! -name '*.source' ! -name '*.ttir' ! -name '*.ttgir' ! -name '*.llir')
  (cd "$TRITON_CACHE_DIR" && find . "${keep[@]}" | tar czf "$1" -T -)
  if [ "$(stat -c %s "$1")" -gt 16000000 ]; then
    (cd "$TRITON_CACHE_DIR" && find . "${keep[@]}" ! -name '*.ptx' | tar czf "$1" -T -)
  fi
  ls -la "$1"
}
# pack_out: a call brings back at most 8 files from $OUT: everything there but the archives and JSON goes into one
# $OUT/logs.tgz (run last)
pack_out() {
  (cd "$OUT" && find . -maxdepth 2 -type f ! -name '*.tgz' ! -name '*.json' | tar czf logs.tgz -T - --remove-files)
  ls "$OUT"
}
