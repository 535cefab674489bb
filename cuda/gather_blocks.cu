// gather_blocks: copy selected KV blocks into the window buffer at their slots, re-rotating
// keys by (slot position - deposit position) with RoPE in the same pass.
//
//   pool  [P, L, 2, H, C, D]   source blocks (GPU block pool, or mapped pinned host memory)
//   out   [L, 2, H, T, D]      window buffer
//   idx, n, dst, shift [k]     per gathered block: pool entry, valid tokens, token offset in out,
//                              rotation in positions (0: byte copy)
//   freqs [D/2] float32        RoPE inverse frequencies, rotate-half layout
//
// Reference: kvmemory/ops/gather_blocks.py (gather_blocks_ref); equivalence tests in
// tests/ops/test_gather_blocks.py. Values and zero-shift keys are moved as raw words (equal
// bytes); shifted keys are rotated in double precision and rounded once, like the reference.
//
// Grid: (k, L * 2 * H); each CUDA block moves one (block, layer, k|v, head) run of n * D words.
#include "common.cuh"

namespace kvm {

template <typename T>
__global__ void gather_blocks_kernel(const T* __restrict__ pool, const int64_t* __restrict__ idx,
                                     const int64_t* __restrict__ n, const int64_t* __restrict__ dst,
                                     const int64_t* __restrict__ shift, T* __restrict__ out,
                                     const float* __restrict__ freqs, int L, int H, int C, int D, int64_t T_out) {
  extern __shared__ double cs[];  // [D/2] cos, then [D/2] sin
  const int i = blockIdx.x;
  const int run = blockIdx.y;  // (l * 2 + kv) * H + h
  const int kv = (run / H) % 2;
  const int64_t b = idx[i];
  const int64_t m = n[i];
  const int64_t s = shift[i];
  const T* src = pool + ((b * (int64_t)L * 2 * H) + run) * (int64_t)C * D;
  T* o = out + ((int64_t)run * T_out + dst[i]) * D;
  const int64_t words = m * D;

  if (kv == 1 || s == 0) {
    // byte mover: copy 16-byte vectors when both ends are aligned, words otherwise
    const bool aligned = ((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(o)) % 16 == 0) &&
                         ((words * (int64_t)sizeof(T)) % 16 == 0);
    if (aligned) {
      const int4* s4 = reinterpret_cast<const int4*>(src);
      int4* o4 = reinterpret_cast<int4*>(o);
      const int64_t n4 = words * (int64_t)sizeof(T) / 16;
      for (int64_t j = threadIdx.x; j < n4; j += blockDim.x) o4[j] = s4[j];
    } else {
      for (int64_t j = threadIdx.x; j < words; j += blockDim.x) o[j] = src[j];
    }
    return;
  }
  const int half = D / 2;
  for (int j = threadIdx.x; j < half; j += blockDim.x) {
    double a = (double)s * (double)freqs[j];
    double sn, c;
    sincos(a, &sn, &c);
    cs[j] = c;
    cs[half + j] = sn;
  }
  __syncthreads();
  const int64_t pairs = m * half;
  for (int64_t p = threadIdx.x; p < pairs; p += blockDim.x) {
    const int64_t t = p / half;
    const int j = (int)(p % half);
    const double k1 = to_double<T>(src[t * D + j]);
    const double k2 = to_double<T>(src[t * D + j + half]);
    const double c = cs[j], sn = cs[half + j];
    o[t * D + j] = from_float<T>((float)(k1 * c - k2 * sn));
    o[t * D + j + half] = from_float<T>((float)(k2 * c + k1 * sn));
  }
}

template <typename T>
static cudaError_t launch(const void* pool, const int64_t* idx, const int64_t* n, const int64_t* dst,
                          const int64_t* shift, void* out, const float* freqs, int k, int L, int H, int C, int D,
                          int64_t T_out, cudaStream_t stream) {
  if (k == 0) return cudaSuccess;
  dim3 grid(k, L * 2 * H);
  gather_blocks_kernel<T><<<grid, 128, D * sizeof(double), stream>>>(
      static_cast<const T*>(pool), idx, n, dst, shift, static_cast<T*>(out), freqs, L, H, C, D, T_out);
  return cudaGetLastError();
}

}  // namespace kvm

extern "C" int kvm_gather_blocks(int dtype, const void* pool, const int64_t* idx, const int64_t* n,
                                 const int64_t* dst, const int64_t* shift, void* out, const float* freqs, int k,
                                 int L, int H, int C, int D, int64_t T_out, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case kvm::F32: return (int)kvm::launch<float>(pool, idx, n, dst, shift, out, freqs, k, L, H, C, D, T_out, s);
    case kvm::F16: return (int)kvm::launch<__half>(pool, idx, n, dst, shift, out, freqs, k, L, H, C, D, T_out, s);
    case kvm::BF16:
      return (int)kvm::launch<__nv_bfloat16>(pool, idx, n, dst, shift, out, freqs, k, L, H, C, D, T_out, s);
    default: return (int)cudaErrorInvalidValue;
  }
}
