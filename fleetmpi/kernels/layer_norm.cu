// LayerNorm, forward and backward. The math is defined by layer_norm_forward /
// layer_norm_xhat / layer_norm_backward in transformer_reference.py.
// Layout: `rows` rows of `cols` contiguous values (the trailing axes the weight covers). T is
// the dtype of x, y, dy and dx; W, T's compute type (precision.cuh), that of the weight, the
// bias, their gradients and the per-row mean and rstd (1 / sqrt(var + epsilon)).
//
// Forward: one thread per row, three passes over it (mean, variance about the mean, output).
// Backward: one work item per row (its input gradient, two passes) and one per column (the
// weight and bias gradients, summed over the rows), in one grid-stride loop. Why one thread
// per row: transformer_reference.py's docstring. What it costs on a GPU: neighbouring threads
// read addresses a row apart (uncoalesced, mostly served from L1 as each walks its row), only
// `rows` threads run the forward (tens of thousands for a transformer step, a fraction of a
// large GPU's thread slots) and only `cols` threads the parameters' gradients, each walking
// every row. A block per row reducing in shared memory would read coalesced and fill the GPU.

#include "precision.cuh"

template <typename T, typename W>
__device__ void normalize_row(const T* x, const W* weight, const W* bias, T* y, W* mean,
                              W* rstd, long long cols, W epsilon) {
    W sum = 0;
    for (long long c = 0; c < cols; ++c) sum += to_compute(x[c]);
    W mu = sum / (W)cols;
    W squares = 0;
    for (long long c = 0; c < cols; ++c) {
        W d = to_compute(x[c]) - mu;
        squares += d * d;
    }
    W inv = (W)1 / sqrt(squares / (W)cols + epsilon);
    for (long long c = 0; c < cols; ++c) {
        y[c] = round_to<T>((to_compute(x[c]) - mu) * inv * weight[c] + bias[c]);
    }
    *mean = mu;
    *rstd = inv;
}

// dx = rstd / n * (n * g - sum(g) - xhat * sum(g * xhat)) with g = dy * weight, n = cols.
template <typename T, typename W>
__device__ void row_input_grad(const T* dy, const T* x, W mu, W inv, const W* weight, T* dx,
                               long long cols) {
    W sum_g = 0, sum_g_xhat = 0;
    for (long long c = 0; c < cols; ++c) {
        W g = to_compute(dy[c]) * weight[c];
        sum_g += g;
        sum_g_xhat += g * ((to_compute(x[c]) - mu) * inv);
    }
    W n = (W)cols;
    for (long long c = 0; c < cols; ++c) {
        W g = to_compute(dy[c]) * weight[c];
        W xhat = (to_compute(x[c]) - mu) * inv;
        dx[c] = round_to<T>(inv / n * (n * g - sum_g - xhat * sum_g_xhat));
    }
}

template <typename T, typename W>
__device__ void column_param_grads(const T* dy, const T* x, const W* mean, const W* rstd,
                                   W* dweight, W* dbias, long long c, long long rows,
                                   long long cols) {
    W dw = 0, db = 0;
    for (long long r = 0; r < rows; ++r) {
        W g = to_compute(dy[r * cols + c]);
        dw += g * ((to_compute(x[r * cols + c]) - mean[r]) * rstd[r]);
        db += g;
    }
    dweight[c] = dw;
    dbias[c] = db;
}

#define DEFINE_LAYER_NORM(T, W, SUFFIX)                                                   \
extern "C" __global__ void layer_norm_forward_##SUFFIX(                                   \
        const T* x, const W* weight, const W* bias, T* y, W* mean, W* rstd,               \
        long long rows, long long cols, W epsilon) {                                      \
    for (long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x; r < rows;        \
         r += (long long)blockDim.x * gridDim.x) {                                        \
        normalize_row(x + r * cols, weight, bias, y + r * cols, mean + r, rstd + r, cols, \
                      epsilon);                                                           \
    }                                                                                     \
}                                                                                         \
                                                                                          \
extern "C" __global__ void layer_norm_backward_##SUFFIX(                                  \
        const T* dy, const T* x, const W* mean, const W* rstd, const W* weight, T* dx,    \
        W* dweight, W* dbias, long long rows, long long cols) {                           \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < rows + cols; \
         i += (long long)blockDim.x * gridDim.x) {                                        \
        if (i < rows) {                                                                   \
            row_input_grad(dy + i * cols, x + i * cols, mean[i], rstd[i], weight,         \
                           dx + i * cols, cols);                                          \
        } else {                                                                          \
            column_param_grads(dy, x, mean, rstd, dweight, dbias, i - rows, rows, cols);  \
        }                                                                                 \
    }                                                                                     \
}

DEFINE_LAYER_NORM(__half, float, float16_float32)
DEFINE_LAYER_NORM(float, float, float32)
DEFINE_LAYER_NORM(double, double, float64)
