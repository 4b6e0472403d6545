// Float vectors for the C++ CPU kernels, one machine register wide: GCC vector extensions of kLanes floats, 16
// (a zmm register) where the build targets AVX-512, else 8 (a ymm register: AVX2). The names keep "16" from the
// AVX-512 case. A 16-float vector on an AVX2 target is not split into register pairs: GCC keeps it on the stack,
// and every operation became a store and reload (the fp32 decode kernel ran at about 7 GFLOP/s a Zen 3 core, 0.3x
// the torch path). bf16 <-> fp32 as torch converts (round to nearest even).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace metainfer {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif

typedef float v16f __attribute__((vector_size(kLanes * 4)));
typedef uint32_t v16u __attribute__((vector_size(kLanes * 4)));
typedef int32_t v16i __attribute__((vector_size(kLanes * 4)));
typedef uint16_t v16h __attribute__((vector_size(kLanes * 2)));

inline v16f load16(const float* p) {
  v16f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline v16f load16(const at::BFloat16* p) {  // bf16 -> fp32 is exact: the 16 bits become the high half
  v16h h;
  std::memcpy(&h, p, sizeof(h));
  return (v16f)(__builtin_convertvector(h, v16u) << 16);
}

inline void store16(float* p, v16f v) { std::memcpy(p, &v, sizeof(v)); }

inline void store16(at::BFloat16* p, v16f v) {  // round to nearest even, NaN kept NaN (as c10::BFloat16)
  v16u u = (v16u)v;
  v16u rounded = (u + (((u >> 16) & 1u) + 0x7fffu)) >> 16;
  v16u nan = (v16u)(v != v);
  rounded = (rounded & ~nan) | (0x7fc0u & nan);
  v16h h = __builtin_convertvector(rounded, v16h);
  std::memcpy(p, &h, sizeof(h));
}

inline float hsum(v16f v) {
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

// Lane sums in tree order (lane i + lane i + 8, then + 4, + 2, + 1). reduce16: the sums of 16 vectors at once, the
// sum of v[i] in lane 4 (i % 4) + i / 4 of v[0], by four rounds of shuffles and adds; bit-equal to tree_sum.
#if defined(__AVX512F__)
inline float tree_sum(v16f v) { return _mm512_reduce_add_ps((__m512)v); }  // the same order

inline void reduce16(v16f* v) {
  for (int n = 8, round = 0; n >= 1; n /= 2, ++round)
    for (int i = 0; i < n; ++i) {
      const __m512 a = (__m512)v[2 * i], b = (__m512)v[2 * i + 1];
      __m512 lo, hi;
      switch (round) {
        case 0: lo = _mm512_shuffle_f32x4(a, b, 0x44); hi = _mm512_shuffle_f32x4(a, b, 0xee); break;
        case 1: lo = _mm512_shuffle_f32x4(a, b, 0x88); hi = _mm512_shuffle_f32x4(a, b, 0xdd); break;
        case 2: lo = _mm512_shuffle_ps(a, b, 0x44); hi = _mm512_shuffle_ps(a, b, 0xee); break;
        default: lo = _mm512_shuffle_ps(a, b, 0x88); hi = _mm512_shuffle_ps(a, b, 0xdd); break;
      }
      v[i] = (v16f)_mm512_add_ps(lo, hi);
    }
}
#else
inline float tree_sum(v16f v) {
  float s[kLanes];
  store16(s, v);
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int i = 0; i < width; ++i) s[i] += s[i + width];
  return s[0];
}
#endif

// exp(x) for x <= 0 (Cephes expf: 2^n times a degree-6 polynomial on [-ln2/2, ln2/2], about 2 ulp); x below
// -87.3 (where float32 underflows), -inf included, gives 0.
inline v16f exp16(v16f x) {
  const v16f lo = v16f{} - 87.3f;
  const v16f xc = x < lo ? lo : x;
  const v16f t = xc * 1.44269504088896341f;
  const v16i n = __builtin_convertvector(t - 0.5f, v16i);  // t <= 0: truncating t - 0.5 rounds to nearest
  const v16f nf = __builtin_convertvector(n, v16f);
  const v16f r = xc - nf * 0.693359375f + nf * 2.12194440e-4f;
  v16f p = v16f{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const v16f y = p * r * r + r + 1.f;
  const v16f scale = (v16f)((n + 127) << 23);
  return x < lo ? v16f{} : y * scale;
}

}  // namespace metainfer
