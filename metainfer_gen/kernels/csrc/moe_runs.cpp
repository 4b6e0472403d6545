// Routed MoE experts on the CPU for prefill-sized batches, float32 or bf16: one GEMM pair per active expert over
// all its tokens, with the work between the GEMMs fused into single passes.
//
//   out[t] = sum over slots j with e = ids[t, j] held here of  weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t]))
//
// A stable counting sort puts each local expert's (token, slot) pairs in a run (ascending pair index). Per expert
// with tokens, in ascending expert order:
//   1. its tokens' rows are gathered into one buffer (rows padded to the GEMM bucket where asked: oneDNN builds a
//      kernel per row count, so the bf16 path pads as metainfer_gen.kernels.gemm.bucket_rows does);
//   2. gate and up in one GEMM against the expert's stacked rows (at::mm_out: oneDNN or MKL, the weights in their
//      checkpoint layout);
//   3. silu(gate) * up in one pass, rounded as torch's two ops round it (silu to the dtype, then the product);
//   4. the down projection, one GEMM;
//   5. each row scaled by its routing weight, rounded to the dtype and added to its token's output row in the
//      dtype: a token appears at most once in an expert's run, so rows are split over threads without races, and
//      every token's pairs are summed in ascending expert order with the roundings of the reference's and
//      transformers' DeepseekV3Experts' index_add_ in the dtype.
// It replaces the grouped path's per-expert Python loop of a gather, two GEMMs, silu, a product, a scaled cast and
// an index_add_ (about ten torch ops an expert, each a dispatch and a pass over the rows).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "vec16.h"

namespace {

using namespace metainfer;

// metainfer_gen.kernels.gemm.bucket_rows (tests/kernels/test_moe_runs_cpu.py checks they agree).
int64_t bucket_rows(int64_t m) {
  if (m <= 32) {
    int64_t b = 1;
    while (b < m) b <<= 1;
    return b;
  }
  const int64_t step = m <= 512 ? 32 : m <= 2048 ? 128 : 512;
  return (m + step - 1) / step * step;
}

// silu(g) = g / (1 + exp(-g)), through exp(-|g|) so the exponential never overflows.
inline v16f silu16(v16f g) {
  const v16f a = (v16f)((v16u)g & 0x7fffffffu);
  const v16f e = exp16(v16f{} - a);
  const v16f pos = g / (1.f + e);
  return g < 0.f ? pos * e : pos;  // g < 0: g e^g / (1 + e^g) = (g / (1 + e)) * e with e = exp(g)
}

inline float silu1(float g) {
  const float e = std::exp(-std::fabs(g));
  const float pos = g / (1.f + e);
  return g < 0.f ? pos * e : pos;
}

template <typename T>
inline v16f round16(v16f v) {  // v rounded to T and back (a no-op for float32)
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    T tmp[kLanes];
    store16(tmp, v);
    return load16(tmp);
  }
}

template <typename T>
void run_experts(const torch::Tensor& x, const float* wp, const std::vector<int64_t>& order,
                 const std::vector<int64_t>& offsets, int64_t k, const torch::Tensor& w13, const torch::Tensor& w2,
                 bool bucket, T* out) {
  const int64_t H = x.size(1), E = w13.size(0), I = w2.size(2);
  int64_t longest = 0;
  for (int64_t e = 0; e < E; ++e) longest = std::max(longest, offsets[e + 1] - offsets[e]);
  const int64_t cap = bucket ? bucket_rows(longest) : longest;
  auto opts = x.options();
  auto rows = torch::zeros({cap, H}, opts), h = torch::empty({cap, 2 * I}, opts);
  auto act = torch::zeros({cap, I}, opts), y = torch::empty({cap, H}, opts);
  const T* xp = x.data_ptr<T>();
  T* rp = rows.data_ptr<T>();
  T* ap = act.data_ptr<T>();
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = offsets[e + 1] - offsets[e];
    if (n == 0) continue;
    const int64_t m = bucket ? bucket_rows(n) : n;
    const int64_t* run = order.data() + offsets[e];
    at::parallel_for(0, n, 16, [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) std::memcpy(rp + r * H, xp + run[r] / k * H, H * sizeof(T));
    });
    auto hv = h.narrow(0, 0, m);
    at::mm_out(hv, rows.narrow(0, 0, m), w13[e].t());
    const T* hp = h.data_ptr<T>();
    at::parallel_for(0, n, 16, [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) {
        const T* g = hp + r * 2 * I;
        const T* u = g + I;
        T* a = ap + r * I;
        int64_t c = 0;
        for (; c + kLanes <= I; c += kLanes) store16(a + c, round16<T>(silu16(load16(g + c))) * load16(u + c));
        for (; c < I; ++c) a[c] = static_cast<T>(static_cast<float>(static_cast<T>(silu1(g[c]))) * u[c]);
      }
    });
    auto yv = y.narrow(0, 0, m);
    at::mm_out(yv, act.narrow(0, 0, m), w2[e].t());
    const T* yp = y.data_ptr<T>();
    at::parallel_for(0, n, 16, [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) {
        T* o = out + run[r] / k * H;
        const T* src = yp + r * H;
        const float s = wp[run[r]];
        int64_t c = 0;
        for (; c + kLanes <= H; c += kLanes) store16(o + c, load16(o + c) + round16<T>(load16(src + c) * s));
        for (; c < H; ++c) {
          o[c] = static_cast<T>(static_cast<float>(o[c]) + static_cast<float>(static_cast<T>(src[c] * s)));
        }
      }
    });
  }
}

}  // namespace

// x (T, H) float32 or bf16 contiguous; weights (T, k) float32; ids (T, k) int64 global expert ids, distinct per
// token; w13 (E, 2I, H) gate rows then up rows and w2 (E, H, I), x's dtype, contiguous; experts first_expert ..
// first_expert + E - 1 are held here (other ids are skipped); bucket: pad each GEMM's rows to bucket_rows.
// Returns (T, H) in x's dtype.
torch::Tensor moe_runs(torch::Tensor x, torch::Tensor weights, torch::Tensor ids, torch::Tensor w13, torch::Tensor w2,
                       int64_t first_expert, bool bucket) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16),
              "moe_runs: x must be contiguous float32 or bfloat16 (T, H)");
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == x.size(0) && ids.scalar_type() == torch::kLong && ids.is_contiguous(),
              "moe_runs: ids must be contiguous int64 (T, k)");
  TORCH_CHECK(weights.sizes() == ids.sizes() && weights.scalar_type() == torch::kFloat && weights.is_contiguous(),
              "moe_runs: weights must be contiguous float32, shaped as ids");
  TORCH_CHECK(w13.dim() == 3 && w2.dim() == 3 && w13.is_contiguous() && w2.is_contiguous() &&
                  w13.scalar_type() == x.scalar_type() && w2.scalar_type() == x.scalar_type() &&
                  w13.size(2) == x.size(1) && w2.size(0) == w13.size(0) && w2.size(1) == x.size(1) &&
                  w13.size(1) == 2 * w2.size(2),
              "moe_runs: need contiguous w13 (E, 2I, H) and w2 (E, H, I) in x's dtype");
  const int64_t T = x.size(0), k = ids.size(1), E = w13.size(0), P = T * k;
  const int64_t* ip = ids.data_ptr<int64_t>();
  std::vector<int64_t> offsets(E + 1, 0);
  for (int64_t p = 0; p < P; ++p) {
    const int64_t e = ip[p] - first_expert;
    if (e >= 0 && e < E) ++offsets[e + 1];
  }
  for (int64_t e = 0; e < E; ++e) offsets[e + 1] += offsets[e];
  std::vector<int64_t> order(offsets[E]), fill(offsets.begin(), offsets.end() - 1);
  for (int64_t p = 0; p < P; ++p) {
    const int64_t e = ip[p] - first_expert;
    if (e >= 0 && e < E) order[fill[e]++] = p;
  }
  auto out = torch::zeros_like(x);
  if (offsets[E] == 0) return out;
  if (x.scalar_type() == torch::kFloat) {
    run_experts<float>(x, weights.data_ptr<float>(), order, offsets, k, w13, w2, bucket, out.data_ptr<float>());
  } else {
    run_experts<at::BFloat16>(x, weights.data_ptr<float>(), order, offsets, k, w13, w2, bucket,
                              out.data_ptr<at::BFloat16>());
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("moe_runs", &moe_runs, "routed MoE experts for prefill-sized batches: one GEMM pair per active expert (CPU)",
        pybind11::arg("x"), pybind11::arg("weights"), pybind11::arg("ids"), pybind11::arg("w13"), pybind11::arg("w2"),
        pybind11::arg("first_expert"), pybind11::arg("bucket"));
  m.def("bucket_rows", &bucket_rows, "the row count a GEMM is padded to (metainfer_gen.kernels.gemm.bucket_rows)");
}
