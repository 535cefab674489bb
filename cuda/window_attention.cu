// window_attention: decode attention of a few query tokens over a paged KV window, with
// grouped-query heads.
//
//   q      [nq, Hq, D]              the new tokens' queries (contiguous)
//   k, v   pages addressed as base + page * stride_page + head * stride_head + tok * stride_tok
//          (element strides), so both a GPU block pool [P, L, 2, H, C, D] (layer and k|v folded
//          into the base pointer) and a contiguous window buffer [H, T, D] are valid inputs
//   table  [num_pages] int32        page of each window position block
//   out    [nq, Hq, D]
// Query token i sees positions 0 .. seq_len - nq + i (causal within the new tokens).
//
// Reference: kvmemory/ops/window_attention.py (window_attention_ref); tests compare both with
// torch SDPA at a stated tolerance per dtype (tests/ops/test_window_attention.py).
//
// Grid (nq, Hq), 4 warps. Each warp walks keys w, w+4, ...: one dot product per key split
// over lanes (D/32 elements each), online softmax in float32, then the 4 partial results
// are merged through shared memory. D must be a multiple of 32, at most 256.
#include "common.cuh"

namespace kvm {

constexpr int kWarps = 4;
constexpr int kMaxPerLane = 8;  // D <= 256

template <typename T>
__global__ void window_attention_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                                        int64_t stride_page, int64_t stride_head, int64_t stride_tok,
                                        const int32_t* __restrict__ table, int page_size, int seq_len, int nq,
                                        int Hq, int Hkv, int D, float scale, T* __restrict__ out) {
  const int i = blockIdx.x, h = blockIdx.y;
  const int hk = h / (Hq / Hkv);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int per = D / 32;
  const int visible = seq_len - nq + i + 1;

  float qv[kMaxPerLane], acc[kMaxPerLane];
  for (int e = 0; e < per; ++e) {
    qv[e] = to_float<T>(q[((int64_t)i * Hq + h) * D + lane * per + e]) * scale;
    acc[e] = 0.f;
  }
  float m = -INFINITY, l = 0.f;
  for (int t = warp; t < visible; t += kWarps) {
    const int64_t base = (int64_t)table[t / page_size] * stride_page + (int64_t)hk * stride_head +
                         (int64_t)(t % page_size) * stride_tok + lane * per;
    float dot = 0.f;
    for (int e = 0; e < per; ++e) dot += qv[e] * to_float<T>(k[base + e]);
    for (int off = 16; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffff, dot, off);
    const float m_new = fmaxf(m, dot);
    const float corr = __expf(m - m_new);
    const float p = __expf(dot - m_new);
    l = l * corr + p;
    for (int e = 0; e < per; ++e) acc[e] = acc[e] * corr + p * to_float<T>(v[base + e]);
    m = m_new;
  }
  __shared__ float sm[kWarps], sl[kWarps];
  __shared__ float sacc[kWarps][kMaxPerLane * 32];
  if (lane == 0) { sm[warp] = m; sl[warp] = l; }
  for (int e = 0; e < per; ++e) sacc[warp][lane * per + e] = acc[e];
  __syncthreads();
  if (warp == 0) {
    float M = -INFINITY;
    for (int w = 0; w < kWarps; ++w) M = fmaxf(M, sm[w]);
    float L = 0.f;
    float o[kMaxPerLane];
    for (int e = 0; e < per; ++e) o[e] = 0.f;
    for (int w = 0; w < kWarps; ++w) {
      if (sm[w] == -INFINITY) continue;  // a warp that saw no key
      const float c = __expf(sm[w] - M);
      L += sl[w] * c;
      for (int e = 0; e < per; ++e) o[e] += sacc[w][lane * per + e] * c;
    }
    for (int e = 0; e < per; ++e) out[((int64_t)i * Hq + h) * D + lane * per + e] = from_float<T>(o[e] / L);
  }
}

template <typename T>
static cudaError_t launch(const void* q, const void* k, const void* v, int64_t sp, int64_t sh, int64_t st,
                          const int32_t* table, int page_size, int seq_len, int nq, int Hq, int Hkv, int D,
                          float scale, void* out, cudaStream_t stream) {
  if (D % 32 != 0 || D > 32 * kMaxPerLane || Hq % Hkv != 0 || nq < 1 || seq_len < nq) return cudaErrorInvalidValue;
  dim3 grid(nq, Hq);
  window_attention_kernel<T><<<grid, 32 * kWarps, 0, stream>>>(
      static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), sp, sh, st, table, page_size,
      seq_len, nq, Hq, Hkv, D, scale, static_cast<T*>(out));
  return cudaGetLastError();
}

}  // namespace kvm

extern "C" int kvm_window_attention(int dtype, const void* q, const void* k, const void* v, int64_t stride_page,
                                    int64_t stride_head, int64_t stride_tok, const int32_t* table, int page_size,
                                    int seq_len, int nq, int Hq, int Hkv, int D, float scale, void* out,
                                    void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case kvm::F32:
      return (int)kvm::launch<float>(q, k, v, stride_page, stride_head, stride_tok, table, page_size, seq_len, nq,
                                     Hq, Hkv, D, scale, out, s);
    case kvm::F16:
      return (int)kvm::launch<__half>(q, k, v, stride_page, stride_head, stride_tok, table, page_size, seq_len, nq,
                                      Hq, Hkv, D, scale, out, s);
    case kvm::BF16:
      return (int)kvm::launch<__nv_bfloat16>(q, k, v, stride_page, stride_head, stride_tok, table, page_size,
                                             seq_len, nq, Hq, Hkv, D, scale, out, s);
    default: return (int)cudaErrorInvalidValue;
  }
}
