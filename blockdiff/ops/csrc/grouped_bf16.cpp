// Grouped products of bfloat16 experts on CPUs with AVX512-BF16: rows ends[e-1]:ends[e] of x times
// weight[e].T, each expert's weight read from memory once, in the checkpoint's [out, in] layout.
// Why (blockdiff/ops/cpu_grouped.py): at 8-32 rows per expert torch's grouped and oneDNN's kernels
// read a weight at 9-23 GB/s on a CPU that reads 30-120; a step of a large model at batch 1 is
// bound by those bytes.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstring>

namespace {

#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16")))

constexpr int64_t ROWS = 4;      // x rows per block
constexpr int64_t OUTS = 4;      // weight rows (outputs) per block
constexpr int64_t CHUNK = 64;    // outputs per parallel work item
constexpr int64_t AHEAD = 8;     // weight rows prefetched ahead of the block being multiplied

// The 16 sums of the lanes of v[0..15], as one vector (lane i: the sum of v[i]): a tree of 15
// shuffle-and-add steps instead of 16 separate reductions. Each sum is added in the same order
// whatever the other vectors hold.
BF16_TARGET inline __m512 sum_lanes16(const __m512 (&v)[16]) {
  __m512 pairs[8], quads[4], halves[2];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: partials of v[2i], v[2i+1], v[2i], v[2i+1]
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: partials of v[4i..4i+3]
    const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i)  // 128-bit lanes: v[8i..8i+3] twice, v[8i+4..8i+7] twice
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// y[m][n] = sum_k x[m][k] w[n][k] for an MB x NB block (at most 4 x 4): 32 k at a time into float32
// lanes, then the lanes summed and rounded to bfloat16 once. Every output takes the same steps
// whatever the block's shape, so a row's result does not depend on how many rows share the call
// (batch invariance).
template <int MB, int NB>
BF16_TARGET void block(const at::BFloat16* x, int64_t ldx, const at::BFloat16* w, int64_t ldw, int64_t k,
                       at::BFloat16* y, int64_t ldy, const at::BFloat16* prefetch) {
  __m512 acc[ROWS][OUTS];
#pragma GCC unroll 4
  for (int m = 0; m < ROWS; ++m)
#pragma GCC unroll 4
    for (int n = 0; n < OUTS; ++n) acc[m][n] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < k; kk += 32) {
    const __mmask32 mask = k - kk >= 32 ? ~__mmask32(0) : ((__mmask32(1) << (k - kk)) - 1);
    // The weight streams from memory in short runs of rows the hardware prefetcher is slow to
    // follow: ask for the rows AHEAD on, one cache line per row per step (prefetches never fault).
    if (prefetch) {
#pragma GCC unroll 4
      for (int n = 0; n < OUTS; ++n) _mm_prefetch(reinterpret_cast<const char*>(prefetch + n * ldw + kk), _MM_HINT_T0);
    }
    __m512bh wv[NB];
#pragma GCC unroll 4
    for (int n = 0; n < NB; ++n) wv[n] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + n * ldw + kk);
#pragma GCC unroll 4
    for (int m = 0; m < MB; ++m) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * ldx + kk);
#pragma GCC unroll 4
      for (int n = 0; n < NB; ++n) acc[m][n] = _mm512_dpbf16_ps(acc[m][n], xv, wv[n]);
    }
  }
  __m512 flat[ROWS * OUTS];
#pragma GCC unroll 16
  for (int i = 0; i < ROWS * OUTS; ++i) flat[i] = acc[i / OUTS][i % OUTS];
  alignas(32) uint16_t sums[ROWS * OUTS];  // round to nearest even, as torch rounds float32 to bfloat16
  _mm256_store_si256(reinterpret_cast<__m256i*>(sums), (__m256i)_mm512_cvtneps_pbh(sum_lanes16(flat)));
#pragma GCC unroll 4
  for (int m = 0; m < MB; ++m) std::memcpy(y + m * ldy, sums + m * OUTS, NB * sizeof(uint16_t));
}

template <int MB>
BF16_TARGET void rows_block(const at::BFloat16* x, int64_t ldx, const at::BFloat16* w, int64_t ldw, int64_t k,
                            at::BFloat16* y, int64_t ldy, int64_t nb, const at::BFloat16* prefetch) {
  switch (nb) {
    case 4: block<MB, 4>(x, ldx, w, ldw, k, y, ldy, prefetch); break;
    case 3: block<MB, 3>(x, ldx, w, ldw, k, y, ldy, prefetch); break;
    case 2: block<MB, 2>(x, ldx, w, ldw, k, y, ldy, prefetch); break;
    default: block<MB, 1>(x, ldx, w, ldw, k, y, ldy, prefetch); break;
  }
}

BF16_TARGET void expert_chunk(const at::BFloat16* x, int64_t ldx, const at::BFloat16* w, int64_t ldw, int64_t k,
                              at::BFloat16* y, int64_t ldy, int64_t r0, int64_t r1, int64_t n0, int64_t n1) {
  for (int64_t j = n0; j < n1; j += OUTS) {
    const int64_t nb = std::min(OUTS, n1 - j);
    const at::BFloat16* wj = w + j * ldw;
    const at::BFloat16* prefetch = wj + AHEAD * ldw;  // only the first row block brings rows in
    int64_t r = r0;
    for (; r + ROWS <= r1; r += ROWS, prefetch = nullptr)
      rows_block<ROWS>(x + r * ldx, ldx, wj, ldw, k, y + r * ldy + j, ldy, nb, prefetch);
    for (; r < r1; ++r, prefetch = nullptr) rows_block<1>(x + r * ldx, ldx, wj, ldw, k, y + r * ldy + j, ldy, nb, prefetch);
  }
}

}  // namespace

// x [rows, in] bf16, weight [E, out, in] bf16 (in contiguous), ends [E] int32 cumulative row ends,
// counts [E] int32 or None: how many rows each group begins with that are multiplied, the rest of
// the group set to 0. -> [rows, out] bf16; rows past ends[E-1] are left undefined, as
// torch._grouped_mm leaves them.
torch::Tensor grouped_mm_bf16(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& ends,
                              const std::optional<torch::Tensor>& counts) {
  TORCH_CHECK(__builtin_cpu_supports("avx512bf16"), "grouped_mm_bf16 needs a CPU with AVX512-BF16");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu() && ends.device().is_cpu(), "grouped_mm_bf16 runs on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16, "grouped_mm_bf16 multiplies bfloat16");
  TORCH_CHECK(ends.scalar_type() == at::kInt && ends.dim() == 1 && ends.is_contiguous(), "ends: int32, one dimension");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 3 && x.stride(1) == 1 && weight.stride(2) == 1,
              "x [rows, in] and weight [E, out, in] with `in` contiguous");
  TORCH_CHECK(weight.size(2) == x.size(1) && ends.size(0) == weight.size(0), "shapes do not match");
  const int64_t rows = x.size(0), k = x.size(1), experts = weight.size(0), n = weight.size(1);
  auto y = torch::empty({rows, n}, x.options());
  const auto* xp = x.data_ptr<at::BFloat16>();
  const auto* wp = weight.data_ptr<at::BFloat16>();
  auto* yp = y.data_ptr<at::BFloat16>();
  const auto* ep = ends.data_ptr<int32_t>();
  for (int64_t e = 0; e < experts; ++e)  // each group's rows lie inside x, in order
    TORCH_CHECK((e ? ep[e - 1] : 0) <= ep[e] && ep[e] <= rows, "ends must be non-decreasing and not past the rows of x");
  TORCH_CHECK(!counts || (counts->scalar_type() == at::kInt && counts->dim() == 1 && counts->is_contiguous() &&
                          counts->size(0) == experts), "counts: int32, one per expert");
  const int32_t* cp = counts ? counts->data_ptr<int32_t>() : nullptr;
  const int64_t chunks = (n + CHUNK - 1) / CHUNK;
  at::parallel_for(0, experts * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t e = u / chunks, c = u % chunks;
      const int64_t r0 = e ? ep[e - 1] : 0, end = ep[e];
      const int64_t r1 = cp ? std::min<int64_t>(end, r0 + std::max(cp[e], 0)) : end;
      const int64_t n0 = c * CHUNK, n1 = std::min(n, n0 + CHUNK);
      if (r1 > r0) expert_chunk(xp, x.stride(0), wp + e * weight.stride(0), weight.stride(1), k, yp, n, r0, r1, n0, n1);
      for (int64_t r = r1; r < end; ++r) std::fill(yp + r * n + n0, yp + r * n + n1, at::BFloat16(0.0f));
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("grouped_mm_bf16", &grouped_mm_bf16, "grouped bfloat16 products (AVX512-BF16)");
}
