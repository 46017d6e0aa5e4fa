#include "sdp/reduce.h"

// The AVX2/F16C kernels exist only on x86-64 and only when the build allows intrinsics
// (SDP_PORTABLE=1 at build time defines SDP_NO_INTRINSICS: a build for any CPU, or a check that
// the portable kernels alone are correct). Elsewhere the portable kernels are all there is.
#if (defined(__x86_64__) || defined(__i386__)) && !defined(SDP_NO_INTRINSICS)
#define SDP_HAVE_AVX2 1
#include <cpuid.h>
#include <immintrin.h>
#else
#define SDP_HAVE_AVX2 0
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#define SDP_INLINE inline __attribute__((always_inline))

namespace sdp {

// ---- scalar conversions (portable path and tails) ----
float half_to_float(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do { mant <<= 1; ++e; } while (!(mant & 0x400));
      bits = sign | (uint32_t(127 - 15 - e) << 23) | ((mant & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t float_to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000;
  uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return uint16_t(sign | 0x7c00 | (ax > 0x7f800000u ? 0x200 : 0));  // inf/nan
  if (ax >= 0x477ff000u) return uint16_t(sign | 0x7c00);  // overflow rounds to inf
  if (ax < 0x38800000u) {  // subnormal or zero in half
    if (ax < 0x33000000u) return uint16_t(sign);
    uint32_t e = ax >> 23;
    uint32_t m = (ax & 0x7fffff) | 0x800000;
    int shift = int(126 - e);  // value = m * 2^(e-150); half subnormal unit is 2^-24
    uint32_t r = m >> shift;
    uint32_t rem = m & ((1u << shift) - 1);
    uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1))) ++r;
    return uint16_t(sign | r);
  }
  uint32_t r = ((ax - 0x38000000u) >> 13);
  uint32_t rem = ax & 0x1fff;
  if (rem > 0x1000 || (rem == 0x1000 && (r & 1))) ++r;
  return uint16_t(sign | r);
}

SDP_INLINE float bf16_to_float_i(uint16_t h) {
  uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

SDP_INLINE uint16_t float_to_bf16_i(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return uint16_t((x >> 16) | 0x40);  // quiet NaN
  x += 0x7fffu + ((x >> 16) & 1u);  // round to nearest even
  return uint16_t(x >> 16);
}

float bf16_to_float(uint16_t h) { return bf16_to_float_i(h); }
uint16_t float_to_bf16(float f) { return float_to_bf16_i(f); }

namespace {

constexpr size_t kBlock = 1024;  // elements per block: the fp32 scratch stays in L1

struct Add { template <class T> SDP_INLINE T operator()(T a, T b) const { return a + b; } };
struct Mul { template <class T> SDP_INLINE T operator()(T a, T b) const { return a * b; } };
struct Max { template <class T> SDP_INLINE T operator()(T a, T b) const { return b > a ? b : a; } };
struct Min { template <class T> SDP_INLINE T operator()(T a, T b) const { return b < a ? b : a; } };

template <class T, class Op>
SDP_INLINE void reduce_native(T* __restrict dst, const T* const* srcs, int n, size_t count, Op op) {
  if (dst != srcs[0]) std::memcpy(dst, srcs[0], count * sizeof(T));
  for (int k = 1; k < n; ++k) {
    const T* __restrict s = srcs[k];
    for (size_t i = 0; i < count; ++i) dst[i] = op(dst[i], s[i]);
  }
}

// 16-bit formats: Load widens a block to float32, Store narrows it back.
struct BF16Portable {
  static SDP_INLINE void load(float* out, const uint16_t* in, size_t n) {
    for (size_t i = 0; i < n; ++i) out[i] = bf16_to_float_i(in[i]);
  }
  static SDP_INLINE void store(uint16_t* out, const float* in, size_t n) {
    for (size_t i = 0; i < n; ++i) out[i] = float_to_bf16_i(in[i]);
  }
};
struct F16Portable {
  static SDP_INLINE void load(float* out, const uint16_t* in, size_t n) {
    for (size_t i = 0; i < n; ++i) out[i] = half_to_float(in[i]);
  }
  static SDP_INLINE void store(uint16_t* out, const float* in, size_t n) {
    for (size_t i = 0; i < n; ++i) out[i] = float_to_half(in[i]);
  }
};

template <class Fmt, class Op>
SDP_INLINE void reduce_16(uint16_t* dst, const uint16_t* const* srcs, int n, size_t count, Op op) {
  alignas(64) float acc[kBlock];
  alignas(64) float tmp[kBlock];
  for (size_t base = 0; base < count; base += kBlock) {
    size_t m = std::min(kBlock, count - base);
    Fmt::load(acc, srcs[0] + base, m);
    for (int k = 1; k < n; ++k) {
      Fmt::load(tmp, srcs[k] + base, m);
      for (size_t i = 0; i < m; ++i) acc[i] = op(acc[i], tmp[i]);
    }
    Fmt::store(dst + base, acc, m);
  }
}

template <class Fmt>
SDP_INLINE void scale_16(uint16_t* dst, const uint16_t* src, size_t count, float divisor) {
  alignas(64) float acc[kBlock];
  for (size_t base = 0; base < count; base += kBlock) {
    size_t m = std::min(kBlock, count - base);
    Fmt::load(acc, src + base, m);
    for (size_t i = 0; i < m; ++i) acc[i] = acc[i] / divisor;
    Fmt::store(dst + base, acc, m);
  }
}

template <class Op, class F16, class BF16>
SDP_INLINE void reduce_typed(DType t, void* dst, const void* const* srcs, int n, size_t count, Op op) {
  switch (t) {
    case DType::F32: reduce_native((float*)dst, (const float* const*)srcs, n, count, op); break;
    case DType::F64: reduce_native((double*)dst, (const double* const*)srcs, n, count, op); break;
    case DType::I32: reduce_native((int32_t*)dst, (const int32_t* const*)srcs, n, count, op); break;
    case DType::I64: reduce_native((int64_t*)dst, (const int64_t* const*)srcs, n, count, op); break;
    case DType::U8: reduce_native((uint8_t*)dst, (const uint8_t* const*)srcs, n, count, op); break;
    case DType::I8: reduce_native((int8_t*)dst, (const int8_t* const*)srcs, n, count, op); break;
    case DType::F16: reduce_16<F16>((uint16_t*)dst, (const uint16_t* const*)srcs, n, count, op); break;
    case DType::BF16: reduce_16<BF16>((uint16_t*)dst, (const uint16_t* const*)srcs, n, count, op); break;
  }
}

template <class F16, class BF16>
SDP_INLINE void reduce_dispatch(DType t, ReduceOp op, void* dst, const void* const* srcs, int n, size_t count) {
  switch (op) {
    case ReduceOp::SUM: case ReduceOp::AVG: reduce_typed<Add, F16, BF16>(t, dst, srcs, n, count, Add()); break;
    case ReduceOp::PRODUCT: reduce_typed<Mul, F16, BF16>(t, dst, srcs, n, count, Mul()); break;
    case ReduceOp::MAX: reduce_typed<Max, F16, BF16>(t, dst, srcs, n, count, Max()); break;
    case ReduceOp::MIN: reduce_typed<Min, F16, BF16>(t, dst, srcs, n, count, Min()); break;
  }
}

template <class T>
SDP_INLINE void scale_native(T* dst, const T* src, size_t count, double divisor) {
  if constexpr (std::is_floating_point<T>::value) {
    const T d = T(divisor);
    for (size_t i = 0; i < count; ++i) dst[i] = src[i] / d;
  } else {
    const T d = T(divisor);
    for (size_t i = 0; i < count; ++i) dst[i] = T(src[i] / d);
  }
}

template <class F16, class BF16>
SDP_INLINE void scale_dispatch(DType t, void* dst, const void* src, size_t count, double divisor) {
  switch (t) {
    case DType::F32: scale_native((float*)dst, (const float*)src, count, divisor); break;
    case DType::F64: scale_native((double*)dst, (const double*)src, count, divisor); break;
    case DType::I32: scale_native((int32_t*)dst, (const int32_t*)src, count, divisor); break;
    case DType::I64: scale_native((int64_t*)dst, (const int64_t*)src, count, divisor); break;
    case DType::U8: scale_native((uint8_t*)dst, (const uint8_t*)src, count, divisor); break;
    case DType::I8: scale_native((int8_t*)dst, (const int8_t*)src, count, divisor); break;
    case DType::F16: scale_16<F16>((uint16_t*)dst, (const uint16_t*)src, count, float(divisor)); break;
    case DType::BF16: scale_16<BF16>((uint16_t*)dst, (const uint16_t*)src, count, float(divisor)); break;
  }
}

// ---- AVX2 + F16C build ----
#if SDP_HAVE_AVX2
struct F16Avx {
  static __attribute__((target("avx2,f16c,fma"), noinline)) void load(float* out, const uint16_t* in, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
      _mm256_store_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(in + i))));
    for (; i < n; ++i) out[i] = half_to_float(in[i]);
  }
  static __attribute__((target("avx2,f16c,fma"), noinline)) void store(uint16_t* out, const float* in, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
      _mm_storeu_si128((__m128i*)(out + i), _mm256_cvtps_ph(_mm256_load_ps(in + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; ++i) out[i] = float_to_half(in[i]);
  }
};

__attribute__((target("avx2,f16c,fma"))) void reduce_avx2(DType t, ReduceOp op, void* dst,
                                                          const void* const* srcs, int n, size_t count) {
  reduce_dispatch<F16Avx, BF16Portable>(t, op, dst, srcs, n, count);
}
__attribute__((target("avx2,f16c,fma"))) void scale_avx2(DType t, void* dst, const void* src, size_t count,
                                                         double divisor) {
  scale_dispatch<F16Avx, BF16Portable>(t, dst, src, count, divisor);
}
#endif
void reduce_portable(DType t, ReduceOp op, void* dst, const void* const* srcs, int n, size_t count) {
  reduce_dispatch<F16Portable, BF16Portable>(t, op, dst, srcs, n, count);
}
void scale_portable(DType t, void* dst, const void* src, size_t count, double divisor) {
  scale_dispatch<F16Portable, BF16Portable>(t, dst, src, count, divisor);
}

bool use_avx2() {
#if SDP_HAVE_AVX2
  static const bool v = [] {
    if (env_bool("SDP_NO_SIMD", false)) return false;
    __builtin_cpu_init();
    // F16C from CPUID leaf 1 (ECX bit 29): clang 14 refuses __builtin_cpu_supports("f16c")
    // ("invalid cpu feature string"), which GCC accepts.
    unsigned a = 0, b = 0, c = 0, d = 0;
    bool f16c = __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
    return __builtin_cpu_supports("avx2") && f16c && __builtin_cpu_supports("fma");
  }();
  return v;
#else
  return false;
#endif
}

}  // namespace

void reduce_many(DType t, ReduceOp op, void* dst, const void* const* srcs, int nsrc, size_t count) {
  if (count == 0 || nsrc <= 0) return;
#if SDP_HAVE_AVX2
  if (use_avx2()) return reduce_avx2(t, op, dst, srcs, nsrc, count);
#endif
  reduce_portable(t, op, dst, srcs, nsrc, count);
}

void copy_scaled(DType t, void* dst, const void* src, size_t count, double divisor) {
  if (count == 0) return;
  if (divisor == 1.0) {
    if (dst != src) std::memcpy(dst, src, count * dtype_size(t));
    return;
  }
#if SDP_HAVE_AVX2
  if (use_avx2()) return scale_avx2(t, dst, src, count, divisor);
#endif
  scale_portable(t, dst, src, count, divisor);
}

const char* kernel_isa() { return use_avx2() ? "avx2+f16c" : "portable"; }

}  // namespace sdp
