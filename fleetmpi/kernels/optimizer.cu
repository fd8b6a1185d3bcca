// fuse_all_optimizer_ops: one kernel updates a whole flat parameter buffer.
// The math is defined by sgd_update / momentum_update / adam_update in reference.py.
// Scalars arrive in the buffer's dtype; Adam's bias corrections are folded into lr_t and eps_t
// on the host (lr_t = lr * sqrt(1 - beta2^t) / (1 - beta1^t), eps_t = eps * sqrt(1 - beta2^t)).

// nvcc and NVRTC provide sqrt overloaded for float and double; a host build of this file (the
// kernel checks in tests/cuda_host.py) takes the same overloads from <cmath>.
#if !defined(__CUDACC__) && !defined(__CUDACC_RTC__)
#include <cmath>
using std::sqrt;
#endif

#define DEFINE_OPTIMIZER(T, SUFFIX)                                                       \
extern "C" __global__ void sgd_update_##SUFFIX(                                           \
        T* param, const T* grad, long long n, T lr, T weight_decay) {                     \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;           \
         i += (long long)blockDim.x * gridDim.x) {                                        \
        T g = grad[i] + weight_decay * param[i];                                          \
        param[i] -= lr * g;                                                               \
    }                                                                                     \
}                                                                                         \
                                                                                          \
extern "C" __global__ void momentum_update_##SUFFIX(                                      \
        T* param, const T* grad, T* velocity, long long n, T lr, T momentum,              \
        T weight_decay, int nesterov) {                                                   \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;           \
         i += (long long)blockDim.x * gridDim.x) {                                        \
        T g = grad[i] + weight_decay * param[i];                                          \
        T v = momentum * velocity[i] + g;                                                 \
        velocity[i] = v;                                                                  \
        param[i] -= nesterov ? lr * (g + momentum * v) : lr * v;                          \
    }                                                                                     \
}                                                                                         \
                                                                                          \
extern "C" __global__ void adam_update_##SUFFIX(                                          \
        T* param, const T* grad, T* moment1, T* moment2, long long n, T lr_t, T beta1,    \
        T beta2, T eps_t, T l2_decay, T decoupled_scale) {                                \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;           \
         i += (long long)blockDim.x * gridDim.x) {                                        \
        T p = param[i] * decoupled_scale;                                                 \
        T g = grad[i] + l2_decay * p;                                                     \
        T m = beta1 * moment1[i] + ((T)1 - beta1) * g;                                    \
        T v = beta2 * moment2[i] + ((T)1 - beta2) * (g * g);                              \
        moment1[i] = m;                                                                   \
        moment2[i] = v;                                                                   \
        param[i] = p - lr_t * (m / (sqrt(v) + eps_t));                                    \
    }                                                                                     \
}

DEFINE_OPTIMIZER(float, float32)
DEFINE_OPTIMIZER(double, float64)
