// RMSNorm and residual-add + RMSNorm over the rows of a float32 or bf16 matrix, one pass per row: the float32
// sum of squares in vector registers, then the row scaled by rsqrt(mean + eps) and the weight and rounded once to
// the input dtype. The fused form first rounds x + residual to the input dtype, stores it, and normalises the
// rounded sum (as Hugging Face decoder layers and vLLM's fused_add_rms_norm do). It replaces the eager reference's
// passes (cast to float32, pow, mean, add, rsqrt, two multiplies, cast back) where torch.compile has no graph for
// the shape: prefill chunks of any length.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <tuple>

#include "vec16.h"

using namespace metainfer;

namespace {

// Rows [begin, end) of x (M, N), rows sx apart, into out; with res, the rounded sum x + res goes to sum_out first
// and is normalised.
template <typename T>
void norm_rows(const T* x, int64_t sx, const T* res, const T* w, T* out, T* sum_out, int64_t n, float eps,
               int64_t begin, int64_t end) {
  for (int64_t row = begin; row < end; ++row) {
    const T* xr = x + row * sx;
    T* o = out + row * n;
    if (res != nullptr) {  // round the sum once to T, as the unfused model stores it
      const T* rr = res + row * n;
      T* s = sum_out + row * n;
      int64_t k = 0;
      for (; k + kLanes <= n; k += kLanes) store16(s + k, load16(xr + k) + load16(rr + k));
      for (; k < n; ++k) s[k] = static_cast<T>(static_cast<float>(xr[k]) + static_cast<float>(rr[k]));
      xr = s;
    }
    v16f acc{};
    float tail = 0.f;
    int64_t k = 0;
    for (; k + kLanes <= n; k += kLanes) {
      const v16f v = load16(xr + k);
      acc += v * v;
    }
    for (; k < n; ++k) tail += static_cast<float>(xr[k]) * static_cast<float>(xr[k]);
    const float rstd = 1.f / std::sqrt((hsum(acc) + tail) / static_cast<float>(n) + eps);
    for (k = 0; k + kLanes <= n; k += kLanes) {
      v16f y = load16(xr + k) * rstd;
      if (w != nullptr) y = y * load16(w + k);
      store16(o + k, y);
    }
    for (; k < n; ++k) {
      float y = static_cast<float>(xr[k]) * rstd;
      if (w != nullptr) y = y * static_cast<float>(w[k]);
      o[k] = static_cast<T>(y);
    }
  }
}

template <typename T>
void run(const torch::Tensor& x, const torch::Tensor* res, const torch::Tensor* w, torch::Tensor& out,
         torch::Tensor* sum_out, double eps) {
  const int64_t m = x.size(0), n = x.size(1);
  const T* xp = x.data_ptr<T>();
  const T* rp = res != nullptr ? res->data_ptr<T>() : nullptr;
  const T* wp = w != nullptr ? w->data_ptr<T>() : nullptr;
  T* op = out.data_ptr<T>();
  T* sp = sum_out != nullptr ? sum_out->data_ptr<T>() : nullptr;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1));  // about 16K values a task
  at::parallel_for(0, m, grain, [&](int64_t begin, int64_t end) {
    norm_rows(xp, x.stride(0), rp, wp, op, sp, n, static_cast<float>(eps), begin, end);
  });
}

void check(const torch::Tensor& t, const torch::Tensor& x, const char* name) {
  TORCH_CHECK(t.is_contiguous() && t.scalar_type() == x.scalar_type() && t.device().is_cpu(), "rms_norm: ", name,
              " must be a contiguous CPU tensor of x's dtype");
}

std::tuple<torch::Tensor, torch::Tensor> dispatch(const torch::Tensor& x, const torch::Tensor* res,
                                                  c10::optional<torch::Tensor> weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.device().is_cpu() &&
                  (x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16),
              "rms_norm: x must be a (M, N) float32 or bfloat16 CPU tensor with unit column stride");
  const torch::Tensor* w = nullptr;
  if (weight.has_value() && weight->defined()) {
    check(*weight, x, "weight");
    TORCH_CHECK(weight->dim() == 1 && weight->size(0) == x.size(1), "rms_norm: weight must be (N,)");
    w = &*weight;
  }
  if (res != nullptr) {
    check(*res, x, "residual");
    TORCH_CHECK(res->sizes() == x.sizes(), "rms_norm: residual must have x's shape");
  }
  auto out = torch::empty(x.sizes(), x.options());  // contiguous whatever x's row stride
  torch::Tensor sum_out = res != nullptr ? torch::empty(x.sizes(), x.options()) : torch::Tensor();
  torch::Tensor* sp = res != nullptr ? &sum_out : nullptr;
  if (x.scalar_type() == torch::kFloat) {
    run<float>(x, res, w, out, sp, eps);
  } else {
    run<at::BFloat16>(x, res, w, out, sp, eps);
  }
  return {out, sum_out};
}

torch::Tensor rms_norm(torch::Tensor x, c10::optional<torch::Tensor> weight, double eps) {
  return std::get<0>(dispatch(x, nullptr, weight, eps));
}

std::tuple<torch::Tensor, torch::Tensor> fused_add_rms_norm(torch::Tensor x, torch::Tensor residual,
                                                            c10::optional<torch::Tensor> weight, double eps) {
  return dispatch(x, &residual, weight, eps);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm over the rows of a float32 or bf16 (M, N) matrix (CPU)",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("eps"));
  m.def("fused_add_rms_norm", &fused_add_rms_norm, "x + residual rounded, then RMSNorm; returns (normed, sum)",
        pybind11::arg("x"), pybind11::arg("residual"), pybind11::arg("weight"), pybind11::arg("eps"));
}
