/* CRC-32C (Castagnoli) as the crc32c package computes it: crc32c_update(value, p, n) equals
 * crc32c.crc32c(p[:n], value=value). With SSE4.2 (checked at run time) eight bytes a step, in
 * three streams at once over a buffer long enough to cut in three; else a table, a byte a step.
 *
 * Three streams: the crc32 instruction takes three cycles before its result can be used, but a
 * new one can start every cycle, so one chain of them over a buffer runs at a third of what the
 * processor can do. Cut into three parts A, B, C of equal length L, the parts are checksummed
 * side by side (A from the running crc, B and C from zero) and joined: the crc register is linear
 * over GF(2), so crc(A B) = shift_L(crc(A)) ^ crc0(B), where shift_L advances a register over L
 * zero bytes. shift_L is four table lookups, the tables made at init from shift_L of each of the
 * 32 one-bit registers. Two part lengths: long for big buffers, short for records of a few
 * hundred bytes; what is left after the last whole block goes through the single chain. */
#ifndef DELAYSERVER_CRC32C_H
#define DELAYSERVER_CRC32C_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

static uint32_t crc32c_table[256];
static int crc32c_hw = -1;

/* The part lengths of the three-stream blocks (multiples of 8), and shift_L's tables for each. */
#define CRC32C_LONG 2048
#define CRC32C_SHORT 96
static uint32_t crc32c_long_shift[4][256];
static uint32_t crc32c_short_shift[4][256];

static uint32_t crc32c_zeros(uint32_t c, size_t n)
{
    while (n--)
        c = crc32c_table[c & 0xFF] ^ (c >> 8);
    return c;
}

static void crc32c_shift_table(uint32_t table[4][256], size_t n)
{
    uint32_t basis[32];
    for (int i = 0; i < 32; i++)
        basis[i] = crc32c_zeros((uint32_t)1 << i, n);
    for (int k = 0; k < 4; k++)
        for (int b = 0; b < 256; b++) {
            uint32_t x = 0;
            for (int i = 0; i < 8; i++)
                if (b >> i & 1)
                    x ^= basis[8 * k + i];
            table[k][b] = x;
        }
}

static inline uint32_t crc32c_shift(uint32_t table[4][256], uint32_t c)
{
    return table[0][c & 0xFF] ^ table[1][(c >> 8) & 0xFF] ^ table[2][(c >> 16) & 0xFF] ^ table[3][c >> 24];
}

static void crc32c_init(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        crc32c_table[i] = c;
    }
    crc32c_shift_table(crc32c_long_shift, CRC32C_LONG);
    crc32c_shift_table(crc32c_short_shift, CRC32C_SHORT);
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    crc32c_hw = __builtin_cpu_supports("sse4.2") ? 1 : 0;
#else
    crc32c_hw = 0;
#endif
}

static uint32_t crc32c_soft(uint32_t c, const uint8_t *p, size_t n)
{
    while (n--)
        c = crc32c_table[(c ^ *p++) & 0xFF] ^ (c >> 8);
    return c;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
__attribute__((target("sse4.2")))
static uint32_t crc32c_sse42(uint32_t c, const uint8_t *p, size_t n)
{
    uint64_t c64 = c;
    while (n >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        c64 = __builtin_ia32_crc32di(c64, v);
        p += 8;
        n -= 8;
    }
    c = (uint32_t)c64;
    while (n--)
        c = __builtin_ia32_crc32qi(c, *p++);
    return c;
}

/* Blocks of three parts of `len` bytes while they fit, each joined with `table` (shift_len). */
__attribute__((target("sse4.2")))
static inline uint32_t crc32c_sse42_blocks(uint32_t c, const uint8_t **pp, size_t *np, size_t len,
                                           uint32_t table[4][256])
{
    const uint8_t *p = *pp;
    size_t n = *np;
    while (n >= 3 * len) {
        uint64_t a = c, b = 0, d = 0, x, y, z;
        for (size_t i = 0; i < len; i += 8) {
            memcpy(&x, p + i, 8);
            memcpy(&y, p + len + i, 8);
            memcpy(&z, p + 2 * len + i, 8);
            a = __builtin_ia32_crc32di(a, x);
            b = __builtin_ia32_crc32di(b, y);
            d = __builtin_ia32_crc32di(d, z);
        }
        c = crc32c_shift(table, crc32c_shift(table, (uint32_t)a) ^ (uint32_t)b) ^ (uint32_t)d;
        p += 3 * len;
        n -= 3 * len;
    }
    *pp = p;
    *np = n;
    return c;
}

__attribute__((target("sse4.2")))
static uint32_t crc32c_sse42_three(uint32_t c, const uint8_t *p, size_t n)
{
    c = crc32c_sse42_blocks(c, &p, &n, CRC32C_LONG, crc32c_long_shift);
    c = crc32c_sse42_blocks(c, &p, &n, CRC32C_SHORT, crc32c_short_shift);
    return crc32c_sse42(c, p, n);
}
#endif

static uint32_t crc32c_update(uint32_t value, const uint8_t *p, size_t n)
{
    uint32_t c = ~value;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    if (crc32c_hw == 1)
        return ~crc32c_sse42_three(c, p, n);
#endif
    return ~crc32c_soft(c, p, n);
}

/* The crc computed one way (0: three streams, 1: one chain, 2: the table), for the tests and
 * the benchmark; 0 for a way this processor cannot run (the first two without SSE4.2). */
static uint32_t crc32c_way(int way, uint32_t value, const uint8_t *p, size_t n)
{
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    if (crc32c_hw == 1 && way == 0)
        return ~crc32c_sse42_three(~value, p, n);
    if (crc32c_hw == 1 && way == 1)
        return ~crc32c_sse42(~value, p, n);
#endif
    return way == 2 ? ~crc32c_soft(~value, p, n) : 0;
}

#endif
