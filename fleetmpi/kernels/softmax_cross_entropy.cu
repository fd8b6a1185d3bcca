// Softmax cross entropy of integer labels, forward and backward. The math is defined by
// softmax_cross_entropy_forward / log_probs / softmax_cross_entropy_backward in
// transformer_reference.py.
// Layout: `rows` rows of `classes` contiguous logits, one label per row. T is the dtype of the
// logits and their gradient; W, T's compute type (precision.cuh), that of the per-row loss,
// maximum and log of the sum of exponentials (the statistics backward needs) and of the scale.
// float16 logits are read as they are and converted value by value: no float32 copy of them.
//
// Forward: one thread per row, two passes over it (the maximum, then the sum of exp(x - max));
// why: transformer_reference.py's docstring. What it costs on a GPU: for a large vocabulary
// each thread walks a long row, neighbouring threads a row apart (uncoalesced, mostly served
// from L1), and only `rows` threads run; a block per row reducing in shared memory would read
// coalesced and fill the GPU. Backward, which writes the whole (rows, classes) gradient, is
// elementwise and uses every thread.
//
// Labels that live on the device are not checked on the host (reading them back would make
// the host wait at every step, and a CUDA graph cannot capture that): a label outside
// [0, classes) gives its row a NaN loss and NaN gradients, which the non-finite check of a
// step reports, where reading logits[label] would read out of bounds.

#include "precision.cuh"

template <typename T, typename W>
__device__ void row_loss(const T* logits, long long label, W* loss, W* row_max, W* row_logsum,
                         long long classes) {
    W m = to_compute(logits[0]);
    for (long long j = 1; j < classes; ++j) {
        W v = to_compute(logits[j]);
        m = v > m ? v : m;
    }
    W sum = 0;
    for (long long j = 0; j < classes; ++j) sum += exp(to_compute(logits[j]) - m);
    W logsum = log(sum);
    *loss = label >= 0 && label < classes ? logsum - (to_compute(logits[label]) - m)
                                          : quiet_nan<W>();
    *row_max = m;
    *row_logsum = logsum;
}

// scale: the gradient of each row's loss, at scale[r * scale_stride] (stride 0: one for all).
#define DEFINE_SOFTMAX_CROSS_ENTROPY(T, W, SUFFIX)                                        \
extern "C" __global__ void softmax_cross_entropy_forward_##SUFFIX(                        \
        const T* logits, const long long* labels, W* loss, W* row_max, W* row_logsum,     \
        long long rows, long long classes) {                                              \
    for (long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x; r < rows;        \
         r += (long long)blockDim.x * gridDim.x) {                                        \
        row_loss(logits + r * classes, labels[r], loss + r, row_max + r, row_logsum + r,  \
                 classes);                                                                \
    }                                                                                     \
}                                                                                         \
                                                                                          \
extern "C" __global__ void softmax_cross_entropy_backward_##SUFFIX(                       \
        const T* logits, const long long* labels, const W* row_max, const W* row_logsum,  \
        const W* scale, T* dlogits, long long n, long long classes,                       \
        long long scale_stride) {                                                         \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;           \
         i += (long long)blockDim.x * gridDim.x) {                                        \
        long long r = i / classes;                                                        \
        W g = exp((to_compute(logits[i]) - row_max[r]) - row_logsum[r]);                  \
        if (labels[r] < 0 || labels[r] >= classes) g = quiet_nan<W>();                    \
        else if (i - r * classes == labels[r]) g -= (W)1;                                 \
        dlogits[i] = round_to<T>(g * scale[r * scale_stride]);                            \
    }                                                                                     \
}

DEFINE_SOFTMAX_CROSS_ENTROPY(__half, float, float16_float32)
DEFINE_SOFTMAX_CROSS_ENTROPY(float, float, float32)
DEFINE_SOFTMAX_CROSS_ENTROPY(double, double, float64)
