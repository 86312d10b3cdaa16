/* The argument checks both prefill attention kernels make (paged_prefill.c, flash_bf16.c),
 * before they read a cache through a sequence's block table: 0, or -3 a size or stride, -6 a
 * block id outside the cache (the kernels' own codes). The head ratio and head size are each
 * kernel's to check first (-1, -2). */
#ifndef VLMD_PREFILL_CHECKS_H
#define VLMD_PREFILL_CHECKS_H

#include <stdint.h>

static inline int check_prefill_chunk(const int32_t *table, int num_table_blocks, int64_t num_slots, int block_size,
                                      int start, int n, int heads, int dim, int64_t q_stride, int64_t out_stride) {
    if (n <= 0 || start < 0 || block_size <= 0 || q_stride < (int64_t)heads * dim || out_stride < (int64_t)heads * dim)
        return -3;
    const int total = start + n;
    if ((int64_t)num_table_blocks * block_size < total) return -3;
    for (int i = 0; i < (total + block_size - 1) / block_size; i++)
        if (table[i] < 0 || ((int64_t)table[i] + 1) * block_size > num_slots) return -6;
    return 0;
}

#endif
