// Paged MLA decode on the CPU: one absorbed query per sequence scored in place against its latent-cache blocks,
// read through the block table (no gathered copy of the context), with an online softmax per block
// (FlashAttention's running max and sum) and the context of long sequences split into pieces merged by their
// log-sum-exp (flash-decoding). The same arithmetic as metainfer_gen.kernels.paged_mla.paged_mla_decode_reference,
// except that bf16 values meet their probabilities rounded to bf16 (accumulate_pairs), as the prefill's are.
//
// Vectors are GCC vector extensions one register wide (vec16.h: 16 floats on AVX-512, 8 on AVX2) for whatever
// -march the build targets; where the target has AVX512-BF16, bf16 scores use its pairwise dot product
// (vdpbf16ps). Threads: torch's intra-op pool (at::parallel_for), one worker per thread taking pieces longest first.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "vec16.h"

namespace {

using namespace metainfer;

constexpr int kHeadGroup = 8;  // heads sharing one load of a cache row (8 accumulators + 1 row vector)

// scores[t * heads + h] = scale * q[h] . row_t over dk columns, for NH heads starting at h0.
template <int NH, typename T>
void score_rows(const T* q, int64_t dk, const T* rows, int64_t row_stride, int tokens, int heads, int h0,
                float scale, float* scores) {
  for (int t = 0; t < tokens; ++t) {
    const T* row = rows + t * row_stride;
    v16f acc[NH] = {};
    for (int64_t d = 0; d < dk; d += kLanes) {
      v16f k = load16(row + d);
      for (int h = 0; h < NH; ++h) acc[h] += load16(q + (h0 + h) * dk + d) * k;
    }
    for (int h = 0; h < NH; ++h) scores[t * heads + h0 + h] = hsum(acc[h]) * scale;
  }
}

#if defined(__AVX512BF16__)
// TT tokens' rows at once, so each query load serves TT rows (TT x NH accumulators).
template <int NH, int TT>
inline void score_tile(const at::BFloat16* q, int64_t dk, const at::BFloat16* rows, int64_t row_stride, int heads,
                       int h0, float scale, float* scores) {
  __m512 acc[TT][NH];
  for (int t = 0; t < TT; ++t)
    for (int h = 0; h < NH; ++h) acc[t][h] = _mm512_setzero_ps();
  int64_t d = 0;
  for (; d + 2 * kLanes <= dk; d += 2 * kLanes) {  // 32 bf16 per load, pairs summed into 16 fp32 lanes
    __m512bh k[TT];
    for (int t = 0; t < TT; ++t) k[t] = (__m512bh)_mm512_loadu_si512(rows + t * row_stride + d);
    for (int h = 0; h < NH; ++h) {
      const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + (h0 + h) * dk + d);
      for (int t = 0; t < TT; ++t) acc[t][h] = _mm512_dpbf16_ps(acc[t][h], qv, k[t]);
    }
  }
  if constexpr (NH * TT == 16) {
    if (d == dk) {  // no tail: the 16 sums at once (reduce16, the order of _mm512_reduce_add_ps: bit-equal)
      v16f v[16];
      for (int t = 0; t < TT; ++t)
        for (int h = 0; h < NH; ++h) v[t * NH + h] = (v16f)acc[t][h];
      reduce16(v);  // the sum of v[i] in lane 4 (i % 4) + i / 4: back to lane i
      const __m512i back = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
      const __m512 sums = _mm512_mul_ps(_mm512_permutexvar_ps(back, (__m512)v[0]), _mm512_set1_ps(scale));
      for (int t = 0; t < TT; ++t)  // lanes t * NH .. t * NH + NH - 1 are token t's heads h0 .. h0 + NH - 1
        _mm256_storeu_ps(scores + t * heads + h0, t == 0 ? _mm512_castps512_ps256(sums) : _mm256_castpd_ps(
                                                               _mm512_extractf64x4_pd(_mm512_castps_pd(sums), 1)));
      return;
    }
  }
  for (int t = 0; t < TT; ++t) {
    float tail[NH] = {};
    for (int64_t e = d; e < dk; e += kLanes) {  // a last 16 columns
      v16f k = load16(rows + t * row_stride + e);
      for (int h = 0; h < NH; ++h) tail[h] += hsum(load16(q + (h0 + h) * dk + e) * k);
    }
    for (int h = 0; h < NH; ++h) scores[t * heads + h0 + h] = (_mm512_reduce_add_ps(acc[t][h]) + tail[h]) * scale;
  }
}

template <int NH>
void score_rows(const at::BFloat16* q, int64_t dk, const at::BFloat16* rows, int64_t row_stride, int tokens,
                int heads, int h0, float scale, float* scores) {
  int t = 0;
  for (; t + 2 <= tokens; t += 2)
    score_tile<NH, 2>(q, dk, rows + t * row_stride, row_stride, heads, h0, scale, scores + t * heads);
  if (t < tokens) score_tile<NH, 1>(q, dk, rows + t * row_stride, row_stride, heads, h0, scale, scores + t * heads);
}
#endif

// acc[h] = acc[h] * alpha[h] + sum_t probs[t * heads + h] * row_t[:r], for NH heads starting at h0.
template <int NH, typename T>
void accumulate_values(const float* probs, const T* rows, int64_t row_stride, int tokens, int heads, int h0,
                       int64_t r, const float* alpha, float* acc) {
  for (int64_t c = 0; c < r; c += kLanes) {
    v16f a[NH];
    for (int h = 0; h < NH; ++h) a[h] = load16(acc + (h0 + h) * r + c) * alpha[h0 + h];
    for (int t = 0; t < tokens; ++t) {
      v16f v = load16(rows + t * row_stride + c);
      for (int h = 0; h < NH; ++h) a[h] += probs[t * heads + h0 + h] * v;
    }
    for (int h = 0; h < NH; ++h) store16(acc + (h0 + h) * r + c, a[h]);
  }
}

#if defined(__AVX512BF16__)
constexpr int kPairChunk = 128;  // tokens whose bf16 probability pairs are packed at a time (on the stack)

// The same for bf16 rows through AVX512-BF16's pairwise dot product: two tokens' values interleaved column by column
// (vpermw) meet their two probabilities, rounded to bf16 (as the prefill's fused softmax writes them), in one
// vdpbf16ps per head: half the instructions of fp32 FMAs, the sum still float32. An odd last token pairs with zeros,
// so no row past the context is read.
template <int NH>
void accumulate_pairs(const float* probs, const at::BFloat16* rows, int64_t row_stride, int tokens, int heads,
                      int h0, int64_t r, const float* alpha, float* acc) {  // tokens <= kPairChunk
  const int pairs = (tokens + 1) / 2;
  uint32_t packed[kPairChunk / 2 * NH];  // (p_t, p_t+1) as two bf16, per token pair and head
  for (int i = 0; i < pairs; ++i)
    for (int h = 0; h < NH; ++h) {
      const float lo = probs[2 * i * heads + h0 + h];
      const float hi = 2 * i + 1 < tokens ? probs[(2 * i + 1) * heads + h0 + h] : 0.f;
      packed[i * NH + h] = static_cast<uint32_t>(c10::BFloat16(lo).x) |
                           (static_cast<uint32_t>(c10::BFloat16(hi).x) << 16);
    }
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                              22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int64_t c = 0; c < r; c += kLanes) {
    __m512 a[NH];
    for (int h = 0; h < NH; ++h) {
      a[h] = _mm512_loadu_ps(acc + (h0 + h) * r + c);
      if (alpha != nullptr) a[h] = _mm512_mul_ps(a[h], _mm512_set1_ps(alpha[h0 + h]));
    }
    for (int i = 0; i < pairs; ++i) {
      const at::BFloat16* row = rows + 2 * i * row_stride + c;
      const __m256i first = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
      const __m256i second = 2 * i + 1 < tokens
          ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + row_stride)) : _mm256_setzero_si256();
      const __m512i v = _mm512_permutexvar_epi16(  // (first[j], second[j]) in 32-bit lane j
          interleave, _mm512_inserti64x4(_mm512_castsi256_si512(first), second, 1));
      for (int h = 0; h < NH; ++h)
        a[h] = _mm512_dpbf16_ps(a[h], (__m512bh)_mm512_set1_epi32(static_cast<int>(packed[i * NH + h])),
                                (__m512bh)v);
    }
    for (int h = 0; h < NH; ++h) _mm512_storeu_ps(acc + (h0 + h) * r + c, a[h]);
  }
}

template <int NH>
void accumulate_values(const float* probs, const at::BFloat16* rows, int64_t row_stride, int tokens, int heads,
                       int h0, int64_t r, const float* alpha, float* acc) {
  for (int t = 0; t < tokens; t += kPairChunk)  // rescaled once, by the first chunk
    accumulate_pairs<NH>(probs + t * heads, rows + t * row_stride, row_stride, std::min(kPairChunk, tokens - t),
                         heads, h0, r, t == 0 ? alpha : nullptr, acc);
}
#endif

template <typename F>
void for_head_groups(int heads, F&& body) {  // body(std::integral_constant<int, NH>, h0)
  int h0 = 0;
  for (; h0 + kHeadGroup <= heads; h0 += kHeadGroup) body(std::integral_constant<int, kHeadGroup>(), h0);
  switch (heads - h0) {
    case 7: body(std::integral_constant<int, 7>(), h0); break;
    case 6: body(std::integral_constant<int, 6>(), h0); break;
    case 5: body(std::integral_constant<int, 5>(), h0); break;
    case 4: body(std::integral_constant<int, 4>(), h0); break;
    case 3: body(std::integral_constant<int, 3>(), h0); break;
    case 2: body(std::integral_constant<int, 2>(), h0); break;
    case 1: body(std::integral_constant<int, 1>(), h0); break;
    default: break;
  }
}

struct Piece {
  int64_t seq, first_block, last_block;
};

// One piece: blocks [first, last) of sequence seq. Writes acc (heads, r) unnormalised, m and l (heads).
template <typename T>
void run_piece(const Piece& p, const T* q, const T* kv, int64_t kv_rows, int64_t row_stride, const int64_t* table,
               int64_t table_width, int64_t len, int64_t block_size, int heads, int64_t dk, int64_t r, float scale,
               float* acc, float* m, float* l, std::vector<float>& scores, std::vector<float>& shift,
               std::vector<float>& alpha) {
  std::fill(acc, acc + heads * r, 0.f);
  std::fill(m, m + heads, -std::numeric_limits<float>::infinity());
  std::fill(l, l + heads, 0.f);
  const T* qs = q + p.seq * heads * dk;
  for (int64_t blk = p.first_block; blk < p.last_block; ++blk) {
    const int64_t id = table[p.seq * table_width + blk];
    const int tokens = static_cast<int>(std::min(block_size, len - blk * block_size));
    TORCH_CHECK(id >= 0 && id * block_size + tokens <= kv_rows, "paged_mla_decode: sequence ", p.seq, " block ",
                blk, " is cache block ", id, ", outside the cache's ", kv_rows / block_size, " blocks");
    const T* rows = kv + id * block_size * row_stride;
    if (blk + 1 < p.last_block) {  // the next block's rows towards L2 while this one is scored: blocks lie anywhere
      const int64_t next = table[p.seq * table_width + blk + 1];
      const int next_tokens = static_cast<int>(std::min(block_size, len - (blk + 1) * block_size));
      if (next >= 0 && next * block_size + next_tokens <= kv_rows) {
        const char* first = reinterpret_cast<const char*>(kv + next * block_size * row_stride);
        const int64_t bytes = ((next_tokens - 1) * row_stride + dk) * static_cast<int64_t>(sizeof(T));
        for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(first + b, 0, 2);
      }
    }
    for_head_groups(heads, [&](auto nh, int h0) {
      score_rows<decltype(nh)::value>(qs, dk, rows, row_stride, tokens, heads, h0, scale, scores.data());
    });
    // online softmax: new running max and rescale factor per head, then the probabilities of the whole block
    // (tokens x heads scores) kLanes at a time through the vector exp, then the sums
    // (loops over heads innermost: no chain of dependent max/add per head, no index division)
    float* mx = shift.data() + block_size * heads;  // the block's new max per head, after the shift rows
    std::copy(m, m + heads, mx);
    for (int t = 0; t < tokens; ++t)
      for (int h = 0; h < heads; ++h) mx[h] = std::max(mx[h], scores[t * heads + h]);
    for (int h = 0; h < heads; ++h) {
      alpha[h] = std::exp(m[h] - mx[h]);  // exp(-inf) = 0 on the first block
      m[h] = mx[h];
    }
    const int n = tokens * heads;
    for (int t = 0; t < tokens; ++t) std::copy(m, m + heads, &shift[t * heads]);
    int i = 0;
    for (; i + kLanes <= n; i += kLanes) store16(&scores[i], exp16(load16(&scores[i]) - load16(&shift[i])));
    for (; i < n; ++i) scores[i] = std::exp(scores[i] - shift[i]);
    float* sum = mx;  // reused: the block's sum per head
    std::fill(sum, sum + heads, 0.f);
    for (int t = 0; t < tokens; ++t)
      for (int h = 0; h < heads; ++h) sum[h] += scores[t * heads + h];
    for (int h = 0; h < heads; ++h) l[h] = l[h] * alpha[h] + sum[h];
    for_head_groups(heads, [&](auto nh, int h0) {
      accumulate_values<decltype(nh)::value>(scores.data(), rows, row_stride, tokens, heads, h0, r, alpha.data(),
                                             acc);
    });
  }
}

template <typename T>
void decode(const torch::Tensor& q, const torch::Tensor& kv, const torch::Tensor& tables, const int64_t* lens,
            int64_t block_size, int64_t r, float scale, torch::Tensor& out) {
  const int64_t batch = q.size(0), dk = q.size(2);
  const int heads = static_cast<int>(q.size(1));
  const int64_t width = tables.size(1), row_stride = kv.stride(0), kv_rows = kv.size(0);
  const int threads = at::get_num_threads();
  int64_t total_blocks = 0;
  for (int64_t b = 0; b < batch; ++b) total_blocks += (lens[b] + block_size - 1) / block_size;
  // Split long contexts so there are enough pieces for every thread; short ones stay whole (no merge).
  const int64_t split = std::max<int64_t>(8, (total_blocks + 4 * threads - 1) / (4 * threads));
  std::vector<Piece> pieces;
  std::vector<int64_t> first_piece(batch + 1);
  for (int64_t b = 0; b < batch; ++b) {
    first_piece[b] = static_cast<int64_t>(pieces.size());
    const int64_t blocks = (lens[b] + block_size - 1) / block_size;
    for (int64_t f = 0; f < blocks; f += split) pieces.push_back({b, f, std::min(blocks, f + split)});
  }
  first_piece[batch] = static_cast<int64_t>(pieces.size());
  std::vector<int64_t> order(pieces.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {  // longest first
    const Piece &x = pieces[a], &y = pieces[b];
    return x.last_block - x.first_block > y.last_block - y.first_block;
  });
  const int64_t n = static_cast<int64_t>(pieces.size());
  std::vector<float> acc(n * heads * r), m(n * heads), l(n * heads);
  const T* qp = q.data_ptr<T>();
  const T* kvp = kv.data_ptr<T>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    std::vector<float> scores(block_size * heads), shift((block_size + 1) * heads), alpha(heads);
    for (int64_t i = next++; i < n; i = next++) {
      const int64_t k = order[i];
      const Piece& p = pieces[k];
      run_piece<T>(p, qp, kvp, kv_rows, row_stride, tp, width, lens[p.seq], block_size, heads, dk, r, scale,
                   &acc[k * heads * r], &m[k * heads], &l[k * heads], scores, shift, alpha);
    }
  });
  T* op = out.data_ptr<T>();
  at::parallel_for(0, batch * heads, 16, [&](int64_t begin, int64_t end) {  // merge pieces by log-sum-exp
    std::vector<float> row(r);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / heads, h = bh % heads;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t k = first_piece[b]; k < first_piece[b + 1]; ++k) mx = std::max(mx, m[k * heads + h]);
      std::fill(row.begin(), row.end(), 0.f);
      float denom = 0.f;
      for (int64_t k = first_piece[b]; k < first_piece[b + 1]; ++k) {
        const float w = std::exp(m[k * heads + h] - mx);
        denom += l[k * heads + h] * w;
        const float* a = &acc[(k * heads + h) * r];
        for (int64_t c = 0; c < r; c += kLanes) store16(&row[c], load16(&row[c]) + load16(a + c) * w);
      }
      const float inv = 1.f / denom;
      for (int64_t c = 0; c < r; c += kLanes) store16(op + bh * r + c, load16(&row[c]) * inv);
    }
  });
}

}  // namespace

// q (B, N, Dk) contiguous; kv (S, >= Dk) with unit column stride; tables (B, W) int64 contiguous; lens (B,) int64,
// 1 <= len <= W * block_size; Dk and r multiples of 16, r < Dk. Returns (B, N, r) in q's dtype.
torch::Tensor paged_mla_decode(torch::Tensor q, torch::Tensor kv, torch::Tensor tables, torch::Tensor lens,
                               int64_t block_size, int64_t r, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && kv.dim() == 2 && kv.stride(1) == 1, "paged_mla_decode: q must "
              "be contiguous (B, N, Dk) and kv_rows (S, row) with unit column stride");
  TORCH_CHECK(q.scalar_type() == kv.scalar_type(), "paged_mla_decode: q and kv_rows must share a dtype");
  TORCH_CHECK(q.size(2) % kLanes == 0 && r % kLanes == 0 && r < q.size(2) && kv.size(1) >= q.size(2),
              "paged_mla_decode: Dk and value_dim must be multiples of 16 with value_dim < Dk <= row");
  TORCH_CHECK(tables.dim() == 2 && tables.scalar_type() == torch::kLong && tables.is_contiguous() &&
              tables.size(0) == q.size(0), "paged_mla_decode: block_tables must be contiguous int64 (B, W)");
  auto lens_c = lens.to(torch::kLong).contiguous();
  TORCH_CHECK(lens_c.numel() == q.size(0), "paged_mla_decode: context_lens must be (B,)");
  const int64_t* lp = lens_c.data_ptr<int64_t>();
  for (int64_t b = 0; b < q.size(0); ++b)
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= tables.size(1) * block_size, "paged_mla_decode: context_lens[", b, "] = ",
                lp[b], " is outside [1, ", tables.size(1) * block_size, "] (the block table's width x block size)");
  auto out = torch::empty({q.size(0), q.size(1), r}, q.options());
  if (q.size(0) == 0) return out;
  const float s = static_cast<float>(scale);
  if (q.scalar_type() == torch::kFloat) {
    decode<float>(q, kv, tables, lp, block_size, r, s, out);
  } else {
    TORCH_CHECK(q.scalar_type() == torch::kBFloat16, "paged_mla_decode: float32 or bfloat16 only");
    decode<at::BFloat16>(q, kv, tables, lp, block_size, r, s, out);
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_mla_decode", &paged_mla_decode, "paged MLA decode through the block table (CPU)");
  m.attr("lanes") = kLanes;  // floats per vector: one register of the build target (vec16.h)
  m.attr("avx512_bf16") = pybind11::bool_(
#if defined(__AVX512BF16__)
      true
#else
      false
#endif
  );
}
