// Reduction kernels. 16-bit floats are widened to float32, combined, and rounded once per call.
// An AVX2/F16C build of every kernel is chosen at run time when the CPU has those features
// (SDP_NO_SIMD=1 forces the portable build, so tests can cover both).
#pragma once
#include <cstddef>

#include "sdp/common.h"

namespace sdp {

// dst[i] = srcs[0][i] op srcs[1][i] op ... ; dst may alias srcs[0] and nothing else.
// AVG reduces as SUM here; the division happens in copy_scaled.
void reduce_many(DType t, ReduceOp op, void* dst, const void* const* srcs, int nsrc, size_t count);

// dst[i] = src[i] / divisor (divisor 1: plain copy). Integers divide with truncation.
void copy_scaled(DType t, void* dst, const void* src, size_t count, double divisor);

// Which kernel set is in use: "avx2+f16c" or "portable".
const char* kernel_isa();

float half_to_float(uint16_t h);
uint16_t float_to_half(float f);
float bf16_to_float(uint16_t h);
uint16_t float_to_bf16(float f);

}  // namespace sdp
