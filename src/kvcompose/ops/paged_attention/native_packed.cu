// Paged decode attention over an NVFP4, ternary, INT4, INT2 or KIVI pool, one warp per (row, KV head, split),
// for sm_89+.
//
// Why a hand-written kernel: decoding 4-bit codes costs instructions, and a step of decode
// attention has a budget of about one warp instruction per five bytes read at memory speed.
// The Triton kernel spends most of it moving decoded values into the tensor cores' operand
// layout. Here a tile's codes are copied as they lie into shared memory (cp.async, a tile ahead),
// and every thread reads exactly the bytes its mma fragment needs, so nothing moves:
//
// * Keys are the mma's A operand (16 tokens x 16 channels), the queries its B operand (16
//   channels x 8 query heads), the scores come out transposed (tokens x query heads).
//   A dot product does not care in which order it visits the channels, so a thread's key
//   fragment covers a contiguous quarter of the token's code row (one vector load), and the
//   query fragment is gathered in the same channel order once per program (KIVI: then scaled per tile).
// * Values are the A operand of the transposed product (16 channels x 16 tokens), the
//   probabilities its B operand. A thread holds a contiguous eighth of each token's row; two
//   tokens' decoded pairs are interleaved by byte permutes, and the score fragment becomes the
//   probability fragment by one 8x8 transpose in registers (movmatrix).
// * An NVFP4 code becomes an E4M3 byte of the same value times 2^-6 with integer operations on
//   four bytes at once; a ternary code picks its E4M3 byte (0 or +-2^-6) from a four-byte table
//   (one byte permute for four codes). The hardware converts pairs to fp16, and the block scale
//   times 2^6 is one fp16 multiply whose product is exact. The per-(row, head) scale multiplies
//   the dot products (keys) and the finished output (values) in fp32.
// * NVFP4 and ternary share everything else: an E4M3 scale per 16 channels, and a 32-bit code word
//   (8 NVFP4 or 16 ternary codes) decodes into fp16 pairs whose channels follow one rule
//   (word_channel), so the query gather and the output scatter do not depend on the format.
// * INT4 and INT2 codes (asymmetric, an fp16 scale and minimum per 32 channels of a token) are
//   OR-ed into the mantissa of a power of two in fp16 where they lie (2^(10 - p) for a code at bit p),
//   which gives that power + code exactly; one subtraction and one fused multiply-add per pair of
//   values give code x scale + minimum, rounded once (code_pair). They take a code from each half of
//   a word at once, so their keys' and values' channel orders differ from word_channel's
//   (key_channel, value_channel).
// * KIVI pools (INT4 or INT2) keep the values so (one scale and minimum per token and head), and the keys
//   per channel: a scale and minimum per channel over a group of 32 tokens, one tile. Their scales go into
//   the queries once per tile (q x scale: one multiply per pair of channels) and their minimums into one
//   bias per query head (q . minimum, one mma per k-step whose every row is the minimums), so the key
//   codes reach the mma as the exact small integers they are: a mask-OR and a subtraction per pair.
//
// The program writes one partial result (output and log2-sum-exp) in the layout the Triton
// merge kernel reads, so the recent buffer and other sources join in the same merge.

#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace {

constexpr int TILE = 32;    // tokens per step of a warp's loop: one per lane
constexpr int STAGES = 2;  // tiles in a program's shared-memory ring (see Stage)
constexpr int NVFP4 = 0, TERNARY = 1, INT4 = 2, INT2 = 3, KIVI4 = 4, KIVI2 = 5;  // code formats (the host's `fmt`)
constexpr int INT_GROUP = 32;  // channels per fp16 scale and minimum of the INT formats

// KIVI: keys per channel over a tile's tokens, values per token over the whole head (both asymmetric INT-k)
__host__ __device__ constexpr bool kivi_format(int f) { return f == KIVI4 || f == KIVI2; }
// asymmetric INT-k values: code x scale + minimum, an fp16 scale and minimum per group of channels of a token
__host__ __device__ constexpr bool int_format(int f) { return f == INT4 || f == INT2 || kivi_format(f); }
__host__ __device__ constexpr int code_bits(int f) { return f == NVFP4 || f == INT4 || f == KIVI4 ? 4 : 2; }

template <int F, int D>
struct Shape {
  static constexpr bool KIVI = kivi_format(F);
  static constexpr bool INT = int_format(F);
  static constexpr int PER_BYTE = 8 / code_bits(F);  // codes per byte
  static constexpr int ROW = D / PER_BYTE;  // code bytes per (token, head)
  static constexpr int CHUNKS = ROW / 16;   // 16-byte chunks of a code row
  static constexpr int REGS = 2 * PER_BYTE;  // fp16 pairs a 32-bit code word decodes into
  static constexpr int WORD_CHANNELS = 4 * PER_BYTE;
  static constexpr int VGROUP = KIVI ? D : INT_GROUP;  // channels per fp16 scale of the INT formats' values
  // scale bytes per (token, head): E4M3 per 16 channels, or fp16 per INT group (the minimums likewise); KIVI:
  // of the values only (its keys' scales: a row of D fp16 per tile)
  static constexpr int SCALE_ROW = INT ? 2 * D / VGROUP : D / 16;
  // what decoding leaves out of the values: 2^6 for the E4M3 trick (folded into the key and output scales)
  static constexpr float UNSCALED = INT ? 1.f : 64.f;
  static constexpr int KWORDS = ROW / 16;   // 32-bit code words of a thread's key quarter
  static constexpr int KSTEPS = D / 16;     // k-steps of the key product
  static constexpr int VWORDS = ROW / 32;   // code words of a thread's value eighth
  static constexpr int VTILES = D / 16;     // m-tiles (16 channels) of the value product
  static_assert(VWORDS >= 1, "a thread's value eighth must hold a whole code word");
};

// Channel, among a thread's decoded registers, of element e of register r: registers come in
// groups of four covering 8 channels (fp4_word's order; ternary_word keeps it).
__device__ __forceinline__ int word_channel(int r, int e) {
  return 8 * (r >> 2) + (r & 1) * 4 + ((r >> 1) & 1) + 2 * e;
}

// Channel of element e of key register r (the query gather's order): word_channel's, except for the
// INT formats, whose decode takes code r of each half of a word: channels (r, r + REGS) of the word.
template <int F, int D>
__device__ __forceinline__ int key_channel(int r, int e) {
  using S = Shape<F, D>;
  if constexpr (S::INT) return S::WORD_CHANNELS * (r / S::REGS) + r % S::REGS + S::REGS * e;
  return word_channel(r, e);
}

// Channel of the value product's m-tile r, row gid (e = 0) or gid + 8 (e = 1), within a lane's eighth
// (the output scatter's order): word_channel's, or for the INT formats register 2 r + e holds channel 2 r + e.
template <int F, int D>
__device__ __forceinline__ int value_channel(int r, int e) {
  if constexpr (Shape<F, D>::INT) return 2 * r + e;
  return word_channel(r, e);
}

__device__ __forceinline__ int cdiv(int a, int b) { return (a + b - 1) / b; }

// Eight NVFP4 codes of one word times 2^-6 times a block scale (fp16 pair s2 = (s, s), s the E4M3
// block scale): exact in fp16 (at most 6 significant bits, multiples of 2^-16).
// out[0] = channels (0, 2), out[1] = (4, 6), out[2] = (1, 3), out[3] = (5, 7) of the word.
__device__ __forceinline__ void fp4_word(uint32_t w, uint32_t s2, uint32_t* out) {
  asm("{\n"
      ".reg .b32 lo, hi, t, u;\n"
      ".reg .b16 l0, l1, h0, h1;\n"
      "shl.b32 t, %4, 2;\n"
      "and.b32 t, t, 0x1C1C1C1C;\n"
      "shl.b32 u, %4, 4;\n"
      "and.b32 u, u, 0x80808080;\n"
      "or.b32 lo, t, u;\n"
      "shr.b32 t, %4, 2;\n"
      "and.b32 t, t, 0x1C1C1C1C;\n"
      "and.b32 u, %4, 0x80808080;\n"
      "or.b32 hi, t, u;\n"
      "mov.b32 {l0, l1}, lo;\n"
      "mov.b32 {h0, h1}, hi;\n"
      "cvt.rn.f16x2.e4m3x2 %0, l0;\n"
      "cvt.rn.f16x2.e4m3x2 %1, l1;\n"
      "cvt.rn.f16x2.e4m3x2 %2, h0;\n"
      "cvt.rn.f16x2.e4m3x2 %3, h1;\n"
      "mul.rn.f16x2 %0, %0, %5;\n"
      "mul.rn.f16x2 %1, %1, %5;\n"
      "mul.rn.f16x2 %2, %2, %5;\n"
      "mul.rn.f16x2 %3, %3, %5;\n"
      "}\n"
      : "=r"(out[0]), "=r"(out[1]), "=r"(out[2]), "=r"(out[3])
      : "r"(w), "r"(s2));
}

// Four E4M3 bytes (e: byte 0 lowest) as two fp16 pairs times the fp16 pair s2: out[0] = bytes
// (0, 1), out[1] = bytes (2, 3).
__device__ __forceinline__ void e4m3x4_scaled(uint32_t e, uint32_t s2, uint32_t* out) {
  asm("{\n"
      ".reg .b16 l, h;\n"
      "mov.b32 {l, h}, %2;\n"
      "cvt.rn.f16x2.e4m3x2 %0, l;\n"
      "cvt.rn.f16x2.e4m3x2 %1, h;\n"
      "mul.rn.f16x2 %0, %0, %3;\n"
      "mul.rn.f16x2 %1, %1, %3;\n"
      "}\n"
      : "=r"(out[0]), "=r"(out[1])
      : "r"(e), "r"(s2));
}

// Group i (0 to 3) of a word's codes as E4M3 bytes: codes 0, 2, 4, 6 (i = 0), 1, 3, 5, 7, then
// the same for 8 to 15.
__device__ __forceinline__ uint32_t ternary_bytes(uint32_t w, int i) {
  constexpr uint32_t LEVELS = 0x00880800u;
  return __byte_perm(LEVELS, 0, (w >> (2 * (i & 1) + 16 * (i >> 1))) & 0x3333u);
}

// Sixteen ternary codes of one word (code i in bits 2i, 2i + 1: 0 -> 0, 1 -> +1, 2 -> -1, 3 unused)
// times 2^-6 times a block scale (s2 as in fp4_word), in word_channel's order: out[0] = channels
// (0, 2), out[1] = (4, 6), out[2] = (1, 3), out[3] = (5, 7), out[4 ..] the same for 8 ... 15.
// Each selector holds four codes in the low bits of its nibbles; the byte permute looks each up
// in the table of E4M3 bytes {0, 2^-6, -2^-6, 0}.
__device__ __forceinline__ void ternary_word(uint32_t w, uint32_t s2, uint32_t* out) {
#pragma unroll
  for (int i = 0; i < 4; ++i) e4m3x4_scaled(ternary_bytes(w, i), s2, out + 2 * i);
}

// Code i of each half-word of an INT-k word w (k = code_bits, bits [k i, k i + k) of each half) as the fp16
// pair of the codes themselves. A code OR-ed into the mantissa of 2^e at bit position p is 2^e + code x 2^(e - 10 + p)
// exactly; with e = 10 - p that is 2^e + code, and subtracting 2^e leaves the code. So the codes that lie within the
// ten mantissa bits (in_place of them: 5 INT2, 2 INT4 codes) need no shift, and the others one shift per word (by
// the bits of the first in_place codes), shared by all of them: a mask-OR and a subtraction per pair, where a shift,
// a mask, an OR and a subtraction were needed with every code shifted to bit 0.
__host__ __device__ constexpr int in_place(int f) { return 10 / code_bits(f); }
template <int F>
__device__ __forceinline__ uint32_t code_pair(uint32_t w, int i) {
  constexpr int BITS = code_bits(F), N = in_place(F);
  const int at = BITS * (i % N);                                   // the code's bit in the (shifted) half-word
  const uint32_t x = w >> (BITS * N * (i / N));                    // constant after unrolling: 0 or one shift
  const uint32_t mask = ((1u << BITS) - 1) * 0x10001u << at;
  const uint32_t base = (uint32_t)(25 - at) * 0x04000400u;        // fp16 2^(10 - at), twice
  uint32_t biased, r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(biased) : "r"(x), "r"(mask), "r"(base));  // (x & mask) | base
  asm("sub.rn.f16x2 %0, %1, %2;\n" : "=r"(r) : "r"(biased), "r"(base));
  return r;
}

// The same codes as the fp16 pair code x scale + minimum (s2, m2: fp16 pairs): the fused multiply-add
// rounds once (as the reference's fp32 decode rounded to fp16 does).
template <int F>
__device__ __forceinline__ uint32_t int_pair(uint32_t w, int i, uint32_t s2, uint32_t m2) {
  uint32_t r;
  asm("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(r) : "r"(code_pair<F>(w, i)), "r"(s2), "r"(m2));
  return r;
}

// One INT-k code word of one token: out[r] = channels (r, r + R) of the word (key_channel's order; R: the
// codes per half-word), as code x scale + minimum, or (SCALED false: KIVI keys) as the codes.
template <int F, bool SCALED = true>
__device__ __forceinline__ void int_word(uint32_t w, uint32_t s2, uint32_t m2, uint32_t* out) {
#pragma unroll
  for (int r = 0; r < 16 / code_bits(F); ++r) out[r] = SCALED ? int_pair<F>(w, r, s2, m2) : code_pair<F>(w, r);
}

// One key code word of format F decoded into Shape::REGS fp16 pairs (key_channel's order); m2: the
// INT formats' minimum pair (unused by the others). KIVI keys stay codes (their scales are in the queries).
template <int F>
__device__ __forceinline__ void decode_word(uint32_t w, uint32_t s2, uint32_t m2, uint32_t* out) {
  if constexpr (F == TERNARY) ternary_word(w, s2, out);
  else if constexpr (kivi_format(F)) int_word<F, false>(w, s2, m2, out);
  else if constexpr (int_format(F)) int_word<F>(w, s2, m2, out);
  else fp4_word(w, s2, out);
}

// The same code word of two tokens (w0, w1) decoded into fp16 pairs that each hold both tokens'
// value of one channel, as the value product's A operand takes them (two tokens per register):
// out[2 k + e] = (token 0, token 1) at the word's channel value_channel(k, e); s2 = (scale of
// token 0, scale of token 1), m2 likewise the INT formats' minimums. The bytes of the two words are
// interleaved before the decode
// (after the table lookup for ternary), which costs a quarter (NVFP4) or half (ternary) of the
// byte permutes that interleaving the decoded pairs would.
template <int F>
__device__ __forceinline__ void decode_token_pair(uint32_t w0, uint32_t w1, uint32_t s2, uint32_t m2, uint32_t* out) {
  if constexpr (int_format(F)) {
    // the first half-words of both tokens side by side, then the second: each half of x0 (x1) holds
    // one token's codes of the word's first (second) half, so one code_pair gives a channel of both
    constexpr int HALF = 16 / code_bits(F);  // codes per half-word
    const uint32_t x0 = __byte_perm(w0, w1, 0x5410), x1 = __byte_perm(w0, w1, 0x7632);
#pragma unroll
    for (int c = 0; c < HALF; ++c) {
      out[c] = int_pair<F>(x0, c, s2, m2);
      out[HALF + c] = int_pair<F>(x1, c, s2, m2);
    }
  } else if constexpr (F == TERNARY) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t e0 = ternary_bytes(w0, i), e1 = ternary_bytes(w1, i);
      e4m3x4_scaled(__byte_perm(e0, e1, 0x5140), s2, out + 4 * i);
      e4m3x4_scaled(__byte_perm(e0, e1, 0x7362), s2, out + 4 * i + 2);
    }
  } else {
    // bytes 0 and 1 of both words hold channels 0 to 3: fp4_word gives (0), (2), (1), (3); bytes
    // 2 and 3 hold channels 4 to 7 likewise
    uint32_t o[4];
    fp4_word(__byte_perm(w0, w1, 0x5140), s2, o);
    out[0] = o[0], out[1] = o[1], out[4] = o[2], out[5] = o[3];
    fp4_word(__byte_perm(w0, w1, 0x7362), s2, o);
    out[2] = o[0], out[3] = o[1], out[6] = o[2], out[7] = o[3];
  }
}

// fp16 pair (a, b) of the E4M3 bytes in the low 16 bits of x (a: the low byte).
__device__ __forceinline__ uint32_t scale_pair(uint32_t x) {
  uint32_t r;
  asm("{\n.reg .b16 lo;\ncvt.u16.u32 lo, %1;\ncvt.rn.f16x2.e4m3x2 %0, lo;\n}\n" : "=r"(r) : "r"(x));
  return r;
}

__device__ __forceinline__ void mma16816(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t transpose8x8(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

__device__ __forceinline__ uint32_t half2_bits(float a, float b) {
  __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&h);
}

// 2^x as the hardware's approximation (ex2.approx.ftz: within two units in the last place; -inf
// gives 0): exp2f's handling of denormal results costs three more instructions per call.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

// The codes and scales one lane needs for one tile: four key tokens (rows gid, gid + 8 of the
// tile's two 16-token halves) and eight value tokens (2 tig, 2 tig + 1, 2 tig + 8, 2 tig + 9 of
// each half), plus the validity of the lane's own token.
template <int F, int D>
struct Tile {
  uint32_t k[4][Shape<F, D>::KWORDS];
  uint32_t kscale[4];
  uint32_t v[8][Shape<F, D>::VWORDS];
  uint32_t vscale[8];
  uint32_t kmin[4], vmin[8];  // the INT formats' fp16 minimums (the scales then: fp16 too)
  // KIVI: the queries times the tile's key scales (the key product's B operand) and q . minimum of the
  // lane's two query heads
  uint32_t qs[Shape<F, D>::KIVI ? Shape<F, D>::KSTEPS : 1][2];
  float bias[2];
  uint32_t ok;  // bit x: token x of the tile takes part (in the split, and valid)
};

__device__ __forceinline__ int key_token(int kt, int gid) { return 16 * (kt >> 1) + gid + 8 * (kt & 1); }
__device__ __forceinline__ int value_token(int vt, int tig) {
  const int u = vt & 3;
  return 16 * (vt >> 2) + 2 * tig + (u & 1) + 8 * (u >> 1);
}

// Where a program reads: the pools, and the byte offsets of its head within a slot's codes and
// scales. Offsets are 32-bit (the launcher checks that the pools fit).
struct Pools {
  const uint8_t* __restrict__ valid;
  const uint8_t* __restrict__ kc;
  const uint8_t* __restrict__ ks;
  const uint8_t* __restrict__ vc;
  const uint8_t* __restrict__ vs;
  const uint8_t* __restrict__ km;  // the INT formats' minimums (laid out as their scales)
  const uint8_t* __restrict__ vm;
  uint32_t code_stride, scale_stride;  // bytes from a slot to the next: H x row bytes, H x scale row (head-major: one row)
  uint32_t code_at, scale_at;          // the head's offsets (head-major: its first row)
  uint32_t group_stride, group_at;     // KIVI keys' scales [token groups, H, D]: bytes per group, the head's offset
};

// One stage of a program's shared-memory ring: a tile as it lies in the pools, copied by cp.async
// while the tile before it is computed (the copies hold no registers). Per operand the tile's
// code rows [TILE][row bytes], then per operand its scales [TILE][SCALE_ROW] (KIVI keys: one row of D fp16;
// INT formats: then per operand its minimums, likewise), then TILE validity bytes. On an H200 (16 x 8K, 64 x 4K, 256 x 1K, head dim 128; benchmarks/results/attention_gpu.json):
// 54-58% of the copy bandwidth on slot-major pools, against 42-46% when the next tile waited in
// registers. What held it there was the reads themselves (benchmarks/tools/probe_native_gpu.py): this
// ring of copies with no products, softmax or decode ran no faster than the whole kernel, and neither
// fewer instructions nor more programs per SM helped. A head's 64-byte rows lie 512 bytes apart in
// slot-major pools; head-major pools (Policy.pool_layout="head", the default; head_rows below) keep a
// block's rows of one head together, and there the kernel reached 61-69%, its ring of copies alone
// 69-76%.
//
// Code rows are stored in 16-byte chunks, swizzled: chunk i = t CHUNKS + c (token t, chunk c of its
// row) sits at i ^ (2 (i >> 3) & 6), which spreads every NVFP4 fragment read below over all banks.
template <int F, int D>
struct Stage {
  using S = Shape<F, D>;
  static constexpr int CODES = TILE * S::ROW;          // code bytes of the tile, per operand
  static constexpr int VSCALES = TILE * S::SCALE_ROW;  // value scale bytes of the tile
  static constexpr int KSCALES = S::KIVI ? 2 * D : VSCALES;  // key scale bytes (KIVI: the tile's group, fp16 per channel)
  static constexpr int KMINS = S::INT ? KSCALES : 0, VMINS = S::INT ? VSCALES : 0;  // minimum bytes, likewise
  static constexpr int K = 0, V = CODES, KS = 2 * CODES, VS = KS + KSCALES, KM = VS + VSCALES, VM = KM + KMINS;
  static constexpr int VALID = VM + VMINS;
  static constexpr int BYTES = VALID + TILE;
};

__device__ __forceinline__ uint32_t swizzle(uint32_t chunk) { return chunk ^ ((chunk >> 2) & 6); }

// Offset in a stage's codes of byte `offset` of token t's row (within one 16-byte chunk).
template <int F, int D>
__device__ __forceinline__ uint32_t code_at(int t, int offset) {
  return 16 * swizzle(t * Shape<F, D>::CHUNKS + offset / 16) + offset % 16;
}

template <int N>  // N bytes, zero-filled where !ok (nothing is read then)
__device__ __forceinline__ void copy_async(uint32_t dst, const uint8_t* src, bool ok) {
  if constexpr (N == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(ok ? 16 : 0));
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(dst), "l"(src), "n"(N), "r"(ok ? N : 0));
  }
}
__device__ __forceinline__ void commit_copies() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void wait_copies() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Start copying the tile whose lane-th token lies in slot `slot` (-1: none) into `stage`. Codes:
// lane l copies chunks l, l + 32, ... of the tile (the lanes of one token row read it whole);
// scales one copy per token (KIVI: 16-byte copies of the tile's rows and runs); validity four tokens' bytes
// per copy (a block holds a multiple of
// four tokens, and a tile starts a block).
template <int F, int D>
__device__ __forceinline__ void issue_tile(uint32_t stage, int slot, const Pools& p, int lane, uint32_t copy_at) {
  using St = Stage<F, D>;
  constexpr int CHUNKS = Shape<F, D>::CHUNKS;
  constexpr uint32_t NONE = 0xffffffffu;
  // each lane takes the code offset of the token whose chunks it copies (NONE: no slot)
  const uint32_t code = slot >= 0 ? (uint32_t)slot * p.code_stride + p.code_at : NONE;
#pragma unroll
  for (int i = 0; i < CHUNKS; ++i) {
    const int chunk = lane + 32 * i, t = chunk / CHUNKS, c = chunk % CHUNKS;
    const uint32_t at = __shfl_sync(0xffffffffu, code, t);
    const bool ok = at != NONE;
    const uint32_t from = (ok ? at : 0u) + 16 * c;
    copy_async<16>(stage + St::K + copy_at + 512 * i, p.kc + from, ok);  // chunk i sits 32 chunks on
    copy_async<16>(stage + St::V + copy_at + 512 * i, p.vc + from, ok);
  }
  if constexpr (Shape<F, D>::KIVI) {
    // 16 bytes per copy: the key group's scales and minimums (a row of D fp16 each; the tile's 32 tokens
    // are one token group of one block, found from its first slot), then the value scales and minimums of
    // its 32 slots (an fp16 each, a run of 64 bytes: head-major rows)
    constexpr int ROW_CHUNKS = 2 * D / 16;
    const int first = __shfl_sync(0xffffffffu, slot, 0);
    const uint32_t f = (uint32_t)max(first, 0);
    if (lane < 2 * ROW_CHUNKS) {
      const int c = lane % ROW_CHUNKS;
      const uint32_t at = f / TILE * p.group_stride + p.group_at + 16 * c;
      copy_async<16>(stage + (lane < ROW_CHUNKS ? St::KS : St::KM) + 16 * c, (lane < ROW_CHUNKS ? p.ks : p.km) + at,
                     first >= 0);
    }
    if (lane < 8) {
      const int c = lane % 4;
      const uint32_t at = f * p.scale_stride + p.scale_at + 16 * c;
      copy_async<16>(stage + (lane < 4 ? St::VS : St::VM) + 16 * c, (lane < 4 ? p.vs : p.vm) + at, first >= 0);
    }
  } else {
    constexpr int SR = Shape<F, D>::SCALE_ROW;
    const uint32_t at = (uint32_t)max(slot, 0) * p.scale_stride + p.scale_at;
    copy_async<SR>(stage + St::KS + SR * lane, p.ks + at, slot >= 0);
    copy_async<SR>(stage + St::VS + SR * lane, p.vs + at, slot >= 0);
    if constexpr (Shape<F, D>::INT) {
      copy_async<SR>(stage + St::KM + SR * lane, p.km + at, slot >= 0);
      copy_async<SR>(stage + St::VM + SR * lane, p.vm + at, slot >= 0);
    }
  }
  if ((lane & 3) == 0) copy_async<4>(stage + St::VALID + lane, p.valid + max(slot, 0), slot >= 0);
}

template <int N>
__device__ __forceinline__ void load_shared(uint32_t at, uint32_t* w) {
  if constexpr (N == 4) {
    asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n" : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "r"(at));
  } else if constexpr (N == 2) {
    asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];\n" : "=r"(w[0]), "=r"(w[1]) : "r"(at));
  } else {
    asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(w[0]) : "r"(at));
  }
}

template <int N>  // N zero bytes at `at` (N: 2, 4 or 8, aligned to N)
__device__ __forceinline__ void store_shared_zero(uint32_t at) {
  if constexpr (N == 8) {
    asm volatile("st.shared.v2.u32 [%0], {%1, %1};\n" ::"r"(at), "r"(0u));
  } else if constexpr (N == 4) {
    asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(at), "r"(0u));
  } else {
    static_assert(N == 2, "2, 4 or 8 bytes");
    asm volatile("st.shared.u16 [%0], %1;\n" ::"r"(at), "h"((unsigned short)0));
  }
}

__device__ __forceinline__ uint32_t load_shared_u8(uint32_t at) {
  uint32_t r;
  asm volatile("ld.shared.u8 %0, [%1];\n" : "=r"(r) : "r"(at));
  return r;
}

__device__ __forceinline__ uint32_t load_shared_u16(uint32_t at) {
  uint32_t r;
  asm volatile("ld.shared.u16 %0, [%1];\n" : "=r"(r) : "r"(at));
  return r;
}

// A lane's byte offsets within a stage, computed once per program (the loop would recompute the
// swizzle of every read): the first code chunk it copies, its key rows (tokens gid, gid + 8) and its
// value rows (tokens 2 tig, 2 tig + 1, 2 tig + 8, 2 tig + 9). The swizzle moves a chunk 32 chunks on,
// and a row 16 tokens on, by exactly that many bytes, so every other offset is one of these plus a
// constant.
struct LaneAt {
  uint32_t copy, k[2], v[4];
};

template <int F, int D>
__device__ __forceinline__ LaneAt lane_offsets(int lane, int gid, int tig) {
  using S = Shape<F, D>;
  static_assert(S::CHUNKS >= 2, "16 tokens on must leave the swizzle's bits alone");
  LaneAt at;
  at.copy = 16 * swizzle(lane);
#pragma unroll
  for (int kt = 0; kt < 2; ++kt) at.k[kt] = code_at<F, D>(key_token(kt, gid), (S::ROW / 4) * tig);
#pragma unroll
  for (int vt = 0; vt < 4; ++vt) at.v[vt] = code_at<F, D>(value_token(vt, tig), (S::ROW / 8) * gid);
  return at;
}

__device__ __forceinline__ uint32_t mul_half2(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(b));
  return r;
}

// KIVI keys of one tile (one token group): qs = the query fragment times the group's scales, in its channel
// order, and bias[e] = q . minimum of query head 2 tig + e (by mma: every row of its A operand holds the
// minimums, so every row of the result is the bias). A word's register r holds channels (r, r + R) of the
// word (key_channel), whose scales are halves of the word's fp16 pairs r / 2 and r / 2 + R / 2.
template <int F, int D>
__device__ __forceinline__ void kivi_queries(uint32_t stage, const uint32_t (*qf)[2], int tig, uint32_t (*qs)[2],
                                             float* bias) {
  using S = Shape<F, D>;
  using St = Stage<F, D>;
  constexpr int R = S::REGS;
  float c[4] = {0.f, 0.f, 0.f, 0.f};
  const uint32_t quarter = (D / 2) * tig;  // the lane's key quarter in a row of fp16
#pragma unroll
  for (int w = 0; w < S::KWORDS; ++w) {
    uint32_t sc[R], mn[R];  // the word's scales and minimums as fp16 pairs of channels (2 i, 2 i + 1)
#pragma unroll
    for (int i = 0; i < R / 4; ++i) {
      load_shared<4>(stage + St::KS + quarter + 4 * R * w + 16 * i, sc + 4 * i);
      load_shared<4>(stage + St::KM + quarter + 4 * R * w + 16 * i, mn + 4 * i);
    }
#pragma unroll
    for (int r = 0; r < R; r += 2) {  // registers r and r + 1 of the word: one k-step
      const int kk = (R * w + r) / 2;
      uint32_t m[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int rr = r + h;
        const uint32_t sel = rr % 2 ? 0x7632 : 0x5410;
        qs[kk][h] = mul_half2(qf[kk][h], __byte_perm(sc[rr / 2], sc[rr / 2 + R / 2], sel));
        m[h] = __byte_perm(mn[rr / 2], mn[rr / 2 + R / 2], sel);
      }
      mma16816(c, m[0], m[0], m[1], m[1], qf[kk][0], qf[kk][1]);
    }
  }
  bias[0] = c[0], bias[1] = c[1];
}

// A lane's fragments of one tile, read from its stage; `live`: the lane's token is in the split.
template <int F, int D>
__device__ __forceinline__ void read_tile(Tile<F, D>& t, uint32_t stage, const LaneAt& at, bool live, int gid,
                                          int tig, int lane, const uint32_t (*qf)[2]) {
  using S = Shape<F, D>;
  using St = Stage<F, D>;
  const bool lane_ok = live && load_shared_u8(stage + St::VALID + lane) != 0;
  t.ok = __ballot_sync(0xffffffffu, lane_ok);
  if (t.ok != 0xffffffffu) {  // rare: a split's last tile, or holes
    // A token that takes no part gets probability 0, but its slot may hold anything (an empty slot of a
    // pool the caller built); scale (and minimum) 0 make its values 0 whatever its codes, so 0 x NaN never
    // reaches the output. Done here, in the stage, so that the common tile pays one test for it.
    if (!lane_ok) {
      store_shared_zero<S::SCALE_ROW>(stage + St::VS + S::SCALE_ROW * lane);
      if constexpr (S::INT) store_shared_zero<S::SCALE_ROW>(stage + St::VM + S::SCALE_ROW * lane);
    }
    __syncwarp();
  }
  if constexpr (S::KIVI) kivi_queries<F, D>(stage, qf, tig, t.qs, t.bias);
#pragma unroll
  for (int kt = 0; kt < 4; ++kt) {
    const int tok = key_token(kt, gid);
    load_shared<S::KWORDS>(stage + St::K + at.k[kt & 1] + 16 * S::ROW * (kt >> 1), t.k[kt]);
    if constexpr (S::KIVI) {
      // no per-token key scales
    } else if constexpr (S::INT) {  // the fp16 scale and minimum of the group of the lane's key quarter
      const uint32_t g = S::SCALE_ROW * tok + 2 * ((D / 4) * tig / INT_GROUP);
      t.kscale[kt] = load_shared_u16(stage + St::KS + g);
      t.kmin[kt] = load_shared_u16(stage + St::KM + g);
    } else {  // the E4M3 block scales of the lane's key quarter
      const uint32_t at = stage + St::KS + (D / 16) * tok + (D / 64) * tig;
      t.kscale[kt] = D == 128 ? load_shared_u16(at) : load_shared_u8(at);
    }
  }
#pragma unroll
  for (int vt = 0; vt < 8; ++vt) {
    const int tok = value_token(vt, tig);
    load_shared<S::VWORDS>(stage + St::V + at.v[vt & 3] + 16 * S::ROW * (vt >> 2), t.v[vt]);
    if constexpr (S::INT) {  // the group of the lane's value eighth
      const uint32_t g = S::SCALE_ROW * tok + 2 * ((D / 8) * gid / S::VGROUP);
      t.vscale[vt] = load_shared_u16(stage + St::VS + g);
      t.vmin[vt] = load_shared_u16(stage + St::VM + g);
    } else {
      t.vscale[vt] = load_shared_u8(stage + St::VS + (D / 16) * tok + (D * gid) / 128);
    }
  }
}

// The block of the lane's token t (-1 beyond end): loaded a tile ahead of its use, so that the
// table's latency never stalls the loop. Blocks hold 2^bs_shift slots: a shift, where a division by
// a block size known only at run time cost about 30 instructions per tile.
__device__ __forceinline__ int64_t lane_block(const int64_t* __restrict__ table, int64_t row, int W, int bs_shift,
                                              int t, int end) {
  return t < end ? table[row * W + (t >> bs_shift)] : -1;
}

__device__ __forceinline__ int lane_slot(int64_t blk, int bs_shift, int t) {
  return blk < 0 ? -1 : (int)((blk << bs_shift) + (t & ((1 << bs_shift) - 1)));
}

// The online-softmax state of one program: running maximum and sum of the lane's two query
// heads (2 tig, 2 tig + 1), the output accumulator (transposed: channels x query heads).
template <int D>
struct State {
  float m[2], l[2];
  float acc[D / 16][4];  // Shape::VTILES
};

// The scales of the lane's key token kt as fp16 pairs (scale, minimum): its two E4M3 block scales (no
// minimum), the group's INT scale and minimum twice each, nothing for KIVI keys (their scales are in the
// queries, their minimums in the bias).
template <int F, int D>
__device__ __forceinline__ uint2 key_scales(const Tile<F, D>& t, int kt) {
  using S = Shape<F, D>;
  if constexpr (S::KIVI) return make_uint2(0u, 0u);
  else if constexpr (S::INT) return make_uint2(t.kscale[kt] * 0x10001u, t.kmin[kt] * 0x10001u);
  else return make_uint2(scale_pair(t.kscale[kt]), 0u);
}

// The scale pair that word kw of a key token decodes with: the E4M3 formats' block scale of the word, twice.
template <int F, int D>
__device__ __forceinline__ uint32_t word_scale(uint32_t pair, int kw) {
  if constexpr (Shape<F, D>::INT) return pair;
  else return __byte_perm(pair, 0, kw * Shape<F, D>::WORD_CHANNELS < 16 ? 0x1010 : 0x3232);
}

// One tile: scores, online softmax, values. Decoded NVFP4 and ternary values lack the 2^6 that the
// E4M3 trick takes off (Shape::UNSCALED, folded into key_scale and into the output scale).
template <int F, int D>
__device__ __forceinline__ void attend_tile(const Tile<F, D>& t, State<D>& st, const uint32_t (*qf)[2],
                                            float key_scale, int gid, int tig) {
  using S = Shape<F, D>;
  // the tile's bits from the lane's first key token (gid) on: every test below is then of a constant bit
  const uint32_t key_ok = t.ok >> gid;

  // scores, transposed: s[j] = tokens 16 j + (gid, gid + 8) x query heads (2 tig, 2 tig + 1)
  float s[2][4];
  const uint32_t (*kq)[2] = S::KIVI ? t.qs : qf;  // the key product's B operand: KIVI's carries the key scales
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    s[j][0] = s[j][2] = S::KIVI ? t.bias[0] : 0.f;
    s[j][1] = s[j][3] = S::KIVI ? t.bias[1] : 0.f;
    uint32_t a0[2 * S::KSTEPS], a1[2 * S::KSTEPS];
    const uint2 p0 = key_scales(t, 2 * j), p1 = key_scales(t, 2 * j + 1);
#pragma unroll
    for (int kw = 0; kw < S::KWORDS; ++kw) {
      decode_word<F>(t.k[2 * j][kw], word_scale<F, D>(p0.x, kw), p0.y, a0 + S::REGS * kw);
      decode_word<F>(t.k[2 * j + 1][kw], word_scale<F, D>(p1.x, kw), p1.y, a1 + S::REGS * kw);
    }
#pragma unroll
    for (int kk = 0; kk < S::KSTEPS; ++kk)
      mma16816(s[j], a0[2 * kk], a1[2 * kk], a0[2 * kk + 1], a1[2 * kk + 1], kq[kk][0], kq[kk][1]);
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const bool live = (key_ok >> (16 * j + 8 * (c >> 1))) & 1u;
      s[j][c] = live ? s[j][c] * key_scale : -INFINITY;
    }
  }
  // online softmax per query head (2 tig + e): the tile's maximum over the 8 lanes that share tig
  float alpha[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    float mx = fmaxf(fmaxf(s[0][e], s[0][e + 2]), fmaxf(s[1][e], s[1][e + 2]));
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    const float m_new = fmaxf(st.m[e], mx);
    const float m_safe = m_new == -INFINITY ? 0.f : m_new;
    alpha[e] = fast_exp2(st.m[e] - m_safe);
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      s[j][e] = fast_exp2(s[j][e] - m_safe);
      s[j][e + 2] = fast_exp2(s[j][e + 2] - m_safe);
      sum += s[j][e] + s[j][e + 2];
    }
    st.l[e] = st.l[e] * alpha[e] + sum;
    st.m[e] = m_new;
  }
#pragma unroll
  for (int r = 0; r < S::VTILES; ++r) {
    st.acc[r][0] *= alpha[0];
    st.acc[r][1] *= alpha[1];
    st.acc[r][2] *= alpha[0];
    st.acc[r][3] *= alpha[1];
  }
  // values: O^T[channels, query heads] += V^T[channels, tokens] P^T[tokens, query heads]
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const uint32_t b0 = transpose8x8(half2_bits(s[j][0], s[j][1]));
    const uint32_t b1 = transpose8x8(half2_bits(s[j][2], s[j][3]));
    // x[p]: the lane's token pair p (value tokens 4 j + 2 p and 4 j + 2 p + 1), register 2 r + e
    // holding both tokens at channel value_channel(r, e); a token that takes no part has scale (and
    // minimum) 0 (read_tile)
    uint32_t x[2][2 * S::VTILES];
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      const int v0 = 4 * j + 2 * p, v1 = v0 + 1;
      // the pair's two scales (INT: and minimums) as one fp16 pair
      const uint32_t sc = S::INT ? t.vscale[v0] | (t.vscale[v1] << 16) : scale_pair(t.vscale[v0] | (t.vscale[v1] << 8));
      const uint32_t mc = S::INT ? t.vmin[v0] | (t.vmin[v1] << 16) : 0u;
#pragma unroll
      for (int vw = 0; vw < S::VWORDS; ++vw)
        decode_token_pair<F>(t.v[v0][vw], t.v[v1][vw], sc, mc, x[p] + 2 * S::REGS * vw);
    }
#pragma unroll
    for (int r = 0; r < S::VTILES; ++r)
      mma16816(st.acc[r], x[0][2 * r], x[0][2 * r + 1], x[1][2 * r], x[1][2 * r + 1], b0, b1);
  }
}

// The regions of one pool that a launch reads (ThinKV's R and E share a pool): each has its own
// block table, extent and splits; the programs of grid row y read region r where y falls in its
// splits. One launch instead of one per region saves a launch and a partly filled last wave each.
constexpr int MAX_REGIONS = 4;
struct Regions {
  const int64_t* table[MAX_REGIONS];
  const int64_t* extent[MAX_REGIONS];  // nullptr: no extent
  int W[MAX_REGIONS], per_split[MAX_REGIONS], n_splits[MAX_REGIONS], first[MAX_REGIONS];
  int count;
};

// KIVI at head dim 128 held to 16 programs per SM (at most 128 registers, no spills; left alone, ptxas gave it
// 143-150); the others as ptxas chooses (0: no minimum)
template <int F, int D, typename T>
__global__ void __launch_bounds__(32, kivi_format(F) && D == 128 ? 16 : 0) packed_partial_kernel(
    const T* __restrict__ q, float* __restrict__ part, float* __restrict__ lse, const uint8_t* __restrict__ valid,
    const uint8_t* __restrict__ kc, const uint8_t* __restrict__ ks, const float* __restrict__ khs,
    const uint8_t* __restrict__ vc, const uint8_t* __restrict__ vs, const float* __restrict__ vhs,
    const uint8_t* __restrict__ km, const uint8_t* __restrict__ vm, const Regions R,
    int H, int G, int bs_shift, int total, float qk_scale, int head_rows) {
  using S = Shape<F, D>;
  const int row = blockIdx.x / H, head = blockIdx.x % H;
  // The region of this program and its split within it (constant indices: the fields stay parameters).
  const int64_t* table = R.table[0];
  const int64_t* extent = R.extent[0];
  int W = R.W[0], per = R.per_split[0], n_splits = R.n_splits[0], first = R.first[0], split = blockIdx.y;
#pragma unroll
  for (int r = 1; r < MAX_REGIONS; ++r) {
    if (r < R.count && split >= n_splits) {
      split -= n_splits;
      table = R.table[r], extent = R.extent[r], W = R.W[r], per = R.per_split[r];
      n_splits = R.n_splits[r], first = R.first[r];
    }
  }
  const int lane = threadIdx.x, gid = lane >> 2, tig = lane & 3;
  const int Hq = H * G;
  int limit = W << bs_shift;
  if (extent != nullptr) {
    limit = min((int)extent[row], limit);
    per = cdiv(cdiv(limit, n_splits), TILE) * TILE;
  }
  const int start = split * per, end = min(start + per, limit);

  // The query fragment (B operand of the key product), in the channel order of the key fragments,
  // shifted by a power of two into fp16's range (exact for a bf16 query): its largest magnitude into
  // [2^14, 2^15), or for KIVI into [2^-1, 2^0), so that its product with any finite fp16 key scale stays finite.
  float qv[S::KSTEPS][2][2];
  float amax = 0.f;
  const T* qrow = q + ((int64_t)row * Hq + head * G + gid) * D;
#pragma unroll
  for (int kk = 0; kk < S::KSTEPS; ++kk)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int rho = 2 * kk + h;
        const int ch = (D / 4) * tig + key_channel<F, D>(rho, e);
        const float x = gid < G ? to_float(qrow[ch]) : 0.f;
        qv[kk][h][e] = x;
        amax = fmaxf(amax, fabsf(x));
      }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  const int ex = (__float_as_uint(amax) >> 23) & 0xFF;
  constexpr int TOP = S::KIVI ? 253 : 268;  // 127 + the target exponent + 127
  const float shift = ex < 255 ? __uint_as_float((uint32_t)min(TOP - ex, 254) << 23) : 1.f;
  uint32_t qf[S::KSTEPS][2];
#pragma unroll
  for (int kk = 0; kk < S::KSTEPS; ++kk)
#pragma unroll
    for (int h = 0; h < 2; ++h) qf[kk][h] = half2_bits(qv[kk][h][0] * shift, qv[kk][h][1] * shift);
  // the INT formats have no second-level scales (their pointers are null)
  const float key_scale = qk_scale * (S::INT ? 1.f : khs[row * H + head]) * S::UNSCALED / shift;

  State<D> st;
  st.m[0] = st.m[1] = -INFINITY;
  st.l[0] = st.l[1] = 0.f;
#pragma unroll
  for (int r = 0; r < S::VTILES; ++r) st.acc[r][0] = st.acc[r][1] = st.acc[r][2] = st.acc[r][3] = 0.f;

  // the (slot, head) row of the pools: slot H + head (slot-major), or head head_rows + slot (head-major,
  // each head's rows together: a block's slots of this head are one run of bytes)
  const uint32_t slot_rows = head_rows > 0 ? 1u : (uint32_t)H;
  const uint32_t head_at = head_rows > 0 ? (uint32_t)head * (uint32_t)head_rows : (uint32_t)head;
  Pools p{valid, kc, ks, vc, vs, km, vm, slot_rows * S::ROW, slot_rows * S::SCALE_ROW, head_at * S::ROW,
          head_at * S::SCALE_ROW, (uint32_t)H * 2 * D, (uint32_t)head * 2 * D};
  // The ring: tile i is copied into stage i % STAGES, STAGES - 1 tiles ahead of its use; the
  // block-table entries of the tile after the one being copied are loaded one step earlier still.
  __shared__ __align__(128) uint8_t ring[STAGES][Stage<F, D>::BYTES];
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(ring));
  const int tiles = start < end ? cdiv(end - start, TILE) : 0;
  const LaneAt at = lane_offsets<F, D>(lane, gid, tig);
  int64_t blk = lane_block(table, row, W, bs_shift, start + lane, end);
#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) {
    const int t = start + i * TILE + lane;
    const int slot = lane_slot(blk, bs_shift, t);
    blk = lane_block(table, row, W, bs_shift, t + TILE, end);
    if (i < tiles) issue_tile<F, D>(base + i * Stage<F, D>::BYTES, slot, p, lane, at.copy);
    commit_copies();
  }
  Tile<F, D> tile;
  for (int i = 0; i < tiles; ++i) {
    const int ahead = i + STAGES - 1, t = start + ahead * TILE + lane;
    const int slot = lane_slot(blk, bs_shift, t);
    blk = lane_block(table, row, W, bs_shift, t + TILE, end);
    wait_copies<STAGES - 2>();  // this lane's copies of tile i have landed
    __syncwarp();               // every lane's have, and every lane has read tile i - 1's stage
    if (ahead < tiles) issue_tile<F, D>(base + (ahead % STAGES) * Stage<F, D>::BYTES, slot, p, lane, at.copy);
    commit_copies();
    read_tile<F, D>(tile, base + (i % STAGES) * Stage<F, D>::BYTES, at, start + i * TILE + lane < end, gid, tig,
                    lane, qf);
    attend_tile<F, D>(tile, st, qf, key_scale, gid, tig);
  }

  const float vscale = (S::INT ? 1.f : vhs[row * H + head]) * S::UNSCALED;
#pragma unroll
  for (int e = 0; e < 2; ++e) {
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) st.l[e] += __shfl_xor_sync(0xffffffffu, st.l[e], off);
  }
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int g = 2 * tig + e;
    if (g >= G) continue;
    const int64_t at = ((int64_t)row * Hq + head * G + g) * total + first + split;
    if (gid == 0) lse[at] = st.l[e] > 0.f ? st.m[e] + log2f(st.l[e]) : -INFINITY;
    const float inv = vscale / fmaxf(st.l[e], 1e-30f);
    float* out = part + at * D + (D / 8) * gid;
#pragma unroll
    for (int r = 0; r < S::VTILES; ++r) {
      out[value_channel<F, D>(r, 0)] = st.acc[r][e] * inv;
      out[value_channel<F, D>(r, 1)] = st.acc[r][e + 2] * inv;
    }
  }
}

template <int F, int D, typename T>
void launch(const at::Tensor& q, at::Tensor& part, at::Tensor& lse, const std::vector<at::Tensor>& tables,
            const at::Tensor& valid, const at::Tensor& kc, const at::Tensor& ks, const at::Tensor& khs,
            const at::Tensor& vc, const at::Tensor& vs, const at::Tensor& vhs, const at::Tensor& km,
            const at::Tensor& vm, const std::vector<at::Tensor>& extents,
            int64_t block_size, const std::vector<int64_t>& per_split, const std::vector<int64_t>& n_splits,
            const std::vector<int64_t>& first, int64_t total, double qk_scale, int64_t head_rows) {
  const int count = tables.size();
  constexpr bool INT = Shape<F, D>::INT;
  TORCH_CHECK(INT == (km.numel() > 0 && vm.numel() > 0) && INT == (khs.numel() == 0 && vhs.numel() == 0),
              "packed partial kernel: the INT formats take minimums and no second-level scales, the others "
              "second-level scales and no minimums");
  TORCH_CHECK(count >= 1 && count <= MAX_REGIONS, "packed partial kernel: ", count, " regions; accepted: 1 to ",
              MAX_REGIONS);
  TORCH_CHECK(extents.size() == tables.size() && per_split.size() == tables.size() &&
              n_splits.size() == tables.size() && first.size() == tables.size(),
              "packed partial kernel: one extent, split length, split count and first result per region");
  const int B = q.size(0), Hq = q.size(1), H = kc.size(1);
  Regions R{};
  int64_t splits = 0;
  for (int r = 0; r < count; ++r) {
    const at::Tensor& table = tables[r];
    const at::Tensor& extent = extents[r];
    TORCH_CHECK(table.scalar_type() == at::kLong && table.dim() == 2 && table.size(0) == B && table.is_contiguous() &&
                table.device() == q.device(), "packed partial kernel: region ", r,
                "'s table must be a contiguous int64 [", B, ", W] tensor on the query's device");
    TORCH_CHECK(extent.numel() == 0 || (extent.scalar_type() == at::kLong && extent.numel() == B &&
                extent.is_contiguous() && extent.device() == q.device()), "packed partial kernel: region ", r,
                "'s extent must be empty or a contiguous int64 [", B, "] tensor on the query's device");
    TORCH_CHECK(n_splits[r] >= 1 && per_split[r] >= 1 && first[r] >= 0 && first[r] + n_splits[r] <= total,
                "packed partial kernel: region ", r, " writes partial results ", first[r], " to ",
                first[r] + n_splits[r], " of ", total, " in splits of ", per_split[r], " tokens");
    R.table[r] = tables[r].data_ptr<int64_t>();
    R.extent[r] = extents[r].numel() > 0 ? extents[r].data_ptr<int64_t>() : nullptr;
    R.W[r] = tables[r].size(1), R.per_split[r] = per_split[r], R.n_splits[r] = n_splits[r], R.first[r] = first[r];
    splits += n_splits[r];
  }
  R.count = count;
  TORCH_CHECK(block_size >= 4 && (block_size & (block_size - 1)) == 0, "packed partial kernel: block size ",
              block_size, "; accepted: a power of two, at least 4");
  constexpr bool KIVI = Shape<F, D>::KIVI;
  TORCH_CHECK(!KIVI || (block_size % TILE == 0 && (head_rows > 0 || H == 1)),
              "packed partial kernel: KIVI pools need blocks of a multiple of ", int(TILE), " slots (got ", block_size,
              ") and head-major rows (a tile's value scales are one run of bytes)");
  int bs_shift = 0;
  while ((int64_t{1} << bs_shift) < block_size) ++bs_shift;
  TORCH_CHECK(splits <= 65535, "packed partial kernel: ", splits, " splits per (row, KV head); at most 65535");
  dim3 grid(B * H, splits);
  auto stream = at::cuda::getCurrentCUDAStream();
  packed_partial_kernel<F, D, T><<<grid, 32, 0, stream>>>(
      reinterpret_cast<const T*>(q.data_ptr()), part.data_ptr<float>(), lse.data_ptr<float>(),
      valid.data_ptr<uint8_t>(), kc.data_ptr<uint8_t>(), ks.data_ptr<uint8_t>(), INT ? nullptr : khs.data_ptr<float>(),
      vc.data_ptr<uint8_t>(), vs.data_ptr<uint8_t>(), INT ? nullptr : vhs.data_ptr<float>(),
      INT ? km.data_ptr<uint8_t>() : nullptr, INT ? vm.data_ptr<uint8_t>() : nullptr, R, H, Hq / H, bs_shift,
      (int)total, (float)qk_scale, (int)head_rows);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <int F, int D, typename T>
int64_t resident() {
  int n = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, packed_partial_kernel<F, D, T>, 32, 0));
  return n;
}

}  // namespace

// fmt: 0 NVFP4, 2 INT4 and 4 KIVI4 (head dims 64 and 128), 1 ternary, 3 INT2 and 5 KIVI2 (head dim 128: a
// thread's value eighth of 64 channels would be half a 2-bit code word); the INT formats in groups of 32 channels
// (KIVI: keys per channel over 32 tokens, [token groups, H, D], values per token over the head), with fp16 scales
// and minimums in km / vm, empty for the others, and no second-level scales, khs / vhs empty.
void packed_partial(at::Tensor q, at::Tensor part, at::Tensor lse, std::vector<at::Tensor> tables, at::Tensor valid,
                    at::Tensor kc, at::Tensor ks, at::Tensor khs, at::Tensor vc, at::Tensor vs, at::Tensor vhs,
                    at::Tensor km, at::Tensor vm, std::vector<at::Tensor> extents, int64_t block_size,
                    std::vector<int64_t> per_split, std::vector<int64_t> n_splits, std::vector<int64_t> first,
                    int64_t total, double qk_scale, int64_t fmt, int64_t head_rows) {
  const int64_t D = q.size(-1);
  const bool bf16 = q.scalar_type() == at::kBFloat16;
  TORCH_CHECK(((fmt == NVFP4 || fmt == INT4 || fmt == KIVI4) && (D == 64 || D == 128)) ||
              ((fmt == TERNARY || fmt == INT2 || fmt == KIVI2) && D == 128),
              "packed partial kernel: format ", fmt, " at head dim ", D, " not compiled; accepted: nvfp4 (0), "
              "int4 (2) and kivi4 (4) at 64 and 128, ternary (1), int2 (3) and kivi2 (5) at 128");
#define KVC_LAUNCH(FMT, DIM) \
  if (bf16) launch<FMT, DIM, __nv_bfloat16>(q, part, lse, tables, valid, kc, ks, khs, vc, vs, vhs, km, vm, extents, \
                                            block_size, per_split, n_splits, first, total, qk_scale, head_rows); \
  else launch<FMT, DIM, __half>(q, part, lse, tables, valid, kc, ks, khs, vc, vs, vhs, km, vm, extents, block_size, \
                                per_split, n_splits, first, total, qk_scale, head_rows)
  if (fmt == KIVI4 && D == 128) { KVC_LAUNCH(KIVI4, 128); return; }
  if (fmt == KIVI4) { KVC_LAUNCH(KIVI4, 64); return; }
  if (fmt == KIVI2) { KVC_LAUNCH(KIVI2, 128); return; }
  if (fmt == TERNARY) { KVC_LAUNCH(TERNARY, 128); }
  else if (fmt == INT4 && D == 128) { KVC_LAUNCH(INT4, 128); }
  else if (fmt == INT4) { KVC_LAUNCH(INT4, 64); }
  else if (fmt == INT2) { KVC_LAUNCH(INT2, 128); }
  else if (D == 128) { KVC_LAUNCH(NVFP4, 128); }
  else { KVC_LAUNCH(NVFP4, 64); }
#undef KVC_LAUNCH
}

int64_t packed_resident(int64_t D, bool bf16, int64_t fmt) {
#define KVC_RESIDENT(FMT, DIM) (bf16 ? resident<FMT, DIM, __nv_bfloat16>() : resident<FMT, DIM, __half>())
  if (fmt == KIVI4) return D == 128 ? KVC_RESIDENT(KIVI4, 128) : KVC_RESIDENT(KIVI4, 64);
  if (fmt == KIVI2) return KVC_RESIDENT(KIVI2, 128);
  if (fmt == TERNARY) return KVC_RESIDENT(TERNARY, 128);
  if (fmt == INT4) return D == 128 ? KVC_RESIDENT(INT4, 128) : KVC_RESIDENT(INT4, 64);
  if (fmt == INT2) return KVC_RESIDENT(INT2, 128);
  if (D == 128) return KVC_RESIDENT(NVFP4, 128);
  return KVC_RESIDENT(NVFP4, 64);
#undef KVC_RESIDENT
}
