#!/usr/bin/env bash
# Builds llama.cpp (llama-server, llama-bench, llama-quantize, llama-lookup and
# llama-speculative-simple) from the sources vendored in the llama-cpp-python sdist, for the
# side-by-side comparisons of bench_engine.py (INT8 vs Q8_0), bench_serving.py (HTTP vs
# llama-server) and bench_speculative.py (n-gram drafts vs llama.cpp's model-free speculation:
# llama-lookup's n-gram cache and ngram-simple), and writes Q8_0 and BF16 GGUFs of the embedded SmolLM2
# next to it (requantized from the Q4_1 GGUF our default model is imported from, so both engines
# run the same weights). Nothing it makes is committed, shipped or used by the runtime.
#
#   benchmarks/build_llama_cpp.sh /tmp/llama.cpp        # a long build on a machine with few cores
#   LLAMA_CPP_ISA=avx2 benchmarks/build_llama_cpp.sh /tmp/llama.cpp-avx2
#
# By default ggml is built for this CPU (GGML_NATIVE). LLAMA_CPP_ISA=avx2 builds its AVX2 + FMA +
# F16C kernels only, to compare with our AVX2 tier (KUNLUN_CPU_ISA=avx2) on an AVX-512 machine.
#
# GCC 12 builds a ggml whose AMX path dies with "Illegal instruction" unless the CPU backend is
# compiled with -fno-tree-dse -fno-dse (a known compiler issue), so every file gets those flags.
set -euo pipefail

out=${1:?usage: benchmarks/build_llama_cpp.sh OUT_DIR}
version=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
python=${PYTHON:-.venv/bin/python}
flags="-fno-tree-dse -fno-dse"

mkdir -p "$out"
out=$(cd "$out" && pwd)
"$python" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$out"
tar -xzf "$out/llama_cpp_python-$version.tar.gz" -C "$out"
src="$out/llama_cpp_python-$version/vendor/llama.cpp"
case "${LLAMA_CPP_ISA:-native}" in
  native) isa_flags="-DGGML_NATIVE=ON" ;;
  avx2) isa_flags="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF" ;;
  *) echo "LLAMA_CPP_ISA must be native or avx2" >&2; exit 2 ;;
esac
# shellcheck disable=SC2086  # isa_flags holds several arguments
cmake -S "$src" -B "$out/build" -DCMAKE_BUILD_TYPE=Release $isa_flags -DLLAMA_CURL=OFF \
  -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON \
  -DCMAKE_C_FLAGS="$flags" -DCMAKE_CXX_FLAGS="$flags" >"$out/configure.log" 2>&1
cmake --build "$out/build" -j"$(nproc)" \
  --target llama-server llama-bench llama-quantize llama-lookup llama-speculative-simple >"$out/build.log" 2>&1

gguf=$("$python" -c 'from kunlun_runtime.models.default_model import default_model_gguf; print(default_model_gguf())')
for format in Q8_0 BF16; do
  "$out/build/bin/llama-quantize" --allow-requantize "$gguf" "$out/smollm2-$format.gguf" "$format" >>"$out/quantize.log" 2>&1
done

echo "built; compare with:"
echo "  LLAMA_BENCH=$out/build/bin/llama-bench LLAMA_BENCH_GGUF=$out/smollm2-Q8_0.gguf $python benchmarks/bench_engine.py"
echo "  LLAMA_SERVER=$out/build/bin/llama-server LLAMA_ARG_FLASH_ATTN=off $python benchmarks/bench_serving.py --num-clients 8 --max-tokens 128"
echo "  LLAMA_LOOKUP=$out/build/bin/llama-lookup LLAMA_LOOKUP_GGUF=$out/smollm2-BF16.gguf $python benchmarks/bench_speculative.py"
