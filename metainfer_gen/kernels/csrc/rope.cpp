// Rotary position embedding over the heads of each token, in one pass: for each pair (x1, x2) at frequency i and
// the token's position s,  out1 = x1 * cos[s, i] - x2 * sin[s, i],  out2 = x1 * sin[s, i] + x2 * cos[s, i],
// pairs interleaved (2i, 2i+1) or half-split (i, i + D/2), float32 arithmetic rounded once to x's dtype: the
// arithmetic of metainfer_gen.kernels.rotary.rope_reference bit for bit (products rounded before the sum: no fused
// multiply-add). Per token the tables are spread to one value per element, cos as (c, c) and sin as (-s, s) for
// each pair, so that every vector of a head is x * cos + swap(x) * sin, swap exchanging the two members of a pair.
// It replaces the eager reference's dozen passes where torch.compile has no graph for the shape (prefill chunks).

#pragma GCC optimize("fp-contract=off")

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <vector>

#include "vec16.h"

using namespace metainfer;

namespace {

template <typename C>
inline float at_f(const C* p, int64_t i) { return static_cast<float>(p[i]); }

// Tokens [begin, end) of x (tokens, heads, dim) into out; token t reads table row t % seq.
template <typename T, typename C>
void rope_tokens(const T* x, const C* cos, const C* sin, T* out, int64_t seq, int64_t heads, int64_t dim,
                 bool interleaved, int64_t begin, int64_t end) {
  const int64_t half = dim / 2;
  std::vector<float> cd(dim), sd(dim);
  std::vector<int64_t> partner(dim);
  for (int64_t k = 0; k < dim; ++k) partner[k] = interleaved ? (k ^ 1) : (k < half ? k + half : k - half);
  v16i swap;  // lane k takes lane k ^ 1 (an interleaved pair's other member)
  for (int k = 0; k < kLanes; ++k) swap[k] = k ^ 1;
  for (int64_t t = begin; t < end; ++t) {
    const int64_t pos = t % seq;
    for (int64_t i = 0; i < half; ++i) {
      const float c = at_f(cos, pos * half + i), s = at_f(sin, pos * half + i);
      const int64_t first = interleaved ? 2 * i : i, second = interleaved ? 2 * i + 1 : i + half;
      cd[first] = c, cd[second] = c, sd[first] = -s, sd[second] = s;
    }
    for (int64_t h = 0; h < heads; ++h) {
      const T* xh = x + (t * heads + h) * dim;
      T* oh = out + (t * heads + h) * dim;
      int64_t k = 0;
      if (interleaved) {
        for (; k + kLanes <= dim; k += kLanes) {
          const v16f v = load16(xh + k);
          store16(oh + k, v * load16(cd.data() + k) + __builtin_shuffle(v, swap) * load16(sd.data() + k));
        }
      } else if (half % kLanes == 0) {
        for (; k < dim; k += kLanes) {
          const v16f v = load16(xh + k), other = load16(xh + partner[k]);
          store16(oh + k, v * load16(cd.data() + k) + other * load16(sd.data() + k));
        }
      }
      for (; k < dim; ++k) {
        const float v = static_cast<float>(xh[k]), other = static_cast<float>(xh[partner[k]]);
        oh[k] = static_cast<T>(v * cd[k] + other * sd[k]);
      }
    }
  }
}

template <typename T>
void run(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, torch::Tensor& out,
         int64_t seq, bool interleaved) {
  const int64_t dim = x.size(-1), heads = x.size(-2), tokens = x.numel() / (heads * dim);
  const int64_t grain = std::max<int64_t>(1, 16384 / (heads * dim));  // about 16K elements a task
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, tokens, grain, [&](int64_t begin, int64_t end) {
    if (cos.scalar_type() == torch::kFloat)
      rope_tokens<T, float>(xp, cos.data_ptr<float>(), sin.data_ptr<float>(), op, seq, heads, dim, interleaved,
                            begin, end);
    else
      rope_tokens<T, at::BFloat16>(xp, cos.data_ptr<at::BFloat16>(), sin.data_ptr<at::BFloat16>(), op, seq, heads,
                                   dim, interleaved, begin, end);
  });
}

}  // namespace

// x (..., S, H, D) contiguous float32 or bf16, D even; cos, sin (S, D/2) contiguous, both float32 or both bf16.
// Returns (..., S, H, D) in x's dtype.
torch::Tensor rope(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, bool interleaved) {
  TORCH_CHECK(x.dim() >= 3 && x.is_contiguous() && x.size(-1) % 2 == 0, "rope: x must be contiguous (..., S, H, D) "
              "with D even");
  const int64_t seq = x.size(-3), half = x.size(-1) / 2;
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 && cos.size(0) == seq &&
              cos.size(1) == half && sin.sizes() == cos.sizes(), "rope: cos and sin must be contiguous (S, D/2)");
  TORCH_CHECK(cos.scalar_type() == sin.scalar_type() &&
              (cos.scalar_type() == torch::kFloat || cos.scalar_type() == torch::kBFloat16),
              "rope: cos and sin must both be float32 or both bfloat16");
  auto out = torch::empty_like(x);
  if (x.numel() == 0) return out;
  if (x.scalar_type() == torch::kFloat) {
    run<float>(x, cos, sin, out, seq, interleaved);
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "rope: x must be float32 or bfloat16");
    run<at::BFloat16>(x, cos, sin, out, seq, interleaved);
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rope", &rope, "rotary embedding, interleaved or half-split pairs (CPU)");
}
