// Routed MoE experts on the CPU in float32: every expert's tokens in one pass over its weights, read where they lie.
//
//   out[t] = sum over slots j with e = ids[t, j] held here of  weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t]))
//
// The same sum as metainfer_gen.kernels.moe.moe_experts_reference, for decode-sized batches: a counting sort puts
// each local expert's (token, slot) pairs in a run; then, per expert and block of output rows, a register tile of
// token rows x weight rows accumulates dot products over the hidden dimension (both operands contiguous in it: the
// stacked weights are used in their checkpoint layout, gate rows then up rows, never copied or re-laid out). Every
// weight row an active expert owns is read once per step however few tokens it got, so a decode step is one
// streamed read of the active experts, where a BLAS call per expert pays its packing and threading for a few rows.
// Three passes on torch's intra-op threads (at::parallel_for), each thread taking work items from a shared counter:
// gate/up rows -> silu(gate) * up; down rows scaled by the routing weight, per pair; each token's pairs summed in
// ascending expert order (the reference's order).
//
// Vectors are vec16.h's (one register: 8 floats on AVX2, 16 on AVX-512); GCC contracts a * b + c into FMA.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <vector>

#include "vec16.h"

namespace {

using namespace metainfer;

constexpr int kRows = 4;     // token rows in a register tile
constexpr int kCols = 2;     // weight rows in a tile of several token rows (4 x 2 accumulators + 6 operands)
constexpr int kColsOne = 8;  // weight rows in a one-token tile (a GEMV: 8 weight streams in flight)
constexpr int64_t kBlock = 32;  // weight rows per work item

inline float tree_sum(v16f v) {
  float s[kLanes];
  store16(s, v);
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int i = 0; i < width; ++i) s[i] += s[i + width];
  return s[0];
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
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r * ldo + c] = tree_sum(acc[r][c]);
}

template <int R>
void dot_rows(const float* const* xs, const float* w, int64_t ldw, int64_t K, int64_t cols, float* out, int64_t ldo) {
  int64_t c = 0;
  if (R == 1)
    for (; c + kColsOne <= cols; c += kColsOne) dot_tile<1, kColsOne>(xs, w + c * ldw, ldw, K, out + c, ldo);
  for (; c + kCols <= cols; c += kCols) dot_tile<R, kCols>(xs, w + c * ldw, ldw, K, out + c, ldo);
  for (; c < cols; ++c) dot_tile<R, 1>(xs, w + c * ldw, ldw, K, out + c, ldo);
}

// out[i * ldo + c] = rows[i] . w[c] for n token rows (pointers) and `cols` weight rows.
void dot_block(const float* const* rows, int64_t n, const float* w, int64_t ldw, int64_t K, int64_t cols, float* out,
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

at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& ids, const at::Tensor& w13,
                       const at::Tensor& w2, int64_t first_expert) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w13.scalar_type() == at::kFloat && w2.scalar_type() == at::kFloat &&
                  weights.scalar_type() == at::kFloat && ids.scalar_type() == at::kLong,
              "moe_experts (C++): float32 x, w13, w2, weights and int64 ids");
  TORCH_CHECK(x.is_contiguous() && w13.is_contiguous() && w2.is_contiguous() && weights.is_contiguous() &&
                  ids.is_contiguous(), "moe_experts (C++): contiguous tensors");
  const int64_t tokens = x.size(0), hidden = x.size(1), slots = ids.size(1), num_local = w13.size(0);
  const int64_t inter = w2.size(2);
  TORCH_CHECK(hidden % kLanes == 0 && inter % kLanes == 0, "moe_experts (C++): hidden and expert width must be "
              "multiples of ", kLanes);
  const float* xp = x.data_ptr<float>();
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
  at::Tensor out = at::zeros_like(x);
  if (pairs == 0) return out;
  std::vector<int64_t> order(pairs), position(tokens * slots, -1), fill(starts.begin(), starts.end() - 1);
  for (int64_t p = 0; p < tokens * slots; ++p)
    if (local[p] >= 0) {
      position[p] = fill[local[p]];
      order[fill[local[p]]++] = p;
    }
  std::vector<const float*> rows(pairs);
  for (int64_t i = 0; i < pairs; ++i) rows[i] = xp + (order[i] / slots) * hidden;

  // Pass 1: h = x @ w13[e].T for each expert's rows, then act = silu(gate) * up.
  at::Tensor h = at::empty({pairs, 2 * inter}, x.options());
  float* hp = h.data_ptr<float>();
  const float* w13p = w13.data_ptr<float>();
  const auto items13 = work_items(counts, 2 * inter);
  run_items(items13.size(), [&](int64_t i) {
    const Item& it = items13[i];
    const int64_t s = starts[it.expert];
    dot_block(rows.data() + s, counts[it.expert], w13p + (it.expert * 2 * inter + it.first_row) * hidden, hidden,
              hidden, it.rows, hp + s * 2 * inter + it.first_row, 2 * inter);
  });
  at::Tensor act = at::empty({pairs, inter}, x.options());
  float* ap = act.data_ptr<float>();
  at::parallel_for(0, pairs, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      for (int64_t j = 0; j < inter; j += kLanes) {
        const v16f g = load16(hp + i * 2 * inter + j);
        store16(ap + i * inter + j, silu16(g) * load16(hp + i * 2 * inter + inter + j));
      }
  });

  // Pass 2: y = (act @ w2[e].T) * weight, one row per pair.
  std::vector<const float*> act_rows(pairs);
  for (int64_t i = 0; i < pairs; ++i) act_rows[i] = ap + i * inter;
  at::Tensor y = at::empty({pairs, hidden}, x.options());
  float* yp = y.data_ptr<float>();
  const float* w2p = w2.data_ptr<float>();
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

  // Pass 3: each token's pairs summed in ascending expert order.
  float* op = out.data_ptr<float>();
  at::parallel_for(0, tokens, 4, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> mine;
    for (int64_t t = begin; t < end; ++t) {
      mine.clear();
      for (int64_t j = 0; j < slots; ++j)
        if (position[t * slots + j] >= 0) mine.push_back(position[t * slots + j]);
      std::sort(mine.begin(), mine.end());  // positions grow with the expert id
      float* dst = op + t * hidden;
      for (int64_t pos : mine)
        for (int64_t c = 0; c < hidden; c += kLanes) store16(dst + c, load16(dst + c) + load16(yp + pos * hidden + c));
    }
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("moe_experts", &moe_experts, "routed MoE experts, float32, weights read in their stacked layout (CPU)");
}
