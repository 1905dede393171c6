// Finds two 16-token blocks with equal CPython tuple hashes (the old prefix-cache key), kept beside
// tests/test_torch_engine.py::COLLIDING_BLOCKS, which holds its output.
//
//   gcc -O3 -march=native -o /tmp/collide tests/tuple_hash_collision.c && /tmp/collide
//
// f(x) = tuplehash(11 fixed tokens + five tokens cut from the bits of x) is a map on 64-bit values;
// van Oorschot-Wiener's distinguished-point search finds f(x) == f(y), x != y, in about 2^32.5
// evaluations (a few minutes on one core). The tokens are x's bits 0-14, 15-29, 30-44, 45-59, 60-63.
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#define P1 11400714785074694791ULL
#define P2 14029467366897019727ULL
#define P5 2870177450012600261ULL
#define ROTL(x) (((x) << 31) | ((x) >> 33))
#define DPBITS 24
#define W 4
static const uint64_t FIXED[11] = {504, 3431, 282, 253, 1790, 288, 260, 4637, 30, 378, 3138};
static uint64_t BASE;
static inline uint64_t lane(uint64_t acc, uint64_t v) { acc += v * P2; acc = ROTL(acc); return acc * P1; }
static inline uint64_t f(uint64_t x) {
  uint64_t acc = BASE;
  acc = lane(acc, x & 0x7FFF); acc = lane(acc, (x >> 15) & 0x7FFF); acc = lane(acc, (x >> 30) & 0x7FFF);
  acc = lane(acc, (x >> 45) & 0x7FFF); acc = lane(acc, x >> 60);
  return acc + (16ULL ^ (P5 ^ 3527539ULL));
}
#define TBL (1 << 20)
typedef struct { uint64_t dp, start, len; } Ent;
static Ent tbl[TBL];
static uint64_t rng = 88172645463325252ULL;
static uint64_t next_rand(void) { rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17; return rng; }
static int resolve(uint64_t a, uint64_t la, uint64_t b, uint64_t lb) {
  while (la > lb) { a = f(a); la--; }
  while (lb > la) { b = f(b); lb--; }
  if (a == b) return 0;
  while (la--) {
    uint64_t fa = f(a), fb = f(b);
    if (fa == fb) { printf("%llu %llu\n", (unsigned long long)a, (unsigned long long)b); return 1; }
    a = fa; b = fb;
  }
  return 0;
}
int main(void) {
  uint64_t acc = P5;
  for (int i = 0; i < 11; i++) acc = lane(acc, FIXED[i]);
  BASE = acc;
  uint64_t x[W], s[W], n[W], evals = 0;
  for (int i = 0; i < W; i++) { s[i] = x[i] = next_rand(); n[i] = 0; }
  for (;;) {
    for (int i = 0; i < W; i++) { x[i] = f(x[i]); n[i]++; }
    evals += W;
    for (int i = 0; i < W; i++) {
      if ((x[i] & ((1ULL << DPBITS) - 1)) == 0 || n[i] > (1ULL << (DPBITS + 3))) {
        if (n[i] <= (1ULL << (DPBITS + 3))) {
          uint64_t h = (x[i] >> DPBITS) & (TBL - 1);
          while (tbl[h].len && tbl[h].dp != x[i]) h = (h + 1) & (TBL - 1);
          if (tbl[h].len) {
            if (resolve(tbl[h].start, tbl[h].len, s[i], n[i])) { fprintf(stderr, "evals %llu\n", (unsigned long long)evals); return 0; }
          } else { tbl[h].dp = x[i]; tbl[h].start = s[i]; tbl[h].len = n[i]; }
        }
        s[i] = x[i] = next_rand(); n[i] = 0;
      }
    }
  }
}
