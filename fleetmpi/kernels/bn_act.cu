// fuse_bn_act_ops: batch norm + ReLU, forward and backward, given per-channel statistics.
// The math is defined by bn_act_forward / bn_act_backward_mask / bn_input_grad in reference.py;
// the per-channel reductions (mean, variance, sums of the output gradient) are done before.
// Layout (N, C, inner): element i belongs to channel (i / inner) % C.

#define DEFINE_BN_ACT(T, SUFFIX)                                                          \
extern "C" __global__ void bn_act_forward_##SUFFIX(                                       \
        const T* x, const T* mean, const T* invstd, const T* gamma, const T* beta, T* y,  \
        long long n, long long channels, long long inner) {                               \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;           \
         i += (long long)blockDim.x * gridDim.x) {                                        \
        long long c = (i / inner) % channels;                                             \
        T v = gamma[c] * ((x[i] - mean[c]) * invstd[c]) + beta[c];                        \
        y[i] = v > (T)0 ? v : (T)0;                                                       \
    }                                                                                     \
}                                                                                         \
                                                                                          \
extern "C" __global__ void bn_act_backward_mask_##SUFFIX(                                 \
        const T* dy, const T* y, T* dz, long long n) {                                    \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;           \
         i += (long long)blockDim.x * gridDim.x) {                                        \
        dz[i] = y[i] > (T)0 ? dy[i] : (T)0;                                               \
    }                                                                                     \
}                                                                                         \
                                                                                          \
extern "C" __global__ void bn_input_grad_##SUFFIX(                                        \
        const T* dz, const T* xhat, const T* invstd, const T* gamma, const T* sum_dz,     \
        const T* sum_dz_xhat, T* dx, long long n, long long channels, long long inner,    \
        T count) {                                                                        \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;           \
         i += (long long)blockDim.x * gridDim.x) {                                        \
        long long c = (i / inner) % channels;                                             \
        T scale = gamma[c] * invstd[c] / count;                                           \
        dx[i] = scale * (count * dz[i] - sum_dz[c] - xhat[i] * sum_dz_xhat[c]);           \
    }                                                                                     \
}

DEFINE_BN_ACT(float, float32)
DEFINE_BN_ACT(double, float64)
