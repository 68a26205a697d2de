// Fused decode-step operators for x86 CPUs with AVX-512 (BF16 tensors, FP32 arithmetic).
//
// A decode step of a small model is dominated by per-operator overhead: RMSNorm alone is about
// eight ATen calls, rotary embedding a dozen, and paged attention a scatter, two gathers and an
// SDPA call, per layer. These operators do each of those in one call, with the reference's
// roundings (every BF16 intermediate that HF rounds is rounded here too):
//
//   kunlun_cpu::rms_norm(x [T, H], w [H], eps)                  -> bf16(w * bf16(x * rsqrt(mean(x²) + eps)))
//   kunlun_cpu::add_rms_norm(x [T, H], delta [T, H], w [H], eps) -> (s = bf16(x + delta), rms_norm(s))
//   kunlun_cpu::silu_mul(gate_up [T, 2I])                       -> bf16(bf16(silu(gate)) * up)
//   kunlun_cpu::decode_attention(q [B, H, D], k [B, KVH, D], v [B, KVH, D], cos [B, D], sin [B, D],
//                                k_blocks, v_blocks [NB, BS, KVH, D], block_tables [B, MB],
//                                context_lens [B], scale, window)  -> [B, H * D]
//     one new token per sequence: rotary on q and k, k and v written into the paged cache at
//     position context_len - 1, then softmax(scale · q·Kᵀ) · V over the sequence's blocks
//     (GQA: query head h reads KV head h / (H / KVH); window > 0 keeps the last `window` keys).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

namespace {

using bf16 = c10::BFloat16;

inline float round_bf16(float value) { return static_cast<float>(bf16(value)); }

inline __mmask16 tail_mask(int64_t count) {  // the first min(count, 16) lanes
  return count >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << count) - 1);
}

inline __m512 load_bf16x16(const bf16* p, __mmask16 mask) {
  const __m256i raw = _mm256_maskz_loadu_epi16(mask, reinterpret_cast<const void*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

void check_bf16(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16, name, " must be bfloat16");
}

// ---- RMSNorm -------------------------------------------------------------------------------

void rms_norm_row(const float* x, const bf16* w, bf16* out, int64_t H, float eps) {
  __m512 squares = _mm512_setzero_ps();
  for (int64_t i = 0; i < H; i += 16) {
    const __m512 v = _mm512_maskz_loadu_ps(tail_mask(H - i), x + i);
    squares = _mm512_fmadd_ps(v, v, squares);
  }
  const float inv = 1.0f / std::sqrt(_mm512_reduce_add_ps(squares) / static_cast<float>(H) + eps);
  for (int64_t i = 0; i < H; ++i) {
    out[i] = bf16(static_cast<float>(w[i]) * round_bf16(x[i] * inv));
  }
}

}  // namespace

namespace kunlun_cpu {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_bf16(x, "x");
  check_bf16(w, "w");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && w.is_contiguous() && w.numel() == x.size(1),
              "rms_norm: x must be contiguous [T, H] and w [H]");
  const int64_t T = x.size(0), H = x.size(1);
  at::Tensor out = at::empty_like(x);
  const bf16* xp = x.const_data_ptr<bf16>();
  bf16* op = out.mutable_data_ptr<bf16>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(H);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t i = 0; i < H; ++i) row[i] = static_cast<float>(xp[t * H + i]);
      rms_norm_row(row.data(), w.const_data_ptr<bf16>(), op + t * H, H, static_cast<float>(eps));
    }
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& w,
                                                double eps) {
  check_bf16(x, "x");
  check_bf16(delta, "delta");
  check_bf16(w, "w");
  TORCH_CHECK(x.dim() == 2 && x.sizes() == delta.sizes() && x.is_contiguous() && delta.is_contiguous() &&
                  w.is_contiguous() && w.numel() == x.size(1),
              "add_rms_norm: x and delta must be contiguous [T, H] and w [H]");
  const int64_t T = x.size(0), H = x.size(1);
  at::Tensor sum = at::empty_like(x);
  at::Tensor out = at::empty_like(x);
  const bf16* xp = x.const_data_ptr<bf16>();
  const bf16* dp = delta.const_data_ptr<bf16>();
  bf16* sp = sum.mutable_data_ptr<bf16>();
  bf16* op = out.mutable_data_ptr<bf16>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(H);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t i = 0; i < H; ++i) {
        const bf16 s = bf16(static_cast<float>(xp[t * H + i]) + static_cast<float>(dp[t * H + i]));
        sp[t * H + i] = s;
        row[i] = static_cast<float>(s);
      }
      rms_norm_row(row.data(), w.const_data_ptr<bf16>(), op + t * H, H, static_cast<float>(eps));
    }
  });
  return {sum, out};
}

}  // namespace kunlun_cpu

namespace {

// ---- decode attention ----------------------------------------------------------------------

// e^x for x <= 0 (softmax arguments): 2^n · p(r), r = x − n·ln2 in [−ln2/2, ln2/2], a degree-6
// Taylor polynomial (relative error below 2e-7), clamped so that very negative x gives 0.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// HF's rotate-half rotary with its roundings: bf16(bf16(x·cos) + bf16(rotate_half(x)·sin)).
inline void rotate(const bf16* x, const bf16* cos, const bf16* sin, int64_t D, float* out) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < D; ++i) {
    const float rotated = i < half ? -static_cast<float>(x[i + half]) : static_cast<float>(x[i - half]);
    const float a = round_bf16(static_cast<float>(x[i]) * static_cast<float>(cos[i]));
    const float b = round_bf16(rotated * static_cast<float>(sin[i]));
    out[i] = round_bf16(a + b);
  }
}

struct PagedCache {
  bf16* data;
  int64_t block_stride, slot_stride, head_stride;
  bf16* at(int64_t block, int64_t slot, int64_t head) const {
    return data + block * block_stride + slot * slot_stride + head * head_stride;
  }
};

PagedCache paged(const at::Tensor& blocks) {
  TORCH_CHECK(blocks.dim() == 4 && blocks.stride(3) == 1, "k/v blocks must be [NB, BS, KVH, D], D contiguous");
  return {blocks.mutable_data_ptr<bf16>(), blocks.stride(0), blocks.stride(1), blocks.stride(2)};
}

// One query head over its sequence's keys [start, end).
void attend(const float* q, const PagedCache& keys, const PagedCache& values, const int64_t* table, int64_t block_size,
            int64_t kv_head, int64_t start, int64_t end, int64_t D, float scale, std::vector<float>& scores,
            bf16* out) {
  const int64_t length = end - start;
  scores.resize(length);
  float max_score = -INFINITY;
  for (int64_t j = 0; j < length; ++j) {
    const int64_t position = start + j;
    const bf16* key = keys.at(table[position / block_size], position % block_size, kv_head);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
      const __mmask16 mask = tail_mask(D - d);
      acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, q + d), load_bf16x16(key + d, mask), acc);
    }
    scores[j] = _mm512_reduce_add_ps(acc) * scale;
    max_score = std::max(max_score, scores[j]);
  }
  __m512 total = _mm512_setzero_ps();
  for (int64_t j = 0; j < length; j += 16) {
    const __mmask16 mask = tail_mask(length - j);
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, scores.data() + j),
                                                   _mm512_set1_ps(max_score)));
    _mm512_mask_storeu_ps(scores.data() + j, mask, e);
    total = _mm512_add_ps(total, _mm512_maskz_mov_ps(mask, e));
  }
  const float inv_total = 1.0f / _mm512_reduce_add_ps(total);
  constexpr int64_t kMaxChunks = 16;  // head_dim <= 256
  __m512 acc[kMaxChunks];
  const int64_t chunks = (D + 15) / 16;
  for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < length; ++j) {
    const int64_t position = start + j;
    const bf16* value = values.at(table[position / block_size], position % block_size, kv_head);
    const __m512 weight = _mm512_set1_ps(scores[j]);
    for (int64_t c = 0; c < chunks; ++c) {
      acc[c] = _mm512_fmadd_ps(weight, load_bf16x16(value + 16 * c, tail_mask(D - 16 * c)), acc[c]);
    }
  }
  alignas(64) float result[16 * kMaxChunks];
  for (int64_t c = 0; c < chunks; ++c) _mm512_store_ps(result + 16 * c, _mm512_mul_ps(acc[c], _mm512_set1_ps(inv_total)));
  for (int64_t d = 0; d < D; ++d) out[d] = bf16(result[d]);
}

}  // namespace

namespace kunlun_cpu {

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_bf16(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "silu_mul: gate_up must be contiguous [T, 2 * I]");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  at::Tensor out = at::empty({T, I}, gate_up.options());
  const bf16* gp = gate_up.const_data_ptr<bf16>();
  bf16* op = out.mutable_data_ptr<bf16>();
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const bf16* gate = gp + t * 2 * I;
      const bf16* up = gate + I;
      for (int64_t i = 0; i < I; i += 16) {
        const __mmask16 mask = tail_mask(I - i);
        const __m512 g = load_bf16x16(gate + i, mask);
        // sigmoid(g) from e = exp(-|g|) <= 1: 1 / (1 + e) for g >= 0, e / (1 + e) otherwise.
        const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
        const __m512 denominator = _mm512_add_ps(_mm512_set1_ps(1.0f), e);
        const __mmask16 negative = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
        const __m512 numerator = _mm512_mask_blend_ps(negative, _mm512_set1_ps(1.0f), e);
        alignas(64) float silu[16], upf[16];
        _mm512_store_ps(silu, _mm512_mul_ps(g, _mm512_div_ps(numerator, denominator)));
        _mm512_store_ps(upf, load_bf16x16(up + i, mask));
        for (int64_t j = 0; j < std::min<int64_t>(16, I - i); ++j) {
          op[t * I + i + j] = bf16(round_bf16(silu[j]) * upf[j]);  // bf16(bf16(silu(g)) * up), as eager
        }
      }
    }
  });
  return out;
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                            const at::Tensor& sin, const at::Tensor& k_blocks, const at::Tensor& v_blocks,
                            const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                            int64_t window) {
  for (const auto& [t, name] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"}, {&cos, "cos"}, {&sin, "sin"},
                                {&k_blocks, "k_blocks"}, {&v_blocks, "v_blocks"}}) {
    check_bf16(*t, name);
  }
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be [B, heads, D]");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = k.size(1);
  TORCH_CHECK(D % 2 == 0 && D <= 256, "head_dim must be even and at most 256, got ", D);
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "query heads (", H, ") must be a multiple of KV heads (", KVH, ")");
  TORCH_CHECK(k.size(0) == B && v.size(0) == B && v.size(1) == KVH && k.size(2) == D && v.size(2) == D,
              "k and v must be [B, KVH, D] like q");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "q, k, v rows must be contiguous");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == B * D && sin.numel() == B * D,
              "cos and sin must be contiguous [B, D]");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong &&
                  block_tables.is_contiguous() && context_lens.is_contiguous() && block_tables.dim() == 2 &&
                  block_tables.size(0) == B && context_lens.numel() == B,
              "block_tables must be int64 [B, MB] and context_lens int64 [B]");
  TORCH_CHECK(k_blocks.sizes() == v_blocks.sizes() && k_blocks.size(2) == KVH && k_blocks.size(3) == D,
              "k_blocks and v_blocks must be [NB, BS, KVH, D]");
  const PagedCache keys = paged(k_blocks), values = paged(v_blocks);
  const int64_t block_size = k_blocks.size(1), num_blocks = k_blocks.size(0), max_blocks = block_tables.size(1);
  const int64_t* tables = block_tables.const_data_ptr<int64_t>();
  const int64_t* lengths = context_lens.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lengths[b] >= 1 && lengths[b] <= max_blocks * block_size, "context length ", lengths[b],
                " of sequence ", b, " does not fit its block table");
    for (int64_t i = 0; i < (lengths[b] + block_size - 1) / block_size; ++i) {
      const int64_t block = tables[b * max_blocks + i];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block id ", block, " out of range");
    }
  }
  const bf16* cp = cos.const_data_ptr<bf16>();
  const bf16* sp = sin.const_data_ptr<bf16>();

  // The new token's K (rotated) and V go into the cache first: it attends to itself.
  std::vector<float> rotated(D);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t position = lengths[b] - 1;
    const int64_t block = tables[b * max_blocks + position / block_size], slot = position % block_size;
    for (int64_t h = 0; h < KVH; ++h) {
      rotate(k.const_data_ptr<bf16>() + b * k.stride(0) + h * k.stride(1), cp + b * D, sp + b * D, D, rotated.data());
      bf16* key = keys.at(block, slot, h);
      for (int64_t d = 0; d < D; ++d) key[d] = bf16(rotated[d]);
      const bf16* value = v.const_data_ptr<bf16>() + b * v.stride(0) + h * v.stride(1);
      std::copy(value, value + D, values.at(block, slot, h));
    }
  }
  at::Tensor out = at::empty({B, H * D}, q.options());
  bf16* op = out.mutable_data_ptr<bf16>();
  const int64_t group = H / KVH;
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> query(D), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / H, h = task % H;
      rotate(q.const_data_ptr<bf16>() + b * q.stride(0) + h * q.stride(1), cp + b * D, sp + b * D, D, query.data());
      const int64_t start = window > 0 ? std::max<int64_t>(0, lengths[b] - window) : 0;
      attend(query.data(), keys, values, tables + b * max_blocks, block_size, h / group, start, lengths[b], D,
             static_cast<float>(scale), scores, op + b * H * D + h * D);
    }
  });
  return out;
}

}  // namespace kunlun_cpu

TORCH_LIBRARY_FRAGMENT(kunlun_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor delta, Tensor w, float eps) -> (Tensor, Tensor)");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def(
      "decode_attention(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) k_blocks, "
      "Tensor(b!) v_blocks, Tensor block_tables, Tensor context_lens, float scale, int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(kunlun_cpu, CPU, m) {
  m.impl("rms_norm", &kunlun_cpu::rms_norm);
  m.impl("add_rms_norm", &kunlun_cpu::add_rms_norm);
  m.impl("silu_mul", &kunlun_cpu::silu_mul);
  m.impl("decode_attention", &kunlun_cpu::decode_attention);
}
