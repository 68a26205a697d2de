// How the AVX-512 kernels take BF16 dot products where many query heads share each key: with
// VDPBF16PS, or with the same arithmetic in FP32 FMAs on BF16 values widened to FP32 (a shift
// and a mask). VDPBF16PS adds the odd pair's product and then the even one's, each rounded; the
// products of BF16 values are exact in FP32, so fma(even, fma(odd, acc)) gives its bits, denormals
// aside: VDPBF16PS flushes them, the FMAs do not (a product or sum below 1.2e-38, which scores and
// attention outputs of real activations do not reach; flushing them too, by MXCSR, cost more than
// the FMAs gained).
// On a Xeon with two 512-bit FMA ports VDPBF16PS ran at a quarter of the FMAs' instruction
// rate, half their multiply-adds (docs/performance.md); on cores whose VDPBF16PS keeps pace with
// their FMAs the widening is pure overhead. So the process probes both once.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>

namespace kunlun_cpu::avx512 {

enum class Bf16Dot { kDpbf16, kFma };

// An FP32 vector of the even (odd) BF16 elements of v: element 2i (2i + 1) in lane i.
inline __m512 even_words(__m512i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }
inline __m512 odd_words(__m512i v) { return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(0xFFFF0000))); }

// Whether fma(even, fma(odd, acc)) gives VDPBF16PS's bits on this CPU (random operands of exponents
// 2^-20 .. 2^20): Intel's definition of the instruction; a core that rounds its two products
// otherwise must keep VDPBF16PS.
inline bool fma_matches_dpbf16() {
  uint32_t state = 12345;
  auto next = [&] { return state = state * 1664525u + 1013904223u; };
  for (int trial = 0; trial < 64; ++trial) {
    alignas(64) uint16_t a[32], b[32];
    alignas(64) float acc[16];
    for (int i = 0; i < 32; ++i) {
      a[i] = static_cast<uint16_t>(((next() >> 8) & 0x807F) | ((107 + next() % 41) << 7));
      b[i] = static_cast<uint16_t>(((next() >> 8) & 0x807F) | ((107 + next() % 41) << 7));
    }
    for (int i = 0; i < 16; ++i) acc[i] = static_cast<float>(static_cast<int32_t>(next())) * 1e-9f;
    const __m512i av = _mm512_load_si512(a), bv = _mm512_load_si512(b);
    const __m512 sum = _mm512_load_ps(acc);
    const __m512 dot = _mm512_dpbf16_ps(sum, (__m512bh)av, (__m512bh)bv);
    const __m512 fma =
        _mm512_fmadd_ps(even_words(av), even_words(bv), _mm512_fmadd_ps(odd_words(av), odd_words(bv), sum));
    if (_mm512_cmpneq_epi32_mask(_mm512_castps_si512(dot), _mm512_castps_si512(fma)) != 0) return false;
  }
  return true;
}

// The FMA path where it gives VDPBF16PS's bits (fma_matches_dpbf16) and two FMAs run at least 1.5x
// as fast as one VDPBF16PS in loops of independent accumulators (~2x on the Xeon above). About a
// millisecond, once per process.
inline Bf16Dot probe_bf16_dot() {
  if (!fma_matches_dpbf16()) return Bf16Dot::kDpbf16;
  constexpr int kAcc = 12;
  constexpr long kIterations = 4096;
  auto seconds = [](auto&& loop) {
    const auto start = std::chrono::steady_clock::now();
    loop();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  // Accumulators start apart so that the compiler cannot merge them into one chain.
  auto dots = [] {
    __m512 acc[kAcc];
    __m512bh x = (__m512bh)_mm512_set1_epi32(0x3F803F80), y = x;
    for (int i = 0; i < kAcc; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i));
    for (long it = 0; it < kIterations; ++it) {
#pragma GCC unroll 24
      for (int i = 0; i < kAcc; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], x, y);
      __asm__ volatile("" : "+v"(x));
    }
    for (int i = 0; i < kAcc; ++i) __asm__ volatile("" : : "v"(acc[i]));
  };
  auto fmas = [] {  // two FMAs for each VDPBF16PS
    __m512 acc[2 * kAcc];
    __m512 x = _mm512_set1_ps(0.5f), y = x;
    for (int i = 0; i < 2 * kAcc; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i));
    for (long it = 0; it < kIterations; ++it) {
#pragma GCC unroll 24
      for (int i = 0; i < 2 * kAcc; ++i) acc[i] = _mm512_fmadd_ps(x, y, acc[i]);
      __asm__ volatile("" : "+v"(x));
    }
    for (int i = 0; i < 2 * kAcc; ++i) __asm__ volatile("" : : "v"(acc[i]));
  };
  double dot_time = 1e9, fma_time = 1e9;
  for (int round = 0; round < 5; ++round) {  // the fastest of five: a busy spell inflates either
    dot_time = std::min(dot_time, seconds(dots));
    fma_time = std::min(fma_time, seconds(fmas));
  }
  return 1.5 * fma_time <= dot_time ? Bf16Dot::kFma : Bf16Dot::kDpbf16;
}

// The process's choice: probed at first use; set_bf16_dot changes it (atomic: the intra-op
// threads read it while a benchmark may switch it). Either gives the same bits.
inline std::atomic<Bf16Dot>& bf16_dot_policy() {
  static std::atomic<Bf16Dot> policy{probe_bf16_dot()};
  return policy;
}

}  // namespace kunlun_cpu::avx512
