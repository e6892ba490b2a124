// Tree attention over vLLM's paged CPU KV cache, in place (vLLM 0.32, CPU_ATTN "vec"/"vec16").
//
// One call per attention layer computes every tree row of the step: each node attends
// to its request's prefix (positions before the root, read straight out of the cache
// blocks) and to itself and its ancestors (this step's K/V rows). The torch path it
// replaces (cpu_backend.py) gathered the prefix into a dense tensor per layer and ran
// SDPA; on a 2-core CPU at batch 1 that was ~0.26 ms per layer, mostly copies and per-op
// overhead, against ~0.06 ms for vLLM's causal kernel.
//
// Cache layout (vllm/v1/attention/backends/cpu_attn.py, ISA vec/vec16): a tensor
// [num_blocks, num_kv_heads, block_size, 2 * head_size] where each (block, head) holds K
// transposed ([head_size][block_size]) followed by V row-major ([block_size][head_size]).
#include <torch/extension.h>

#include <ATen/Parallel.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;  // floats per AVX-512 vector
constexpr int64_t kTileQ = 8;   // queries per score tile (8 accumulators in registers)

// ---- loads of 16 cache/row elements as floats (masked tail) ----
#if defined(__AVX512F__)
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const c10::BFloat16* p, __mmask16 m) {
  const __m256i raw = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const c10::Half* p, __mmask16 m) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
}
inline __mmask16 lanes_mask(int64_t n) {  // the first min(max(n, 0), 16) lanes
  if (n <= 0) return 0;
  return n >= kLanes ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
}
// e^x for x <= 0 (scores minus their max), |relative error| < 2e-7 on [-80, 0], and exactly
// 0 below -80 (masked scores are -inf). Never a subnormal: e^-87 is one once normalised,
// and every product with a subnormal weight in the V pass costs a microcode assist
// (a 16-node tree's masked pairs made the op 10x slower).
inline __m512 exp16(__m512 x) {
  const __mmask16 kept = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-80.f), _CMP_GE_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-80.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_maskz_mov_ps(kept, _mm512_scalef_ps(y, n));  // y * 2^n
}
#endif

template <typename T>
inline float dot(const float* q, const T* k, int64_t size) {
  int64_t d = 0;
  float total = 0.f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; d + kLanes <= size; d += kLanes)
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), load16(k + d, 0xFFFF), acc);
  total = _mm512_reduce_add_ps(acc);
#endif
  for (; d < size; ++d) total += q[d] * static_cast<float>(k[d]);
  return total;
}

// scores[qi][0:count] = q[qi] . K^T[:, 0:count] for kTileQ queries (K^T rows of `stride`).
// 32 tokens per pass: 16 accumulators in registers, each query's broadcast used twice.
template <typename T>
inline void score_tile(const float* q, int64_t head_size, const T* k_t, int64_t stride,
                       int64_t count, float* scores, int64_t score_stride) {
#if defined(__AVX512F__)
  for (int64_t t0 = 0; t0 < count; t0 += 2 * kLanes) {
    const __mmask16 m0 = lanes_mask(count - t0), m1 = lanes_mask(count - t0 - kLanes);
    __m512 acc0[kTileQ], acc1[kTileQ];
    for (int64_t i = 0; i < kTileQ; ++i) acc0[i] = acc1[i] = _mm512_setzero_ps();
    for (int64_t d = 0; d < head_size; ++d) {
      const T* k_row = k_t + d * stride + t0;
      const __m512 k0 = load16(k_row, m0), k1 = load16(k_row + kLanes, m1);
      for (int64_t i = 0; i < kTileQ; ++i) {
        const __m512 qv = _mm512_set1_ps(q[i * head_size + d]);
        acc0[i] = _mm512_fmadd_ps(qv, k0, acc0[i]);
        acc1[i] = _mm512_fmadd_ps(qv, k1, acc1[i]);
      }
    }
    for (int64_t i = 0; i < kTileQ; ++i) {
      _mm512_mask_storeu_ps(scores + i * score_stride + t0, m0, acc0[i]);
      _mm512_mask_storeu_ps(scores + i * score_stride + t0 + kLanes, m1, acc1[i]);
    }
  }
#else
  for (int64_t i = 0; i < kTileQ; ++i) {
    float* s = scores + i * score_stride;
    for (int64_t t = 0; t < count; ++t) s[t] = 0.f;
    for (int64_t d = 0; d < head_size; ++d) {
      const float qd = q[i * head_size + d];
      const T* k_row = k_t + d * stride;
      for (int64_t t = 0; t < count; ++t) s[t] += qd * static_cast<float>(k_row[t]);
    }
  }
#endif
}

// acc[qi][0:head_size] += sum_t probs[qi][t] * row(t)[0:head_size] for kTileQ queries
// (probs rows of `prob_stride`). The accumulators of 32 dimensions stay in registers over
// all `count` rows of V: each V row is read once per tile, each accumulator stored once.
template <typename T, typename RowOf>
inline void value_tile(const float* probs, int64_t prob_stride, RowOf row, int64_t count,
                       int64_t head_size, float* acc) {
#if defined(__AVX512F__)
  for (int64_t d0 = 0; d0 < head_size; d0 += 2 * kLanes) {
    const __mmask16 m0 = lanes_mask(head_size - d0), m1 = lanes_mask(head_size - d0 - kLanes);
    __m512 acc0[kTileQ], acc1[kTileQ];
    for (int64_t i = 0; i < kTileQ; ++i) {
      acc0[i] = _mm512_maskz_loadu_ps(m0, acc + i * head_size + d0);
      acc1[i] = _mm512_maskz_loadu_ps(m1, acc + i * head_size + d0 + kLanes);
    }
    for (int64_t t = 0; t < count; ++t) {
      const T* v = row(t) + d0;
      const __m512 v0 = load16(v, m0), v1 = load16(v + kLanes, m1);
      for (int64_t i = 0; i < kTileQ; ++i) {
        const __m512 p = _mm512_set1_ps(probs[i * prob_stride + t]);
        acc0[i] = _mm512_fmadd_ps(p, v0, acc0[i]);
        acc1[i] = _mm512_fmadd_ps(p, v1, acc1[i]);
      }
    }
    for (int64_t i = 0; i < kTileQ; ++i) {
      _mm512_mask_storeu_ps(acc + i * head_size + d0, m0, acc0[i]);
      _mm512_mask_storeu_ps(acc + i * head_size + d0 + kLanes, m1, acc1[i]);
    }
  }
#else
  for (int64_t t = 0; t < count; ++t) {
    const T* v = row(t);
    for (int64_t i = 0; i < kTileQ; ++i) {
      const float p = probs[i * prob_stride + t];
      float* a = acc + i * head_size;
      for (int64_t d = 0; d < head_size; ++d) a[d] += p * static_cast<float>(v[d]);
    }
  }
#endif
}

// row[0:size] = softmax(row[0:size])
inline void softmax(float* row, int64_t size) {
#if defined(__AVX512F__)
  __m512 topv = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t t = 0; t < size; t += kLanes) {
    const __mmask16 m = lanes_mask(size - t);
    topv = _mm512_mask_max_ps(topv, m, topv, _mm512_maskz_loadu_ps(m, row + t));
  }
  topv = _mm512_set1_ps(_mm512_reduce_max_ps(topv));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < size; t += kLanes) {
    const __mmask16 m = lanes_mask(size - t);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, row + t), topv));
    _mm512_mask_storeu_ps(row + t, m, e);
    sum = _mm512_mask_add_ps(sum, m, sum, e);
  }
  const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum));
  for (int64_t t = 0; t < size; t += kLanes) {
    const __mmask16 m = lanes_mask(size - t);
    _mm512_mask_storeu_ps(row + t, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, row + t), inv));
  }
#else
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < size; ++t) top = std::max(top, row[t]);
  float total = 0.f;
  for (int64_t t = 0; t < size; ++t) {
    row[t] = std::exp(row[t] - top);
    total += row[t];
  }
  const float inv = 1.f / total;
  for (int64_t t = 0; t < size; ++t) row[t] *= inv;
#endif
}

template <typename scalar_t>
void tree_attention_kernel(const at::Tensor& query, const at::Tensor& key,
                           const at::Tensor& value, const at::Tensor& kv_cache,
                           const at::Tensor& rows, const at::Tensor& num_nodes,
                           const at::Tensor& blocks, const at::Tensor& prefix_len,
                           const at::Tensor& allowed, double scale, int64_t query_from,
                           at::Tensor& out) {
  const int64_t num_trees = rows.size(0), width = rows.size(1);
  const int64_t num_heads = query.size(1), head_size = query.size(2);
  const int64_t num_kv_heads = kv_cache.size(1), block_size = kv_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t q_stride = query.stride(0), k_stride = key.stride(0),
                v_stride = value.stride(0), out_stride = out.stride(0);
  const int64_t max_blocks = blocks.size(1);
  const scalar_t* q_ptr = query.data_ptr<scalar_t>();
  const scalar_t* k_ptr = key.data_ptr<scalar_t>();
  const scalar_t* v_ptr = value.data_ptr<scalar_t>();
  const scalar_t* cache = kv_cache.data_ptr<scalar_t>();
  const int64_t* row_ptr = rows.data_ptr<int64_t>();
  const int64_t* nodes_ptr = num_nodes.data_ptr<int64_t>();
  const int64_t* block_ptr = blocks.data_ptr<int64_t>();
  const int64_t* prefix_ptr = prefix_len.data_ptr<int64_t>();
  const bool* allowed_ptr = allowed.data_ptr<bool>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const int64_t cache_head = block_size * 2 * head_size;  // one (block, head) region
  const float neg_inf = -std::numeric_limits<float>::infinity();

  // A task: one (tree, kv head) and a share of the tree's nodes; the query heads of a kv
  // head share every K/V read. Trees are split into node shares when there are fewer
  // (tree, kv head) pairs than twice the threads (batch 1: 3 kv heads on 2 threads).
  const int64_t pairs = num_trees * num_kv_heads;
  const int64_t shares = std::max<int64_t>(
      1, std::min<int64_t>(width, (2 * at::get_num_threads() + pairs - 1) / pairs));
  at::parallel_for(0, pairs * shares, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q, scores, acc;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t pair = task / shares, share = task % shares;
      const int64_t r = pair / num_kv_heads, kvh = pair % num_kv_heads;
      const int64_t n = nodes_ptr[r], prefix = prefix_ptr[r];
      // nodes before query_from are keys only (a draft's earlier tree passes)
      const int64_t q0 = std::min(std::max<int64_t>(query_from, 0), n), nq_nodes = n - q0;
      const int64_t first = q0 + share * nq_nodes / shares,
                    last = q0 + (share + 1) * nq_nodes / shares;
      if (first == last) continue;
      const int64_t span = prefix + n, nq = (last - first) * group;
      const int64_t nq_tiles = (nq + kTileQ - 1) / kTileQ;
      TORCH_CHECK((prefix + block_size - 1) / block_size <= max_blocks,
                  "tree attention: prefix longer than the block table");
      // queries qi = (node - first) * group + g, pre-scaled, as float; zero rows pad the
      // last tile
      q.assign(nq_tiles * kTileQ * head_size, 0.f);
      for (int64_t i = first; i < last; ++i) {
        const scalar_t* src = q_ptr + row_ptr[r * width + i] * q_stride;
        for (int64_t g = 0; g < group; ++g) {
          const scalar_t* head = src + (kvh * group + g) * head_size;
          float* dst = q.data() + ((i - first) * group + g) * head_size;
          for (int64_t d = 0; d < head_size; ++d) dst[d] = static_cast<float>(head[d]) * scale;
        }
      }
      scores.assign(nq_tiles * kTileQ * span, 0.f);
      // prefix: K^T blocks straight from the cache, contiguous along the block's tokens
      for (int64_t b = 0; b * block_size < prefix; ++b) {
        const scalar_t* k_t = cache + (block_ptr[r * max_blocks + b] * num_kv_heads + kvh) *
                                          cache_head;
        const int64_t count = std::min(block_size, prefix - b * block_size);
        for (int64_t tile = 0; tile < nq_tiles; ++tile) {
          score_tile(q.data() + tile * kTileQ * head_size, head_size, k_t, block_size, count,
                     scores.data() + tile * kTileQ * span + b * block_size, span);
        }
      }
      // the tree: node i sees node j where allowed[r, i, j] (itself and its ancestors)
      for (int64_t i = first; i < last; ++i) {
        for (int64_t j = 0; j < n; ++j) {
          const bool ok = allowed_ptr[(r * width + i) * width + j];
          const scalar_t* k_row = k_ptr + row_ptr[r * width + j] * k_stride + kvh * head_size;
          for (int64_t g = 0; g < group; ++g) {
            const int64_t qi = (i - first) * group + g;
            scores[qi * span + prefix + j] =
                ok ? dot(q.data() + qi * head_size, k_row, head_size) : neg_inf;
          }
        }
      }
      for (int64_t qi = 0; qi < nq; ++qi) softmax(scores.data() + qi * span, span);
      // the weighted sum of V, a tile of queries at a time: prefix V rows (contiguous in
      // the cache block), then the nodes' (zero weights where a node is not an ancestor)
      acc.assign(nq_tiles * kTileQ * head_size, 0.f);
      for (int64_t tile = 0; tile < nq_tiles; ++tile) {
        const float* probs = scores.data() + tile * kTileQ * span;
        float* acc_tile = acc.data() + tile * kTileQ * head_size;
        for (int64_t b = 0; b * block_size < prefix; ++b) {
          const scalar_t* v_blk = cache +
                                  (block_ptr[r * max_blocks + b] * num_kv_heads + kvh) * cache_head +
                                  block_size * head_size;
          const int64_t count = std::min(block_size, prefix - b * block_size);
          value_tile<scalar_t>(probs + b * block_size, span,
                               [&](int64_t t) { return v_blk + t * head_size; }, count, head_size,
                               acc_tile);
        }
        const int64_t* node_rows = row_ptr + r * width;
        value_tile<scalar_t>(
            probs + prefix, span,
            [&](int64_t j) { return v_ptr + node_rows[j] * v_stride + kvh * head_size; }, n,
            head_size, acc_tile);
      }
      for (int64_t i = first; i < last; ++i) {
        scalar_t* dst = out_ptr + row_ptr[r * width + i] * out_stride;
        for (int64_t g = 0; g < group; ++g) {
          const float* a = acc.data() + ((i - first) * group + g) * head_size;
          scalar_t* o = dst + (kvh * group + g) * head_size;
          for (int64_t d = 0; d < head_size; ++d) o[d] = static_cast<scalar_t>(a[d]);
        }
      }
    }
  });
}

void check_rows(const at::Tensor& t, const char* name, int64_t heads, int64_t head_size) {
  TORCH_CHECK(t.dim() == 3 && t.size(1) == heads && t.size(2) == head_size, name,
              ": expected [tokens, ", heads, ", ", head_size, "]");
  TORCH_CHECK(t.stride(2) == 1 && t.stride(1) == head_size, name,
              ": each row's heads must be contiguous");
}

}  // namespace

// query [T, Hq, D], key/value [T, Hkv, D] (this step's rows), kv_cache [blocks, Hkv, bs, 2D],
// rows [R, N] int64 (flat token row of each node; padding repeats the root), num_nodes
// [R] int64, blocks [R, B] int64, prefix_len [R] int64 (the root's position), allowed
// [R, N, N] bool, query_from: nodes i < query_from are keys only; writes out [T, Hq * D]
// at the rows of the real nodes from query_from on.
void tree_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                    const at::Tensor& kv_cache, const at::Tensor& rows,
                    const at::Tensor& num_nodes, const at::Tensor& blocks,
                    const at::Tensor& prefix_len, const at::Tensor& allowed, double scale,
                    int64_t query_from, at::Tensor out) {
  const int64_t heads = query.size(1), head_size = query.size(2);
  const int64_t kv_heads = kv_cache.size(1);
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.size(3) == 2 * head_size,
              "kv_cache: expected a contiguous [blocks, kv_heads, block_size, 2 * head_size]");
  TORCH_CHECK(heads % kv_heads == 0, "query heads must be a multiple of kv heads");
  check_rows(query, "query", heads, head_size);
  check_rows(key, "key", kv_heads, head_size);
  check_rows(value, "value", kv_heads, head_size);
  TORCH_CHECK(out.dim() == 2 && out.size(1) == heads * head_size && out.stride(1) == 1,
              "out: expected [tokens, heads * head_size]");
  for (const at::Tensor* t : {&key, &value, &kv_cache, static_cast<const at::Tensor*>(&out)}) {
    TORCH_CHECK(t->scalar_type() == query.scalar_type(),
                "dtypes of query, key, value, kv_cache and out must match");
  }
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.is_contiguous() &&
                  num_nodes.scalar_type() == at::kLong && num_nodes.is_contiguous() &&
                  blocks.scalar_type() == at::kLong && blocks.is_contiguous() &&
                  prefix_len.scalar_type() == at::kLong && prefix_len.is_contiguous(),
              "rows, num_nodes, blocks and prefix_len: contiguous int64");
  TORCH_CHECK(allowed.scalar_type() == at::kBool && allowed.is_contiguous() &&
                  allowed.size(0) == rows.size(0) && allowed.size(1) == rows.size(1) &&
                  allowed.size(2) == rows.size(1),
              "allowed: contiguous bool [R, N, N]");
  const auto run = [&](auto tag) {
    using scalar_t = decltype(tag);
    tree_attention_kernel<scalar_t>(query, key, value, kv_cache, rows, num_nodes, blocks,
                                    prefix_len, allowed, scale, query_from, out);
  };
  switch (query.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(c10::BFloat16{}); break;
    case at::kHalf: run(c10::Half{}); break;
    default: TORCH_CHECK(false, "tree attention: float32, bfloat16 or float16 only");
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("tree_attention", &tree_attention, "Tree attention over vLLM's paged CPU KV cache");
}
