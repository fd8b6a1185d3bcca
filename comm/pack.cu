// Batched copies between many arrays and one flat fusion buffer: one launch packs (or unpacks)
// a whole bucket, however many arrays it holds. The NumPy reference is pack.py's
// pack_reference / unpack_reference.
//
// ptrs[a] is the address of array a (C-contiguous), offsets[a] its first element in the flat
// buffer; offsets has n_arrays + 1 entries and offsets[n_arrays] is the total element count.
// Elements are moved as opaque words of itemsize bytes (2, 4 or 8).

__device__ int find_array(const long long* offsets, int n_arrays, long long i) {
    int lo = 0, hi = n_arrays;
    while (hi - lo > 1) {
        int mid = (lo + hi) / 2;
        if (offsets[mid] <= i) lo = mid; else hi = mid;
    }
    return lo;
}

template <typename T>
__device__ void copy_words(const unsigned long long* ptrs, const long long* offsets,
                           int n_arrays, T* flat, bool to_flat) {
    long long total = offsets[n_arrays];
    long long stride = (long long)blockDim.x * gridDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        int a = find_array(offsets, n_arrays, i);
        T* array = reinterpret_cast<T*>(ptrs[a]);
        long long j = i - offsets[a];
        if (to_flat) flat[i] = array[j]; else array[j] = flat[i];
    }
}

template <bool to_flat>
__device__ void copy_bucket(const unsigned long long* ptrs, const long long* offsets,
                            int n_arrays, void* flat, int itemsize) {
    switch (itemsize) {
        case 2: copy_words(ptrs, offsets, n_arrays, (unsigned short*)flat, to_flat); break;
        case 4: copy_words(ptrs, offsets, n_arrays, (unsigned int*)flat, to_flat); break;
        case 8: copy_words(ptrs, offsets, n_arrays, (unsigned long long*)flat, to_flat); break;
    }
}

extern "C" __global__ void pack_arrays(const unsigned long long* ptrs, const long long* offsets,
                                       int n_arrays, void* flat, int itemsize) {
    copy_bucket<true>(ptrs, offsets, n_arrays, flat, itemsize);
}

extern "C" __global__ void unpack_arrays(const unsigned long long* ptrs, const long long* offsets,
                                         int n_arrays, void* flat, int itemsize) {
    copy_bucket<false>(ptrs, offsets, n_arrays, flat, itemsize);
}
