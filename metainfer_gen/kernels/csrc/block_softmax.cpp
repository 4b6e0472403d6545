// The softmax between the two GEMMs of blockwise prefill attention, in one pass per row: bf16 or float32 scores from
// the bmm are scaled, masked (causal from a query offset, or a boolean mask), their row max taken, exponentiated and
// summed in float32, and written back in place as probabilities in the scores' dtype; returns each row's max and
// sum. It replaces the ``.float()``, ``mul_``, ``masked_fill_``, ``amax``, ``sub_``, ``exp_``, ``sum`` and
// ``.to(bf16)`` passes of metainfer_gen.kernels.block_attention's ``bmm-blocks`` path, with the same arithmetic.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

#include "vec16.h"

using namespace metainfer;

namespace {

// The rows of scores (heads * rows, keys) in place; see block_softmax_.
template <typename T>
void softmax_rows(T* sp, int64_t heads, int64_t rows, int64_t keys, float s, int64_t causal_offset, const bool* mp,
                  float* tp, float* up) {
  const float ninf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, heads * rows, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> row(keys + kLanes);
    for (int64_t hr = begin; hr < end; ++hr) {
      const int64_t i = hr % rows;
      T* x = sp + hr * keys;
      const int64_t visible = causal_offset >= 0 ? std::min(keys, causal_offset + i + 1) : keys;
      float mx = ninf;
      int64_t k = 0;
      v16f vmx = v16f{} + ninf;
      for (; k + kLanes <= visible; k += kLanes) {
        v16f v = load16(x + k) * s;
        store16(&row[k], v);
        vmx = vmx > v ? vmx : v;
      }
      for (; k < visible; ++k) {
        row[k] = static_cast<float>(x[k]) * s;
        mx = std::max(mx, row[k]);
      }
      for (int l = 0; l < kLanes; ++l) mx = std::max(mx, vmx[l]);
      if (mp != nullptr) {  // masked keys out, then the max again over what is left
        const bool* m = mp + i * keys;
        mx = ninf;
        for (k = 0; k < visible; ++k) {
          if (!m[k]) row[k] = ninf;
          mx = std::max(mx, row[k]);
        }
      }
      const float shift = mx == ninf ? 0.f : mx;  // a row that sees no key: top 0, every probability 0
      v16f vsum{};
      float sum = 0.f;
      for (k = 0; k + kLanes <= visible; k += kLanes) {
        v16f e = exp16(load16(&row[k]) - shift);
        vsum += e;
        store16(x + k, e);
      }
      for (; k < visible; ++k) {
        const float e = std::exp(row[k] - shift);
        sum += e;
        x[k] = static_cast<T>(e);
      }
      for (; k < keys; ++k) x[k] = static_cast<T>(0.f);  // keys past the causal edge
      tp[hr] = shift;
      up[hr] = sum + hsum(vsum);
    }
  });
}

}  // namespace

// scores (N, b, K) bf16 or float32 contiguous, overwritten with exp(scale * s - top) in their dtype;
// causal_offset >= 0: row i of the block sees keys 0 .. causal_offset + i; mask (b, K) bool (True = attend) or
// undefined. Returns (top, total), (N, b) float32: top the row max of the scaled scores (0 for a row that sees no
// key), total the sum of the probabilities (0 for such a row).
std::tuple<torch::Tensor, torch::Tensor> block_softmax_(torch::Tensor scores, double scale, int64_t causal_offset,
                                                        c10::optional<torch::Tensor> mask) {
  TORCH_CHECK(scores.dim() == 3 && scores.is_contiguous() &&
                  (scores.scalar_type() == torch::kBFloat16 || scores.scalar_type() == torch::kFloat),
              "block_softmax_: scores must be contiguous bfloat16 or float32 (N, b, K)");
  const int64_t heads = scores.size(0), rows = scores.size(1), keys = scores.size(2);
  const bool* mp = nullptr;
  torch::Tensor mask_c;
  if (mask.has_value() && mask->defined()) {
    mask_c = mask->to(torch::kBool).contiguous();
    TORCH_CHECK(mask_c.dim() == 2 && mask_c.size(0) == rows && mask_c.size(1) == keys,
                "block_softmax_: mask must be (b, K) = (", rows, ", ", keys, ")");
    mp = mask_c.data_ptr<bool>();
  }
  auto opts = scores.options().dtype(torch::kFloat);
  auto top = torch::empty({heads, rows}, opts), total = torch::empty({heads, rows}, opts);
  const float s = static_cast<float>(scale);
  if (scores.scalar_type() == torch::kFloat) {
    softmax_rows(scores.data_ptr<float>(), heads, rows, keys, s, causal_offset, mp, top.data_ptr<float>(),
                 total.data_ptr<float>());
  } else {
    softmax_rows(scores.data_ptr<at::BFloat16>(), heads, rows, keys, s, causal_offset, mp, top.data_ptr<float>(),
                 total.data_ptr<float>());
  }
  return {top, total};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("block_softmax_", &block_softmax_, "in-place row softmax of bf16 or float32 attention scores (CPU)",
        pybind11::arg("scores"), pybind11::arg("scale"), pybind11::arg("causal_offset"),
        pybind11::arg("mask") = pybind11::none());
}
