// fuse_elewise_add_act_ops: bias add + activation in one pass, forward and backward.
// The math is defined by bias_act_forward / bias_act_backward in reference.py.
// Layout (N, C, inner): element i belongs to channel (i / inner) % C.
// act: 0 = relu, 1 = tanh, 2 = gelu (tanh approximation).

// GELU's 0.5 v (1 + tanh(u)), u = K (v + C v^3), is computed as v / (1 + exp(-2u)) as in
// reference.gelu_forward; its derivative from s = 1 / (1 + exp(-2u)) as in gelu_backward.

// nvcc and NVRTC provide tanh and exp overloaded for float and double; a host build of this
// file (the kernel checks in tests/cuda_host.py) takes the same overloads from <cmath>.
#if !defined(__CUDACC__) && !defined(__CUDACC_RTC__)
#include <cmath>
using std::exp;
using std::tanh;
#endif

#define GELU_K 0.7978845608028654
#define GELU_C 0.044715
#define GELU_EXP(T, v) exp(((v) * (v) * (T)(-2 * GELU_K * GELU_C) - (T)(2 * GELU_K)) * (v))

#define DEFINE_BIAS_ACT(T, SUFFIX)                                                        \
extern "C" __global__ void bias_act_forward_##SUFFIX(                                     \
        const T* z, const T* bias, T* y, T* pre, long long n, long long channels,         \
        long long inner, int act) {                                                       \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;           \
         i += (long long)blockDim.x * gridDim.x) {                                        \
        T v = z[i] + bias[(i / inner) % channels];                                        \
        if (act == 0) {                                                                   \
            y[i] = v > (T)0 ? v : (T)0;                                                   \
        } else if (act == 1) {                                                            \
            y[i] = tanh(v);                                                               \
        } else {                                                                          \
            y[i] = v / (GELU_EXP(T, v) + (T)1);                                           \
            pre[i] = v;                                                                   \
        }                                                                                 \
    }                                                                                     \
}                                                                                         \
                                                                                          \
extern "C" __global__ void bias_act_backward_##SUFFIX(                                    \
        const T* dy, const T* y, const T* pre, T* dz, long long n, int act) {             \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;           \
         i += (long long)blockDim.x * gridDim.x) {                                        \
        if (act == 0) {                                                                   \
            dz[i] = y[i] > (T)0 ? dy[i] : (T)0;                                           \
        } else if (act == 1) {                                                            \
            dz[i] = dy[i] * ((T)1 - y[i] * y[i]);                                         \
        } else {                                                                          \
            T v = pre[i];                                                                 \
            T s = (T)1 / (GELU_EXP(T, v) + (T)1);                                         \
            T d = (v * v * (T)(6 * GELU_K * GELU_C) + (T)(2 * GELU_K)) * v * s;           \
            d *= (T)1 - s;                                                                \
            dz[i] = (d + s) * dy[i];                                                      \
        }                                                                                 \
    }                                                                                     \
}

DEFINE_BIAS_ACT(float, float32)
DEFINE_BIAS_ACT(double, float64)
