// Dropout + residual add, y = residual + dropout(x), forward and backward. The math is defined
// by dropout_add_forward / dropout_add_backward in transformer_reference.py.
// X is the dtype of x and its gradient, R that of the residual, y and dy (float16 x with a
// float32 residual is amp's transformer block). draws are the rank generator's uniform values,
// the ones the unfused dropout draws, so keep = draws >= p is its mask; scale is 1 / (1 - p)
// rounded to X, passed as a double that holds it exactly.
//
// Each operation rounds as its unfused counterpart does: the product x * scale to X (an X
// multiplication), then the sum to R, with no contraction into one fused multiply-add
// (precision.cuh). The results equal the unfused dropout and add bit for bit.

#include "precision.cuh"

#define DEFINE_DROPOUT_ADD(X, R, SUFFIX)                                                  \
extern "C" __global__ void dropout_add_forward_##SUFFIX(                                  \
        const X* x, const R* residual, const double* draws, R* y, bool* keep, long long n, \
        double p, double scale) {                                                         \
    typedef Compute<X>::type CX;                                                          \
    typedef Compute<R>::type CR;                                                          \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;           \
         i += (long long)blockDim.x * gridDim.x) {                                        \
        bool kept = draws[i] >= p;                                                        \
        X dropped = round_to<X>(mul_rn(to_compute(x[i]), kept ? (CX)scale : (CX)0));      \
        y[i] = round_to<R>(add_rn(to_compute(residual[i]), (CR)to_compute(dropped)));     \
        keep[i] = kept;                                                                   \
    }                                                                                     \
}                                                                                         \
                                                                                          \
extern "C" __global__ void dropout_add_backward_##SUFFIX(                                 \
        const R* dy, const bool* keep, X* dx, long long n, double scale) {                \
    typedef Compute<X>::type CX;                                                          \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;           \
         i += (long long)blockDim.x * gridDim.x) {                                        \
        CX g = to_compute(round_to<X>((CX)to_compute(dy[i])));                            \
        dx[i] = round_to<X>(mul_rn(g, keep[i] ? (CX)scale : (CX)0));                      \
    }                                                                                     \
}

DEFINE_DROPOUT_ADD(__half, __half, float16)
DEFINE_DROPOUT_ADD(__half, float, float16_float32)
DEFINE_DROPOUT_ADD(float, float, float32)
DEFINE_DROPOUT_ADD(double, double, float64)
