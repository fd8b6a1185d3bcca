// What the kernels of this folder share about dtypes: each value is loaded into its compute
// type (float for __half and float, double for double), computed on there, and rounded once
// to its storage type as it is stored. A float16 instance therefore computes in float32, as
// the NumPy references do for float16 inputs.
//
// Rounding each float32 sum or product of float16 values to float16 gives float16 arithmetic
// exactly (float32 has more than twice float16's precision, so the double rounding is
// harmless); that is how NumPy computes float16 operations too.

#pragma once
#include <cuda_fp16.h>

// nvcc and NVRTC provide exp, log, sqrt and tanh overloaded for float and double; a host build
// of these files (the kernel checks in tests/cuda_host.py) takes the same overloads from <cmath>.
#if !defined(__CUDACC__) && !defined(__CUDACC_RTC__)
#include <cmath>
using std::exp;
using std::log;
using std::sqrt;
using std::tanh;
#endif

template <typename T> struct Compute { typedef T type; };
template <> struct Compute<__half> { typedef float type; };

__device__ inline float to_compute(__half v) { return __half2float(v); }
__device__ inline float to_compute(float v) { return v; }
__device__ inline double to_compute(double v) { return v; }

// -infinity in the compute type C (the score of a masked key): log(0), as C's and CUDA's math
// functions define it.
template <typename C> __device__ inline C negative_infinity() { return log((C)0); }

// A quiet NaN in the compute type C: sqrt(-1), as C's and CUDA's math functions define it.
template <typename C> __device__ inline C quiet_nan() { return sqrt((C)-1); }

template <typename T> __device__ inline T round_to(typename Compute<T>::type v) { return v; }
template <> __device__ inline __half round_to<__half>(float v) { return __float2half_rn(v); }

// A product and a sum the compiler may not contract into one fused multiply-add, which would
// round once where the unfused operations (separate NumPy or CuPy passes) round twice.
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
__device__ inline float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ inline double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ inline float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ inline double add_rn(double a, double b) { return __dadd_rn(a, b); }
#else
template <typename C> inline C mul_rn(C a, C b) { return a * b; }
template <typename C> inline C add_rn(C a, C b) { return a + b; }
#endif

