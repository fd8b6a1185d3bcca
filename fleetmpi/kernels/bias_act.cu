// fuse_elewise_add_act_ops: bias add + activation in one pass, forward and backward.
// The math is defined by bias_act_forward / bias_act_backward in reference.py.
// Layout (N, C, inner): element i belongs to channel (i / inner) % C.
// act: 0 = relu, 1 = tanh, 2 = gelu (tanh approximation).
// The sum z + bias is rounded to T (as the unfused add stores it); the activation and the
// gradients are computed in T's compute type (precision.cuh) and rounded once.

// GELU's 0.5 v (1 + tanh(u)), u = K (v + C v^3), is computed as v / (1 + exp(-2u)) as in
// reference.gelu_forward; its derivative from s = 1 / (1 + exp(-2u)) as in gelu_backward.

#include "precision.cuh"

#define GELU_K 0.7978845608028654
#define GELU_C 0.044715

template <typename C> __device__ C gelu_exp(C v) {
    return exp((v * v * (C)(-2 * GELU_K * GELU_C) - (C)(2 * GELU_K)) * v);
}

#define DEFINE_BIAS_ACT(T, SUFFIX)                                                        \
extern "C" __global__ void bias_act_forward_##SUFFIX(                                     \
        const T* z, const T* bias, T* y, T* pre, long long n, long long channels,         \
        long long inner, int act) {                                                       \
    typedef Compute<T>::type C;                                                           \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;           \
         i += (long long)blockDim.x * gridDim.x) {                                        \
        T sum = round_to<T>(to_compute(z[i]) + to_compute(bias[(i / inner) % channels])); \
        C v = to_compute(sum);                                                            \
        if (act == 0) {                                                                   \
            y[i] = v > (C)0 ? sum : round_to<T>((C)0);                                    \
        } else if (act == 1) {                                                            \
            y[i] = round_to<T>(tanh(v));                                                  \
        } else {                                                                          \
            y[i] = round_to<T>(v / (gelu_exp(v) + (C)1));                                 \
            pre[i] = sum;                                                                 \
        }                                                                                 \
    }                                                                                     \
}                                                                                         \
                                                                                          \
extern "C" __global__ void bias_act_backward_##SUFFIX(                                    \
        const T* dy, const T* y, const T* pre, T* dz, long long n, int act) {             \
    typedef Compute<T>::type C;                                                           \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;           \
         i += (long long)blockDim.x * gridDim.x) {                                        \
        C g = to_compute(dy[i]);                                                          \
        if (act == 0) {                                                                   \
            dz[i] = to_compute(y[i]) > (C)0 ? dy[i] : round_to<T>((C)0);                  \
        } else if (act == 1) {                                                            \
            C t = to_compute(y[i]);                                                       \
            dz[i] = round_to<T>(g * ((C)1 - t * t));                                      \
        } else {                                                                          \
            C v = to_compute(pre[i]);                                                     \
            C s = (C)1 / (gelu_exp(v) + (C)1);                                            \
            C d = (v * v * (C)(6 * GELU_K * GELU_C) + (C)(2 * GELU_K)) * v * s;           \
            d *= (C)1 - s;                                                                \
            dz[i] = round_to<T>((d + s) * g);                                             \
        }                                                                                 \
    }                                                                                     \
}

DEFINE_BIAS_ACT(__half, float16)
DEFINE_BIAS_ACT(float, float32)
DEFINE_BIAS_ACT(double, float64)
