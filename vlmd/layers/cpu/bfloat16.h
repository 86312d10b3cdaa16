/* What the kernels share about bfloat16: torch's rounding of one value (decoder_step.c,
 * elementwise.c, paged_decode.c), whether AVX512-BF16 kernels may run here and the switch
 * each of them keeps (packed_linear.c: the batch products, paged_decode.c: the decode
 * scores, flash_bf16.c: prefill attention). Not bound from Python (kernels.h lists what is). */
#ifndef VLMD_BFLOAT16_H
#define VLMD_BFLOAT16_H

#include <stdint.h>
#include <string.h>

/* float32 -> bfloat16 bits, to nearest with ties to even, any NaN the quiet NaN 0x7fc0:
 * torch's rounding. */
static inline uint16_t bf16_from_float(float value) {
    uint32_t bits;
    memcpy(&bits, &value, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* 1 where this variant was built with AVX-512 (its AVX512-BF16 code exists) and the CPU
 * has the instruction, else 0. */
static inline int host_runs_avx512bf16(void) {
#ifdef __AVX512F__
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") != 0;
#else
    return 0;
#endif
}

/* A kernel's switch (*setting: -1 not yet decided, 0 off, 1 on): asked with wanted = -1
 * it answers the setting, the host deciding on first use; 0 or 1 sets it (1 only where
 * the host runs the instruction: a test or bench compares the two paths). Returns the
 * setting then in force. */
static inline int bf16_switch(int *setting, int wanted) {
    const int host_can = host_runs_avx512bf16();
    if (*setting < 0) *setting = host_can;
    if (wanted >= 0) *setting = wanted && host_can;
    return *setting;
}

#endif
