// Routed MoE experts on the CPU, float32 or bf16: every expert's tokens in one pass over its weights, read where
// they lie.
//
//   out[t] = sum over slots j with e = ids[t, j] held here of  weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t]))
//
// The same sum as metainfer_gen.kernels.moe.moe_experts_reference, for decode-sized batches: a counting sort puts
// each local expert's (token, slot) pairs in a run; then, per expert and block of output rows, a register tile of
// token rows x weight rows accumulates dot products over the hidden dimension, reading the stacked weights in their
// checkpoint layout (gate rows then up rows). Every weight row an active expert owns is read once per step however
// few tokens it got, where a BLAS call per expert pays its packing and threading for a few rows.
// Three passes on torch's intra-op threads (at::parallel_for), each thread taking work items from a shared counter:
// gate/up rows -> silu(gate) * up; down rows scaled by the routing weight, per pair; each token's pairs summed in
// ascending expert order (the reference's order).
//
// float32: vec16.h's vectors (8 floats on AVX2, 16 on AVX-512); GCC contracts a * b + c into FMA. bf16 (built only
// where the target has AVX512-BF16): vdpbf16ps sums 32 bf16 products into 16 float32 lanes; the gate/up results,
// silu and the routed sum stay float32, silu(gate) * up is rounded to bf16 once (the down projection's input, as
// the reference's bf16 GEMM takes it) and the output once.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "vec16.h"  // immintrin.h where the target has AVX-512

namespace {

using namespace metainfer;

constexpr int kRows = 4;     // token rows in a register tile
// Weight rows in a tile of several token rows: float32 on AVX-512, 4 x 4 accumulators of its 32 registers (1.1-1.2x
// the 4 x 2 tile at 32-256 tokens on 2 Zen 4 cores); 4 x 2 in AVX2's 16 and in bf16 (4 x 4 ran 0.9x there).
template <typename T>
constexpr int kCols = kLanes == 16 && std::is_same_v<T, float> ? 4 : 2;
constexpr int kColsOne = 8;  // weight rows in a one-token tile (a GEMV: 8 weight streams in flight)
constexpr int64_t kBlock = 32;  // weight rows per work item

// out[r * ldo + c] = the sum of acc[r][c]'s lanes: all 16 at once in a 16-accumulator tile, else tree_sum each.
template <int R, int C>
inline void store_sums(v16f (&acc)[R][C], float* out, int64_t ldo) {
#if defined(__AVX512F__)
  if constexpr (R * C == 16) {
    v16f v[16];
    for (int i = 0; i < 16; ++i) v[i] = acc[i / C][i % C];
    reduce16(v);
    float s[16];
    store16(s, v[0]);
    for (int i = 0; i < 16; ++i) out[(i / C) * ldo + i % C] = s[4 * (i % 4) + i / 4];
    return;
  }
#endif
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r * ldo + c] = tree_sum(acc[r][c]);
}

// out[r * ldo + c] = x_r . w[c * ldw : + K] for R token rows and C weight rows, K a multiple of kLanes.
template <int R, int C>
inline void dot_tile(const float* const* xs, const float* w, int64_t ldw, int64_t K, float* out, int64_t ldo) {
  v16f acc[R][C] = {};
  for (int64_t k = 0; k < K; k += kLanes) {
    v16f wv[C];
    for (int c = 0; c < C; ++c) {
      __builtin_prefetch(w + (c + C) * ldw + k, 0, 0);  // the next tile's rows, from memory on a decode step
      wv[c] = load16(w + c * ldw + k);
    }
    for (int r = 0; r < R; ++r) {
      const v16f xv = load16(xs[r] + k);
      for (int c = 0; c < C; ++c) acc[r][c] += xv * wv[c];
    }
  }
  store_sums<R, C>(acc, out, ldo);
}

#if defined(__AVX512BF16__)
constexpr bool kBf16 = true;
// The same tile over bf16 operands, K a multiple of 32: one vdpbf16ps per 32 columns, a token row and a weight row.
template <int R, int C>
inline void dot_tile(const at::BFloat16* const* xs, const at::BFloat16* w, int64_t ldw, int64_t K, float* out,
                     int64_t ldo) {
  v16f acc[R][C] = {};
  for (int64_t k = 0; k < K; k += 32) {
    __m512bh wv[C];
    for (int c = 0; c < C; ++c) {
      __builtin_prefetch(w + (c + C) * ldw + k, 0, 0);
      wv[c] = (__m512bh)_mm512_loadu_si512(w + c * ldw + k);
    }
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(xs[r] + k);
      for (int c = 0; c < C; ++c) acc[r][c] = (v16f)_mm512_dpbf16_ps((__m512)acc[r][c], xv, wv[c]);
    }
  }
  store_sums<R, C>(acc, out, ldo);
}
#else
constexpr bool kBf16 = false;
#endif

template <int R, typename T>
void dot_rows(const T* const* xs, const T* w, int64_t ldw, int64_t K, int64_t cols, float* out, int64_t ldo) {
  int64_t c = 0;
  if (R == 1)
    for (; c + kColsOne <= cols; c += kColsOne) dot_tile<1, kColsOne>(xs, w + c * ldw, ldw, K, out + c, ldo);
  for (; c + kCols<T> <= cols; c += kCols<T>) dot_tile<R, kCols<T>>(xs, w + c * ldw, ldw, K, out + c, ldo);
  for (; c < cols; ++c) dot_tile<R, 1>(xs, w + c * ldw, ldw, K, out + c, ldo);
}

// out[i * ldo + c] = rows[i] . w[c] for n token rows (pointers) and `cols` weight rows.
template <typename T>
void dot_block(const T* const* rows, int64_t n, const T* w, int64_t ldw, int64_t K, int64_t cols, float* out,
               int64_t ldo) {
  int64_t i = 0;
  for (; i + kRows <= n; i += kRows) dot_rows<kRows>(rows + i, w, ldw, K, cols, out + i * ldo, ldo);
  switch (n - i) {
    case 3: dot_rows<3>(rows + i, w, ldw, K, cols, out + i * ldo, ldo); break;
    case 2: dot_rows<2>(rows + i, w, ldw, K, cols, out + i * ldo, ldo); break;
    case 1: dot_rows<1>(rows + i, w, ldw, K, cols, out + i * ldo, ldo); break;
    default: break;
  }
}

struct Item {
  int64_t expert, first_row, rows;
};

// Items (expert, block of weight rows) for every expert with pairs, the busiest experts' first.
std::vector<Item> work_items(const std::vector<int64_t>& counts, int64_t weight_rows) {
  std::vector<int64_t> experts;
  for (int64_t e = 0; e < (int64_t)counts.size(); ++e)
    if (counts[e]) experts.push_back(e);
  std::stable_sort(experts.begin(), experts.end(), [&](int64_t a, int64_t b) { return counts[a] > counts[b]; });
  std::vector<Item> items;
  for (int64_t e : experts)
    for (int64_t r = 0; r < weight_rows; r += kBlock) items.push_back({e, r, std::min(kBlock, weight_rows - r)});
  return items;
}

// g * sigmoid(g), sigmoid from exp of -|g| (exp16 takes arguments <= 0): 1 / (1 + e) for g >= 0, e / (1 + e) below.
inline v16f silu16(v16f g) {
  const v16f e = exp16(g < 0 ? g : -g);
  const v16f sig = (g < 0 ? e : v16f{} + 1.f) / (e + 1.f);
  return g * sig;
}

template <typename F>
void run_items(int64_t num_items, F&& fn) {
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), num_items);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1)) fn(i);
  });
}

template <typename T>
at::Tensor experts(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& ids, const at::Tensor& w13,
                   const at::Tensor& w2, int64_t first_expert) {
  const int64_t tokens = x.size(0), hidden = x.size(1), slots = ids.size(1), num_local = w13.size(0);
  const int64_t inter = w2.size(2);
  const T* xp = x.data_ptr<T>();
  const float* wp = weights.data_ptr<float>();
  const int64_t* ip = ids.data_ptr<int64_t>();

  // Counting sort of the held pairs by local expert (stable: by token, then slot, within an expert).
  std::vector<int64_t> counts(num_local, 0), local(tokens * slots);
  for (int64_t p = 0; p < tokens * slots; ++p) {
    const int64_t e = ip[p] - first_expert;
    local[p] = (e >= 0 && e < num_local) ? e : -1;
    if (local[p] >= 0) ++counts[local[p]];
  }
  std::vector<int64_t> starts(num_local + 1, 0);
  for (int64_t e = 0; e < num_local; ++e) starts[e + 1] = starts[e] + counts[e];
  const int64_t pairs = starts[num_local];
  if (pairs == 0) return at::zeros_like(x);
  std::vector<int64_t> order(pairs), position(tokens * slots, -1), fill(starts.begin(), starts.end() - 1);
  for (int64_t p = 0; p < tokens * slots; ++p)
    if (local[p] >= 0) {
      position[p] = fill[local[p]];
      order[fill[local[p]]++] = p;
    }
  std::vector<const T*> rows(pairs);
  for (int64_t i = 0; i < pairs; ++i) rows[i] = xp + (order[i] / slots) * hidden;

  // Pass 1: h = x @ w13[e].T for each expert's rows (float32), then act = silu(gate) * up in x's dtype.
  const auto f32 = x.options().dtype(at::kFloat);
  at::Tensor h = at::empty({pairs, 2 * inter}, f32);
  float* hp = h.data_ptr<float>();
  const T* w13p = w13.data_ptr<T>();
  const auto items13 = work_items(counts, 2 * inter);
  run_items(items13.size(), [&](int64_t i) {
    const Item& it = items13[i];
    const int64_t s = starts[it.expert];
    dot_block(rows.data() + s, counts[it.expert], w13p + (it.expert * 2 * inter + it.first_row) * hidden, hidden,
              hidden, it.rows, hp + s * 2 * inter + it.first_row, 2 * inter);
  });
  at::Tensor act = at::empty({pairs, inter}, x.options());
  T* ap = act.data_ptr<T>();
  at::parallel_for(0, pairs, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      for (int64_t j = 0; j < inter; j += kLanes) {
        const v16f g = load16(hp + i * 2 * inter + j);
        store16(ap + i * inter + j, silu16(g) * load16(hp + i * 2 * inter + inter + j));
      }
  });

  // Pass 2: y = (act @ w2[e].T) * weight, one float32 row per pair.
  std::vector<const T*> act_rows(pairs);
  for (int64_t i = 0; i < pairs; ++i) act_rows[i] = ap + i * inter;
  at::Tensor y = at::empty({pairs, hidden}, f32);
  float* yp = y.data_ptr<float>();
  const T* w2p = w2.data_ptr<T>();
  const auto items2 = work_items(counts, hidden);
  run_items(items2.size(), [&](int64_t i) {
    const Item& it = items2[i];
    const int64_t s = starts[it.expert];
    float* dst = yp + s * hidden + it.first_row;
    dot_block(act_rows.data() + s, counts[it.expert], w2p + (it.expert * hidden + it.first_row) * inter, inter,
              inter, it.rows, dst, hidden);
    for (int64_t r = 0; r < counts[it.expert]; ++r) {
      const float scale = wp[order[s + r]];
      for (int64_t c = 0; c < it.rows; ++c) dst[r * hidden + c] *= scale;
    }
  });

  // Pass 3: each token's pairs summed in ascending expert order, in float32, stored once in x's dtype.
  at::Tensor out = at::empty_like(x);
  T* op = out.data_ptr<T>();
  at::parallel_for(0, tokens, 4, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> mine;
    for (int64_t t = begin; t < end; ++t) {
      mine.clear();
      for (int64_t j = 0; j < slots; ++j)
        if (position[t * slots + j] >= 0) mine.push_back(position[t * slots + j]);
      std::sort(mine.begin(), mine.end());  // positions grow with the expert id
      for (int64_t c = 0; c < hidden; c += kLanes) {
        v16f sum = {};
        for (int64_t pos : mine) sum += load16(yp + pos * hidden + c);
        store16(op + t * hidden + c, sum);
      }
    }
  });
  return out;
}

at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& ids, const at::Tensor& w13,
                       const at::Tensor& w2, int64_t first_expert) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || (kBf16 && dtype == at::kBFloat16)) && w13.scalar_type() == dtype &&
                  w2.scalar_type() == dtype && weights.scalar_type() == at::kFloat && ids.scalar_type() == at::kLong,
              "moe_experts (C++): x, w13 and w2 float32 (or bfloat16 where the build has AVX512-BF16), float32 "
              "weights and int64 ids");
  TORCH_CHECK(x.is_contiguous() && w13.is_contiguous() && w2.is_contiguous() && weights.is_contiguous() &&
                  ids.is_contiguous(), "moe_experts (C++): contiguous tensors");
  const int64_t width = dtype == at::kFloat ? kLanes : 32;
  TORCH_CHECK(x.size(1) % width == 0 && w2.size(2) % width == 0, "moe_experts (C++): hidden and expert width must "
              "be multiples of ", width);
#if defined(__AVX512BF16__)
  if (dtype == at::kBFloat16) return experts<at::BFloat16>(x, weights, ids, w13, w2, first_expert);
#endif
  return experts<float>(x, weights, ids, w13, w2, first_expert);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("moe_experts", &moe_experts, "routed MoE experts, weights read in their stacked layout (CPU)");
  m.attr("lanes") = kLanes;               // floats per vector: one register of the build target (vec16.h)
  m.attr("avx512_bf16") = pybind11::bool_(kBf16);  // whether bf16 tensors are taken (vdpbf16ps)
}
