// fuse_all_optimizer_ops: multi-tensor kernels, each one launch over every flat array of a step
// (the flat buffers of one dtype, or the pieces of a shard), however many there are.
// The math is defined by sgd_update / momentum_update / adam_update / unscale / check_finite in
// reference.py.
//
// The arrays come as a table of addresses: table[k * n_arrays + a] is array a of kind k (kind
// 0 the parameters, or for unscale the gradients; then the gradients and each optimizer state
// in order); array a has offsets[a + 1] - offsets[a] elements. Each array is walked by a
// grid-stride loop of its own, so every array is spread over all the threads.
//
// Scalars arrive in the arrays' dtype, but for Adam's: its bias corrections come from the
// count of updates so far, a device counter (steps[0], counted by the caller), so that a step
// captured in a CUDA graph corrects each replay by its own count. Each thread folds them into
// lr_t and eps_t in double, as the host does in Python floats (lr_t = lr * sqrt(1 - beta2^t)
// / (1 - beta1^t), eps_t = eps * sqrt(1 - beta2^t)); sqrt and the division round exactly, pow
// to within an ulp of the host's, so a GPU step may differ from the host's in the last bit of
// lr_t or eps_t (the host build of this file, using the host's pow, matches it bit for bit).
//
// Every update takes amp's overflow flag (found, an int32 the unscale pass set to 1, or a zero
// flag where amp is off): where it is set the launch leaves parameters and state untouched, so
// the update is launched whether or not the step is skipped, with no read on the host.

// nvcc and NVRTC provide sqrt, pow and isfinite overloaded for float and double; a host build
// of this file (the kernel checks in tests/cuda_host.py) takes the same overloads from <cmath>.
#if !defined(__CUDACC__) && !defined(__CUDACC_RTC__)
#include <cmath>
using std::isfinite;
using std::pow;
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
        const unsigned long long* table, const long long* offsets, int n_arrays,          \
        const int* found, T lr, T weight_decay) {                                         \
    if (*found) return;                                                                   \
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
        const unsigned long long* table, const long long* offsets, int n_arrays,          \
        const int* found, T lr, T momentum, T weight_decay, int nesterov) {               \
    if (*found) return;                                                                   \
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
        const unsigned long long* table, const long long* offsets, int n_arrays,          \
        const int* found, const long long* steps, double lr, double beta1, double beta2,  \
        double epsilon, T l2_decay, T decoupled_scale) {                                  \
    if (*found) return;                                                                   \
    double t = (double)*steps;                                                            \
    double correction2 = sqrt(1.0 - pow(beta2, t));                                       \
    T lr_t = (T)(lr * correction2 / (1.0 - pow(beta1, t)));                               \
    T eps_t = (T)(epsilon * correction2);                                                 \
    for (int a = 0; a < n_arrays; ++a) {                                                  \
        T* param = array_of<T>(table, 0, n_arrays, a);                                    \
        const T* grad = array_of<T>(table, 1, n_arrays, a);                               \
        T* moment1 = array_of<T>(table, 2, n_arrays, a);                                  \
        T* moment2 = array_of<T>(table, 3, n_arrays, a);                                  \
        for (long long i = first_index(); i < offsets[a + 1] - offsets[a];                \
             i += grid_stride())                                                          \
            adam_element(param[i], grad[i], moment1[i], moment2[i], lr_t, (T)beta1,       \
                         (T)beta2, eps_t, l2_decay, decoupled_scale);                      \
    }                                                                                     \
}

// amp: every gradient multiplied by *inverse (1 / loss scale, a float32 on the device, where
// amp's loss scaling keeps it) in place, and *found set to 1 when any result is inf or NaN.
// Several threads may store to *found in one launch, all of them the same value with a plain
// store: whichever store lands last, *found ends as 1, and no thread reads it, so the race is
// benign and needs no atomic (the host shim, running the threads one after another, computes
// the same). The caller clears the flag before the step's first launch.
#define DEFINE_UNSCALE(T, SUFFIX)                                                         \
extern "C" __global__ void multi_tensor_unscale_##SUFFIX(                                 \
        const unsigned long long* table, const long long* offsets, int n_arrays,          \
        const float* inverse, int* found) {                                               \
    T scale = (T)*inverse;                                                                \
    for (int a = 0; a < n_arrays; ++a) {                                                  \
        T* grad = array_of<T>(table, 0, n_arrays, a);                                     \
        for (long long i = first_index(); i < offsets[a + 1] - offsets[a];                \
             i += grid_stride()) {                                                        \
            T g = grad[i] * scale;                                                        \
            grad[i] = g;                                                                  \
            if (!isfinite(g)) *found = 1;                                                 \
        }                                                                                 \
    }                                                                                     \
}

// The non-finite check of training without amp: *found set to 1 when any gradient element is
// inf or NaN, nothing written otherwise (the same benign race as unscale's).
#define DEFINE_CHECK_FINITE(T, SUFFIX)                                                    \
extern "C" __global__ void multi_tensor_check_finite_##SUFFIX(                            \
        const unsigned long long* table, const long long* offsets, int n_arrays,          \
        int* found) {                                                                     \
    for (int a = 0; a < n_arrays; ++a) {                                                  \
        const T* grad = array_of<T>(table, 0, n_arrays, a);                               \
        for (long long i = first_index(); i < offsets[a + 1] - offsets[a];                \
             i += grid_stride())                                                          \
            if (!isfinite(grad[i])) *found = 1;                                           \
    }                                                                                     \
}

DEFINE_OPTIMIZER(float, float32)
DEFINE_OPTIMIZER(double, float64)
DEFINE_UNSCALE(float, float32)
DEFINE_UNSCALE(double, float64)
DEFINE_CHECK_FINITE(float, float32)
DEFINE_CHECK_FINITE(double, float64)
