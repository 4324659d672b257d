// Causal MLA prefill attention on tensor cores (sm_90a); the contract and the torch reference are in
// kdray/kernels/prefill_attention.py.
//
// mla_prefill_mma: one CTA owns 128 query rows of one head of one prompt, 64 for each of its two warpgroups, and
// streams the prompt's key tiles of 64 up to its last row's diagonal through a 4-stage cp.async ring, two tiles ahead,
// that both warpgroups read, so each tile crosses into shared memory once for 128 rows. A key row is read where the
// layer made it: its 128 nope columns from kv_b's output (per head), its 64 rope columns from the latent cache row
// (shared by the heads), its 128 values beside the nope columns; so no [keys, heads, 192] key tensor is built. The
// queries live in registers for the whole loop (S = Q K^T with Q as wgmma's register operand). Each step issues tile
// j's S = Q K^T and tile j - 1's O += P V together, so the softmax of tile j runs on the CUDA cores while the tensor
// cores still work on P V. No barrier holds the warpgroups in step: a stage's copies signal its "full" mbarrier as
// they land (cp.async.mbarrier.arrive), each warp signals its "empty" one once its products have read the stage, and
// a stage is refilled two tiles after that, so a warpgroup waits for the other only when it is two tiles behind.
// (With a CTA-wide barrier every tile, the H200 spent a third of its issue stalls there, at 44% of the tensor pipe.)
// The grid takes the tiles heaviest first (the last rows of the longest prompt see the most keys), so the causal
// triangle's short tiles fill the last wave. Where a batch has too few tiles to fill the GPU, each with many keys (a
// chunk of 1024 tokens after 16,384 cached: 64 CTAs for 132 SMs, each over ~270 key tiles), the host cuts each tile's
// keys into runs of `per` key tiles, one CTA a run (flash-decoding's split), and mla_prefill_combine merges the runs'
// partials.
#include <cuda_bf16.h>

#include "griddep.cuh"
#include "attention_tile.cuh"

constexpr int MP_NOPE = 128, MP_ROPE = 64, MP_DK = MP_NOPE + MP_ROPE, MP_DV = 128;
constexpr int MP_ROWS = 2 * BM, MP_THREADS = 256;                        // a CTA's query rows: two warpgroups' 64
constexpr int MP_K_BYTES = BN * MP_DK * 2, MP_V_BYTES = BN * MP_DV * 2;  // a key stage, a value stage
constexpr int MP_STAGES = 4, MP_STAGE = MP_K_BYTES + MP_V_BYTES;        // stages of a key tile and its values
constexpr int MP_Q_OFF = MP_STAGES * MP_STAGE;                            // Q's copy [2][64 rows][192] after the ring
constexpr int MP_BAR_OFF = MP_Q_OFF + MP_ROWS * MP_DK * 2;               // full[4], empty[4] mbarriers
constexpr int MP_SMEM = MP_BAR_OFF + 2 * MP_STAGES * 8;                  // ~208 KB: one CTA an SM
static_assert(MP_ROWS * MP_DV * 2 <= MP_SMEM, "the staged output tile fits");

// Key tiles of query tile `tile` of a prompt of q_len queries after k_len - q_len cached keys: up to its last row's
// diagonal.
__device__ __forceinline__ int mp_key_tiles(int q_len, int k_len, int tile) {
  const int rows = min(MP_ROWS, q_len - tile * MP_ROWS);
  return (min(k_len, tile * MP_ROWS + rows + k_len - q_len) + BN - 1) / BN;
}
// Runs of a tile of nb key tiles: `per` each, at most n_splits (the last takes the rest).
__device__ __forceinline__ int mp_runs(int nb, int n_splits, int per) { return min(n_splits, (nb + per - 1) / per); }

// q [T, H, 192] (rows q_row apart), k_nope [Tk, H, 128] (k_row, k_head), k_pe [Tk, 64] (pe_row), v [Tk, H, 128]
// (v_row, v_head), element strides, each a multiple of 8 and every pointer 16-byte aligned; cu_q / cu_k [B + 1]: the
// prompts' query and key rows (query i of prompt b sees its keys 0 .. i + k_len - q_len); out [T, H, 128].
// Key splits: with n_splits > 1, query tile `tile` of a prompt has nb key tiles (mp_key_tiles) in runs of `per`, the
// last run taking the rest past n_splits * per; run s of a tile split in more than one (mp_runs) writes its rows,
// each normalised by its own sum, to ws_o [n_splits, T * H, 128] and their (max in log2 units, sum) to ws_ml
// [n_splits, T * H] for mla_prefill_combine; a tile of one run writes out.
// Launch: grid (H, tiles * n_splits), tiles >= sum over prompts of ceil(q_len / 128), block MP_THREADS, shared
// MP_SMEM bytes.
extern "C" __global__ void __launch_bounds__(MP_THREADS, 1) mla_prefill_mma(
    const bf16* __restrict__ q, const bf16* __restrict__ k_nope, const bf16* __restrict__ k_pe,
    const bf16* __restrict__ v, const int* __restrict__ cu_q, const int* __restrict__ cu_k, bf16* __restrict__ out,
    bf16* __restrict__ ws_o, float2* __restrict__ ws_ml, int B, int T, int H, int q_row, int k_row, int k_head,
    int pe_row, int v_row, int v_head, float scale_log2, int n_splits, int per) {
#ifdef ATTN_WGMMA
  griddep_begin();
  extern __shared__ __align__(1024) unsigned char smem[];
  const int h = blockIdx.x, tid = threadIdx.x, lane = tid & 31, wg = tid >> 7, wq = (tid >> 5) & 3;
  const int index = gridDim.y - 1 - blockIdx.y, split = index % n_splits;  // heaviest tiles first
  int b, tile;
  if (!find_tile<MP_ROWS>(cu_q, B, 1, index / n_splits, b, tile)) return;
  const int q0 = cu_q[b], q_len = cu_q[b + 1] - q0, kb0 = cu_k[b], k_len = cu_k[b + 1] - kb0;
  const int off = k_len - q_len, rows = min(MP_ROWS, q_len - tile * MP_ROWS);
  const int nb_all = mp_key_tiles(q_len, k_len, tile), runs = mp_runs(nb_all, n_splits, per);
  if (split >= runs) return;
  const int k_first = split * per;  // this CTA's key tiles: k_first .. k_first + nb - 1
  const int nb = split == runs - 1 ? nb_all - k_first : per;

  // Stage i: keys at sK0 + i * MP_STAGE, their values MP_K_BYTES after; then Q (a 64-row tile a warpgroup), the
  // mbarriers: full[i] (256 arrivals: every thread's copies of the stage landed), empty[i] (8: every warp has read it).
  const u32 sK0 = smem_u32(smem), sQ = sK0 + MP_Q_OFF + wg * BM * MP_DK * 2, full = sK0 + MP_BAR_OFF,
            empty = full + 8 * MP_STAGES;
  if (tid == 0) {
    for (int i = 0; i < MP_STAGES; ++i) {
      mbar_init(full + 8 * i, MP_THREADS);
      mbar_init(empty + 8 * i, MP_THREADS / 32);
    }
    mbar_init_fence();
  }
  // Four threads a key row (chunk c = fs + 4 i): its 16 nope + 8 rope chunks, its value row's 16; two a query row.
  const int fr = tid >> 2, fs = tid & 3;
  auto load_kv = [&](int kb) {  // the run's tile kb into stage kb % MP_STAGES, once tile kb - MP_STAGES has left it
    const int st = kb % MP_STAGES;
    if (kb >= MP_STAGES) mbar_wait(empty + 8 * st, ((kb / MP_STAGES) - 1) & 1);
    const int p = (k_first + kb) * BN + fr;
    const bool ok = p < k_len;
    const long long key = kb0 + (ok ? p : 0);
    const u32 dk = sK0 + st * MP_STAGE, dv = dk + MP_K_BYTES;
    const bf16* kn = k_nope + key * k_row + (long long)h * k_head;
    const bf16* pe = k_pe + key * pe_row;
    const bf16* vr = v + key * v_row + (long long)h * v_head;
#pragma unroll
    for (int c = fs; c < MP_NOPE / 8; c += 4) cp_async16(dk + swz(fr, c), kn + c * 8, ok);
#pragma unroll
    for (int c = fs; c < MP_ROPE / 8; c += 4) cp_async16(dk + swz(fr, MP_NOPE / 8 + c), pe + c * 8, ok);
#pragma unroll
    for (int c = fs; c < MP_DV / 8; c += 4) cp_async16(dv + swz(fr, c), vr + c * 8, ok);
    cp_async_mbar_arrive(full + 8 * st);
  };
  __syncthreads();  // the mbarriers are set up
  {
    const int qr = tid >> 1, qs = tid & 1;  // query row qr of the CTA's 128: row qr % 64 of warpgroup qr / 64's tile
    const bool ok = qr < rows;  // rows past the prompt's stay zero; their results are never stored
    const bf16* src = q + (long long)(q0 + tile * MP_ROWS + (ok ? qr : 0)) * q_row + (long long)h * MP_DK;
    const u32 dst = sK0 + MP_Q_OFF + (qr >> 6) * BM * MP_DK * 2;
#pragma unroll
    for (int c = qs; c < MP_DK / 8; c += 2) cp_async16(dst + swz(qr & 63, c), src + c * 8, ok);
  }
  cp_async_commit();
  load_kv(0);
  if (nb > 1) load_kv(1);
  cp_async_wait<0>();
  __syncthreads();  // Q landed (tiles 0 and 1 may still be landing: their full barriers say when)

  const int g = lane >> 2, t4 = lane & 3, r0 = 16 * wq + g;  // this thread's rows r0, r0 + 8 of the warpgroup's
  u32 qf[MP_DK / 16][4];  // Q's A fragments, k16 step ks
#pragma unroll
  for (int ks = 0; ks < MP_DK / 16; ++ks) ldsm_x4(qf[ks], sQ + swz(16 * wq + (lane & 15), 2 * ks + (lane >> 4)));
  float o[MP_DV / 2], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
#pragma unroll
  for (int i = 0; i < MP_DV / 2; ++i) o[i] = 0.f;
  // Both warpgroups run all nb tiles (the first one's last tile is past its rows' diagonal: masked whole, it adds
  // nothing; so may be a run's every tile), so that every warp arrives on every stage's empty barrier and no branch
  // surrounds the products. Key positions below are relative to the run's first.
  const int diag = tile * MP_ROWS + BM * wg + off - k_first * BN;  // this warpgroup's first row's last visible key

  // S = Q K^T of tile kb once its stage is full, issued as one wgmma group (its fence also covers a P V issued right
  // after it).
  auto issue_qk = [&](float (&s)[32], int kb) {
    mbar_wait(full + 8 * (kb % MP_STAGES), (kb / MP_STAGES) & 1);
    fence_proxy_async();  // cp.async wrote through the generic proxy; wgmma reads through the async one
#pragma unroll
    for (int i = 0; i < 32; ++i) s[i] = 0.f;
    const u64 dk = wg_desc(sK0 + (kb % MP_STAGES) * MP_STAGE, 16, 1024);
    wg_fence();
#pragma unroll
    for (int ks = 0; ks < MP_DK / 16; ++ks)  // 64-column chunk, then 16 columns inside it
      wgmma_rs<0>(s, qf[ks], wg_desc_add(dk, (ks >> 2) * 8192 + (ks & 3) * 32));
    wg_commit();
  };
  // Tile kb's scores (S retired) -> P (pn), with the diagonal's mask.
  auto softmax = [&](float (&s)[32], int kb, u32 (&pn)[4][4], float (&alpha)[2]) {
    wg_pin(s);
    if ((kb + 1) * BN - 1 > diag) {  // the tile crosses the diagonal: key j is visible to row i if j <= i + off
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (kb * BN + 8 * j + 2 * t4 + (e & 1) > diag + r0 + 8 * (e >> 1)) s[4 * j + e] = -INFINITY;
    }
    softmax_tile(s, m, l, alpha, pn, scale_log2);
  };
  // Tile kb >= 1: its S with tile kb - 1's P V (from pv) in flight, then its P into pn; then tile kb - 1's stage is
  // read (empty) and tile kb + 2's copies go out. pv and pn alternate between two register sets (a copy would let
  // ptxas give both one set, which the P V in flight still reads: it would then serialize the products).
  auto step = [&](int kb, const u32 (&pv)[4][4], u32 (&pn)[4][4]) {
    float s[32], alpha[2];
    issue_qk(s, kb);
    pv_issue<MP_DV>(o, pv, sK0 + ((kb - 1) % MP_STAGES) * MP_STAGE + MP_K_BYTES, 0);
    wg_wait<1>();  // S of tile kb; P V of tile kb - 1 may still run
    softmax(s, kb, pn, alpha);
    wg_wait<0>();
    wg_pin(o);
    __syncwarp();
    if (lane == 0) mbar_arrive(empty + 8 * ((kb - 1) % MP_STAGES));
    if (kb + 2 < nb) load_kv(kb + 2);
    if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
      for (int i = 0; i < MP_DV / 2; ++i) o[i] *= alpha[(i >> 1) & 1];
    }
  };
  u32 p[2][4][4];  // P of the last two tiles: tile kb in p[kb & 1]
  {
    float s[32], alpha[2];
    issue_qk(s, 0);
    wg_wait<0>();
    softmax(s, 0, p[0], alpha);  // (O is still 0: nothing to rescale)
    if (nb > 2) load_kv(2);
  }
  int kb = 1;
  for (; kb + 1 < nb; kb += 2) {
    step(kb, p[0], p[1]);
    step(kb + 1, p[1], p[0]);
  }
  if (kb < nb) step(kb, p[0], p[1]);
  {  // tile nb - 1's values: no copy reaches its stage any more
    const bool odd = (nb - 1) & 1;  // its P is in p[1]: selected into p[0] (no branch, no indexed registers)
#pragma unroll
    for (int i = 0; i < 16; ++i) p[0][i >> 2][i & 3] = odd ? p[1][i >> 2][i & 3] : p[0][i >> 2][i & 3];
    wg_fence();
    pv_issue<MP_DV>(o, p[0], sK0 + ((nb - 1) % MP_STAGES) * MP_STAGE + MP_K_BYTES, 0);
    wg_wait<0>();
    wg_pin(o);
  }

  quad_sum(l);
  __syncthreads();  // every warp is past its last product: the output tile [128 rows][256 B] takes the ring's place
  stage_rows<MP_DV>(smem + wg * BM * MP_DV * 2, o, l, r0, t4, 0, MP_DV * 2);  // a run may hold no key a row sees
  const long long rows_total = (long long)T * H, row0 = (long long)(q0 + tile * MP_ROWS) * H + h;  // row r: + r * H
  bf16* const dst = runs == 1 ? out : ws_o + split * rows_total * MP_DV;
  if (runs > 1 && t4 == 0) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int r = BM * wg + r0 + 8 * e;
      if (r < rows) ws_ml[split * rows_total + row0 + (long long)r * H] = make_float2(m[e], l[e]);
    }
  }
  __syncthreads();
  constexpr int CH = MP_DV / 8;  // 16-byte chunks a row
  for (int it = tid; it < rows * CH; it += MP_THREADS) {
    const int r = it / CH, c = it % CH;  // (o_swz: the swizzle repeats every 8 rows, so 128 rows index as 64)
    *reinterpret_cast<uint4*>(dst + (row0 + (long long)r * H) * MP_DV + c * 8) =
        *reinterpret_cast<const uint4*>(smem + o_swz(r, c, MP_DV * 2));
  }
#else
  __trap();
#endif
}

// The partials of the tiles whose keys took more than one run (mla_prefill_mma) -> out [T, H, 128]: one warp a
// (row, vw value columns). Launch: grid ceil(T * H * (128 / vw) / 4), block 128, dynamic shared memory 4 warps x 2 x
// n_splits floats.
extern "C" __global__ void __launch_bounds__(128) mla_prefill_combine(
    const bf16* __restrict__ ws_o, const float2* __restrict__ ws_ml, bf16* __restrict__ out,
    const int* __restrict__ cu_q, const int* __restrict__ cu_k, int B, int T, int H, int n_splits, int per, int vw) {
  griddep_begin();
  extern __shared__ float ml_sm[];
  const int warp = threadIdx.x >> 5, chunks = MP_DV / vw;
  const long long rows_total = (long long)T * H, item = (long long)blockIdx.x * 4 + warp, row = item / chunks;
  if (row >= rows_total) return;
  const int t = (int)(row / H), b = seq_of(cu_q, B, t);
  if (b < 0) return;
  const int q_len = cu_q[b + 1] - cu_q[b], k_len = cu_k[b + 1] - cu_k[b];
  const int runs = mp_runs(mp_key_tiles(q_len, k_len, (t - cu_q[b]) / MP_ROWS), n_splits, per);
  if (runs == 1) return;
  float* m_sm = ml_sm + warp * 2 * n_splits;
  combine_row(ws_o, ws_ml, out, m_sm, m_sm + n_splits, rows_total, row, (int)(item % chunks) * vw, MP_DV, runs, vw);
}
