// Scaled dot-product attention, softmax(scale * q k^T + mask) v, forward and backward, without
// the (q_len, k_len) scores or probabilities in memory. The math is defined by
// attention_forward / attention_backward in attention_reference.py.
// Layout: the leading axes (batch, heads) folded into one batch index b; per b, q_len query rows
// of head_dim values (q, dq), k_len key rows of head_dim (k, dk) and of value_dim (v, dv), and
// q_len output rows of value_dim (out, dout), each array contiguous. T is the dtype of those; W,
// T's compute type (precision.cuh), that of each query row's log-sum-exp `lse` and
// `delta` = rowsum(dout * out) (attention_delta in the reference, formed before the backward
// kernel), of a float mask and of `scale`.
//
// The mask: mask_kind 0 none, 1 boolean (`keep`, true where the query may attend the key), 2
// additive (`bias`, added to the scores). The element of (b, i, j) lies at
// mask_offset[b] + i * mask_row_stride + j * mask_col_stride: a stride is 0 along an axis the
// mask broadcasts, and mask_offset maps each folded batch index to the slab of the mask it
// reads, so a mask shared along the batch or the heads is read where it lies, never expanded.
// is_causal: query i attends keys j <= i only (the loops stop there).
//
// Forward (attention_forward): one thread per query row; an online softmax over the keys: the
// running maximum m, the running sum l of exp(s - m) and the output accumulator acc, both
// rescaled by exp(m_old - m_new) when a key raises the maximum. It writes out = acc / l and
// lse = m + log(l) (+inf for a row with no key to attend: its output is 0 and the probabilities
// recomputed from it are 0).
// Backward (attention_backward, FlashAttention-2's recomputation, P_ij = exp(s_ij - lse_i)): one
// work item per query row, which loops over the keys for
// dq_i = scale * sum_j P_ij (dout_i . v_j - delta_i) k_j, and one per key row, which loops over
// the queries for dk_j = scale * sum_i P_ij (dout_i . v_j - delta_i) q_i and
// dv_j = sum_i P_ij dout_i, in one grid-stride loop. Each output row is written by the one
// thread that owns it: no atomics, sums in one order.
//
// Per-thread rows. A thread holds the rows it reuses at every step (its query, or its key and
// value, the gradient row it reads, and its accumulators) in arrays of MAX_HEAD_DIM compute-type
// values, so one kernel body serves every head size up to 256 (the largest common one). Indexed
// by a loop bound known only at run time, those arrays cannot live in registers: they take a
// stack frame in local memory, per thread 2 arrays (forward) or 4 (backward: 3 for a query row,
// 4 for a key row) of 1 KiB in float32 and float16, 2 KiB in float64 (`nvcc -Xptxas -v` for
// sm_90: stack frames of 2048 and 4096 bytes, twice that in float64, no spills, 32 to 46
// registers per thread). The device reserves that frame for every thread it can hold at once
// (on an H100, 132 SMs x 2048 threads x 4 KiB is about 1.1 GB for the backward in float32,
// 2.2 GB in float64), and each update of an accumulator is a local-memory load and store,
// mostly served from L1 and L2. Neighbouring threads of a warp walk the same keys (or queries)
// at the same time, so those reads are broadcasts. The dot products run on the CUDA cores, not
// the tensor cores, one query (or key) row per thread: what this kernel gives is memory
// O(seq * head_dim) and every mask, not cuDNN's speed (docs/performance.md).

#include "precision.cuh"

constexpr int MAX_HEAD_DIM = 256;

struct Dims {
    long long q_len, k_len, head_dim, value_dim;
};

template <typename W> struct Mask {
    const bool* keep;
    const W* bias;
    const long long* offset;
    long long row_stride, col_stride;
    int kind;
};

// What the mask adds to the score of query i and key j of batch b: 0, -inf or the float mask.
template <typename W>
__device__ inline W mask_at(const Mask<W>& mask, long long b, long long i, long long j) {
    if (mask.kind == 0) return 0;
    long long at = mask.offset[b] + i * mask.row_stride + j * mask.col_stride;
    if (mask.kind == 1) return mask.keep[at] ? (W)0 : negative_infinity<W>();
    return mask.bias[at];
}

template <typename T, typename W>
__device__ inline void load_row(W* held, const T* row, long long n) {
    for (long long d = 0; d < n; ++d) held[d] = to_compute(row[d]);
}

template <typename T, typename W>
__device__ inline W dot(const W* held, const T* row, long long n) {
    W sum = 0;
    for (long long d = 0; d < n; ++d) sum += held[d] * to_compute(row[d]);
    return sum;
}

// held += weight * row, over n values.
template <typename T, typename W>
__device__ inline void add_scaled(W* held, W weight, const T* row, long long n) {
    for (long long d = 0; d < n; ++d) held[d] += weight * to_compute(row[d]);
}

template <typename T, typename W>
__device__ void attend_row(const T* q, const T* k, const T* v, T* out, W* lse,
                           const Mask<W>& mask, long long b, long long i, const Dims& dims,
                           int is_causal, W scale) {
    W query[MAX_HEAD_DIM], acc[MAX_HEAD_DIM];
    load_row(query, q, dims.head_dim);
    for (long long d = 0; d < dims.value_dim; ++d) acc[d] = 0;
    W top = negative_infinity<W>(), total = 0;
    long long keys = is_causal && i + 1 < dims.k_len ? i + 1 : dims.k_len;
    for (long long j = 0; j < keys; ++j) {
        W s = dot(query, k + j * dims.head_dim, dims.head_dim) * scale + mask_at(mask, b, i, j);
        if (s == negative_infinity<W>()) continue;
        if (s > top) {
            W shrink = exp(top - s);
            total *= shrink;
            for (long long d = 0; d < dims.value_dim; ++d) acc[d] *= shrink;
            top = s;
        }
        W p = exp(s - top);
        total += p;
        add_scaled(acc, p, v + j * dims.value_dim, dims.value_dim);
    }
    for (long long d = 0; d < dims.value_dim; ++d) {
        out[d] = round_to<T>(total > 0 ? acc[d] / total : (W)0);
    }
    *lse = total > 0 ? top + log(total) : -negative_infinity<W>();
}

template <typename T, typename W>
__device__ void query_row_grad(const T* q, const T* k, const T* v, const T* dout, W lse,
                               W delta, T* dq, const Mask<W>& mask, long long b, long long i,
                               const Dims& dims, int is_causal, W scale) {
    W query[MAX_HEAD_DIM], grad_out[MAX_HEAD_DIM], grad[MAX_HEAD_DIM];
    load_row(query, q, dims.head_dim);
    load_row(grad_out, dout, dims.value_dim);
    for (long long d = 0; d < dims.head_dim; ++d) grad[d] = 0;
    long long keys = is_causal && i + 1 < dims.k_len ? i + 1 : dims.k_len;
    for (long long j = 0; j < keys; ++j) {
        W s = dot(query, k + j * dims.head_dim, dims.head_dim) * scale + mask_at(mask, b, i, j);
        W p = exp(s - lse);
        if (p == 0) continue;
        W ds = p * (dot(grad_out, v + j * dims.value_dim, dims.value_dim) - delta);
        add_scaled(grad, ds, k + j * dims.head_dim, dims.head_dim);
    }
    for (long long d = 0; d < dims.head_dim; ++d) dq[d] = round_to<T>(grad[d] * scale);
}

template <typename T, typename W>
__device__ void key_row_grads(const T* q, const T* k, const T* v, const T* dout, const W* lse,
                              const W* delta, T* dk, T* dv, const Mask<W>& mask, long long b,
                              long long j, const Dims& dims, int is_causal, W scale) {
    W key[MAX_HEAD_DIM], value[MAX_HEAD_DIM], grad_k[MAX_HEAD_DIM], grad_v[MAX_HEAD_DIM];
    load_row(key, k, dims.head_dim);
    load_row(value, v, dims.value_dim);
    for (long long d = 0; d < dims.head_dim; ++d) grad_k[d] = 0;
    for (long long d = 0; d < dims.value_dim; ++d) grad_v[d] = 0;
    for (long long i = is_causal ? j : 0; i < dims.q_len; ++i) {
        W s = dot(key, q + i * dims.head_dim, dims.head_dim) * scale + mask_at(mask, b, i, j);
        W p = exp(s - lse[i]);
        if (p == 0) continue;
        const T* g = dout + i * dims.value_dim;
        add_scaled(grad_v, p, g, dims.value_dim);
        W ds = p * (dot(value, g, dims.value_dim) - delta[i]);
        add_scaled(grad_k, ds, q + i * dims.head_dim, dims.head_dim);
    }
    for (long long d = 0; d < dims.head_dim; ++d) dk[d] = round_to<T>(grad_k[d] * scale);
    for (long long d = 0; d < dims.value_dim; ++d) dv[d] = round_to<T>(grad_v[d]);
}

// The work items: the forward's `rows` = batch * q_len query rows; the backward's
// batch * q_len query rows, then batch * k_len key rows.
#define DEFINE_ATTENTION(T, W, SUFFIX)                                                     \
extern "C" __global__ void attention_forward_##SUFFIX(                                     \
        const T* q, const T* k, const T* v, const bool* keep, const W* bias,               \
        const long long* mask_offset, T* out, W* lse, long long rows, long long q_len,     \
        long long k_len, long long head_dim, long long value_dim,                          \
        long long mask_row_stride, long long mask_col_stride, int mask_kind,               \
        int is_causal, W scale) {                                                          \
    Dims dims = {q_len, k_len, head_dim, value_dim};                                       \
    Mask<W> mask = {keep, bias, mask_offset, mask_row_stride, mask_col_stride, mask_kind}; \
    for (long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x; r < rows;         \
         r += (long long)blockDim.x * gridDim.x) {                                         \
        long long b = r / q_len;                                                           \
        attend_row(q + r * head_dim, k + b * k_len * head_dim, v + b * k_len * value_dim,  \
                   out + r * value_dim, lse + r, mask, b, r - b * q_len, dims, is_causal,  \
                   scale);                                                                 \
    }                                                                                      \
}                                                                                          \
                                                                                           \
extern "C" __global__ void attention_backward_##SUFFIX(                                    \
        const T* q, const T* k, const T* v, const T* dout, const W* lse, const W* delta,   \
        const bool* keep, const W* bias, const long long* mask_offset, T* dq, T* dk,       \
        T* dv, long long batch, long long q_len, long long k_len, long long head_dim,      \
        long long value_dim, long long mask_row_stride, long long mask_col_stride,         \
        int mask_kind, int is_causal, W scale) {                                           \
    Dims dims = {q_len, k_len, head_dim, value_dim};                                       \
    Mask<W> mask = {keep, bias, mask_offset, mask_row_stride, mask_col_stride, mask_kind}; \
    long long q_rows = batch * q_len;                                                      \
    for (long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x;                   \
         r < q_rows + batch * k_len; r += (long long)blockDim.x * gridDim.x) {             \
        if (r < q_rows) {                                                                  \
            long long b = r / q_len;                                                       \
            query_row_grad(q + r * head_dim, k + b * k_len * head_dim,                     \
                           v + b * k_len * value_dim, dout + r * value_dim, lse[r],        \
                           delta[r], dq + r * head_dim, mask, b, r - b * q_len, dims,      \
                           is_causal, scale);                                              \
        } else {                                                                           \
            long long key_row = r - q_rows, b = key_row / k_len;                           \
            key_row_grads(q + b * q_len * head_dim, k + key_row * head_dim,                \
                          v + key_row * value_dim, dout + b * q_len * value_dim,           \
                          lse + b * q_len, delta + b * q_len, dk + key_row * head_dim,     \
                          dv + key_row * value_dim, mask, b, key_row - b * k_len, dims,    \
                          is_causal, scale);                                               \
        }                                                                                  \
    }                                                                                      \
}

DEFINE_ATTENTION(__half, float, float16_float32)
DEFINE_ATTENTION(float, float, float32)
DEFINE_ATTENTION(double, double, float64)
