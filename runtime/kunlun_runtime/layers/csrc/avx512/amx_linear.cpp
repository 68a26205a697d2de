// Small-batch BF16 linear on the AMX tile units, for decode steps of several sequences.
//
// With 3..16 activation rows the AVX-512 dot-product kernel is compute-bound on this class of
// CPU (VDPBF16PS issues about once per 4 cycles), so it falls well below the memory bandwidth.
// One AMX TDPBF16PS multiplies a 16 × 32 weight tile by a 32 × 16 activation tile: the weight is
// the A operand, loaded straight from the row-major [N, K] matrix (16 rows at a stride of K), and
// the activations are the B operand, repacked once per call into AMX's pair-interleaved layout
// (zero-padded to 16 rows). C[n, m] accumulates in FP32 and is rounded to BF16 once.
//
// Linux hands out AMX state only on request (arch_prctl ARCH_REQ_XCOMP_PERM); `amx_available`
// makes that request once and says whether it was granted.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "bf16_vec.h"
#include "amx_linear.h"
#include "../kernels.h"

namespace {

constexpr long kArchRequestXcompPerm = 0x1023;
constexpr long kXfeatureXtiledata = 18;
constexpr int64_t kTileRows = 16;   // output channels per tile, and the most activation rows
constexpr int64_t kTileK = 32;      // BF16 elements of K per tile
constexpr int64_t kPrefetchBlocks = 2;

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

}  // namespace

namespace kunlun_cpu {

void configure_amx_tiles() {
  // A static object: GCC 12 does not see LDTILECFG read its operand and drops the stores into a
  // local one ("dead"), which leaves an invalid configuration and an illegal-instruction fault.
  static const TileConfig config = [] {
    TileConfig c;
    for (int t = 0; t < 8; ++t) {  // every tile 16 rows × 64 bytes: C 16 × 16 FP32, A 16 × 32 BF16, B 16 pairs × 16
      c.rows[t] = kTileRows;
      c.colsb[t] = 64;
    }
    return c;
  }();
  _tile_loadconfig(&config);
}

bool amx_available() {
  static const bool granted = syscall(SYS_arch_prctl, kArchRequestXcompPerm, kXfeatureXtiledata) == 0;
  return granted;
}

bool amx_linear_fits(const at::Tensor& x, const at::Tensor& w) {
  return x.size(0) <= kTileRows && w.size(1) % kTileK == 0 && w.size(0) % kTileRows == 0 && amx_available();
}

at::Tensor linear_bf16_amx(const at::Tensor& x, const at::Tensor& w, const float* bias) {
  const int64_t M = x.size(0), K = w.size(1), N = w.size(0);
  const int64_t chunks = K / kTileK;
  // B tiles: for each K chunk, 16 rows of K pairs, each row [m0 k, m0 k+1, m1 k, m1 k+1, ...]:
  // a 16 × 16 transpose of the chunk's 32-bit pairs (rows past M are zeros).
  std::vector<c10::BFloat16> packed(chunks * kTileRows * 2 * kTileRows);
  const auto* xp = x.const_data_ptr<c10::BFloat16>();
  for (int64_t chunk = 0; chunk < chunks; ++chunk) {
    __m512i rows[16], pairs[16];
    for (int64_t m = 0; m < kTileRows; ++m) {
      rows[m] = m < M ? _mm512_loadu_si512(xp + m * K + chunk * kTileK) : _mm512_setzero_si512();
    }
    kunlun_cpu::vec::transpose16x16(rows, pairs);
    for (int p = 0; p < 16; ++p) _mm512_storeu_si512(packed.data() + (chunk * kTileRows + p) * 2 * kTileRows, pairs[p]);
  }
  at::Tensor out = at::empty({M, N}, x.options());
  auto* op = out.mutable_data_ptr<c10::BFloat16>();
  const auto* wp = w.const_data_ptr<c10::BFloat16>();
  const int64_t row_bytes = K * static_cast<int64_t>(sizeof(c10::BFloat16));
  at::parallel_for(0, N / kTileRows, 1, [&](int64_t begin, int64_t end) {
    configure_amx_tiles();
    alignas(64) float c[kTileRows * kTileRows];
    for (int64_t block = begin; block < end; ++block) {
      const c10::BFloat16* a = wp + block * kTileRows * K;
      _tile_zero(0);
      for (int64_t chunk = 0; chunk < chunks; ++chunk) {
        // The tile loads walk 16 rows at once, which the hardware prefetcher follows poorly: fetch
        // the block kPrefetchBlocks ahead (contiguous) in step, 16 lines per chunk, into L2 (into
        // L1 was slower over a whole model's linears at 8 rows).
        const char* ahead = reinterpret_cast<const char*>(a + kPrefetchBlocks * kTileRows * K) + chunk * 1024;
        for (int64_t line = 0; line < 16; ++line) _mm_prefetch(ahead + 64 * line, _MM_HINT_T1);
        _tile_loadd(1, a + chunk * kTileK, row_bytes);
        _tile_loadd(2, packed.data() + chunk * kTileRows * 2 * kTileRows, 64);
        _tile_dpbf16ps(0, 1, 2);
      }
      _tile_stored(0, c, 64);
      // c[n][m] → output rows m: a transpose, the bias, one rounding to BF16 per element.
      __m512i by_channel[16], by_row[16];
      for (int i = 0; i < 16; ++i) by_channel[i] = _mm512_load_si512(c + i * kTileRows);
      kunlun_cpu::vec::transpose16x16(by_channel, by_row);
      const int64_t n0 = block * kTileRows;
      const __m512 b = bias ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
      for (int64_t m = 0; m < M; ++m) {
        kunlun_cpu::vec::store_bf16x16(op + m * N + n0, _mm512_add_ps(_mm512_castsi512_ps(by_row[m]), b), 0xFFFF);
      }
    }
    _tile_release();
  });
  return out;
}

}  // namespace kunlun_cpu
