// fuse_all_optimizer_ops: multi-tensor kernels, each one launch over every flat array of a step
// (the flat buffers of one dtype, or the pieces of a shard), however many there are.
// The math is defined by sgd_update / momentum_update / adam_update / unscale in reference.py.
//
// The arrays come as a table of addresses: table[k * n_arrays + a] is array a of kind k (kind
// 0 the parameters, or for unscale the gradients; then the gradients and each optimizer state
// in order); array a has offsets[a + 1] - offsets[a] elements. Each array is walked by a
// grid-stride loop of its own, so every array is spread over all the threads.
//
// Scalars arrive in the arrays' dtype; Adam's bias corrections are folded into lr_t and eps_t
// on the host (lr_t = lr * sqrt(1 - beta2^t) / (1 - beta1^t), eps_t = eps * sqrt(1 - beta2^t)).

// nvcc and NVRTC provide sqrt and isfinite overloaded for float and double; a host build of this
// file (the kernel checks in tests/cuda_host.py) takes the same overloads from <cmath>.
#if !defined(__CUDACC__) && !defined(__CUDACC_RTC__)
#include <cmath>
using std::isfinite;
using std::sqrt;
#endif

template <typename T>
__device__ T* array_of(const unsigned long long* table, int kind, int n_arrays, int a) {
    return reinterpret_cast<T*>(table[(long long)kind * n_arrays + a]);
}

__device__ long long first_index() {
    return (long long)blockIdx.x * blockDim.x + threadIdx.x;
}

__device__ long long grid_stride() {
    return (long long)blockDim.x * gridDim.x;
}

template <typename T>
__device__ void sgd_element(T& param, T grad, T lr, T weight_decay) {
    T g = grad + weight_decay * param;
    param -= lr * g;
}

template <typename T>
__device__ void momentum_element(T& param, T grad, T& velocity, T lr, T momentum,
                                 T weight_decay, int nesterov) {
    T g = grad + weight_decay * param;
    T v = momentum * velocity + g;
    velocity = v;
    param -= nesterov ? lr * (g + momentum * v) : lr * v;
}

template <typename T>
__device__ void adam_element(T& param, T grad, T& moment1, T& moment2, T lr_t, T beta1,
                             T beta2, T eps_t, T l2_decay, T decoupled_scale) {
    T p = param * decoupled_scale;
    T g = grad + l2_decay * p;
    T m = beta1 * moment1 + ((T)1 - beta1) * g;
    T v = beta2 * moment2 + ((T)1 - beta2) * (g * g);
    moment1 = m;
    moment2 = v;
    param = p - lr_t * (m / (sqrt(v) + eps_t));
}

#define DEFINE_OPTIMIZER(T, SUFFIX)                                                       \
extern "C" __global__ void multi_tensor_sgd_##SUFFIX(                                     \
        const unsigned long long* table, const long long* offsets, int n_arrays, T lr,   \
        T weight_decay) {                                                                 \
    for (int a = 0; a < n_arrays; ++a) {                                                  \
        T* param = array_of<T>(table, 0, n_arrays, a);                                    \
        const T* grad = array_of<T>(table, 1, n_arrays, a);                               \
        for (long long i = first_index(); i < offsets[a + 1] - offsets[a];                \
             i += grid_stride())                                                          \
            sgd_element(param[i], grad[i], lr, weight_decay);                             \
    }                                                                                     \
}                                                                                         \
                                                                                          \
extern "C" __global__ void multi_tensor_momentum_##SUFFIX(                                \
        const unsigned long long* table, const long long* offsets, int n_arrays, T lr,   \
        T momentum, T weight_decay, int nesterov) {                                       \
    for (int a = 0; a < n_arrays; ++a) {                                                  \
        T* param = array_of<T>(table, 0, n_arrays, a);                                    \
        const T* grad = array_of<T>(table, 1, n_arrays, a);                               \
        T* velocity = array_of<T>(table, 2, n_arrays, a);                                 \
        for (long long i = first_index(); i < offsets[a + 1] - offsets[a];                \
             i += grid_stride())                                                          \
            momentum_element(param[i], grad[i], velocity[i], lr, momentum, weight_decay,  \
                             nesterov);                                                   \
    }                                                                                     \
}                                                                                         \
                                                                                          \
extern "C" __global__ void multi_tensor_adam_##SUFFIX(                                    \
        const unsigned long long* table, const long long* offsets, int n_arrays, T lr_t, \
        T beta1, T beta2, T eps_t, T l2_decay, T decoupled_scale) {                       \
    for (int a = 0; a < n_arrays; ++a) {                                                  \
        T* param = array_of<T>(table, 0, n_arrays, a);                                    \
        const T* grad = array_of<T>(table, 1, n_arrays, a);                               \
        T* moment1 = array_of<T>(table, 2, n_arrays, a);                                  \
        T* moment2 = array_of<T>(table, 3, n_arrays, a);                                  \
        for (long long i = first_index(); i < offsets[a + 1] - offsets[a];                \
             i += grid_stride())                                                          \
            adam_element(param[i], grad[i], moment1[i], moment2[i], lr_t, beta1, beta2,   \
                         eps_t, l2_decay, decoupled_scale);                               \
    }                                                                                     \
}

// amp: every gradient multiplied by inverse (1 / loss scale) in place, and *found set to token
// when any result is inf or NaN. Several threads may store to *found in one launch, all of them
// the same value with a plain store: whichever store lands last, *found ends as token, and no
// thread reads it, so the race is benign and needs no atomic (the host shim, running the
// threads one after another, computes the same). The caller passes a new token each launch, so
// *found == token afterwards means "found in this launch", with no launch to clear the flag.
#define DEFINE_UNSCALE(T, SUFFIX)                                                         \
extern "C" __global__ void multi_tensor_unscale_##SUFFIX(                                 \
        const unsigned long long* table, const long long* offsets, int n_arrays,          \
        T inverse, int* found, int token) {                                               \
    for (int a = 0; a < n_arrays; ++a) {                                                  \
        T* grad = array_of<T>(table, 0, n_arrays, a);                                     \
        for (long long i = first_index(); i < offsets[a + 1] - offsets[a];                \
             i += grid_stride()) {                                                        \
            T g = grad[i] * inverse;                                                      \
            grad[i] = g;                                                                  \
            if (!isfinite(g)) *found = token;                                             \
        }                                                                                 \
    }                                                                                     \
}

DEFINE_OPTIMIZER(float, float32)
DEFINE_OPTIMIZER(double, float64)
DEFINE_UNSCALE(float, float32)
DEFINE_UNSCALE(double, float64)
