/* CRC-32C (Castagnoli) as the crc32c package computes it: crc32c_update(value, p, n) equals
 * crc32c.crc32c(p[:n], value=value). With SSE4.2 (checked at run time) eight bytes a step; else
 * a table, a byte a step. */
#ifndef DELAYSERVER_CRC32C_H
#define DELAYSERVER_CRC32C_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

static uint32_t crc32c_table[256];
static int crc32c_hw = -1;

static void crc32c_init(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        crc32c_table[i] = c;
    }
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
#endif

static uint32_t crc32c_update(uint32_t value, const uint8_t *p, size_t n)
{
    uint32_t c = ~value;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    if (crc32c_hw == 1)
        return ~crc32c_sse42(c, p, n);
#endif
    return ~crc32c_soft(c, p, n);
}

#endif
