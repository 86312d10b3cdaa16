/* The library's own account of what it exports: kernels.h's declarations as text, one
 * line each ("int vlmd_rotary(float *x, int64_t row_stride, ...)"), and the instruction
 * set it was built for. The Python side (library.py) builds every ctypes signature from
 * these lines when it loads the library, so the binding cannot disagree with the build. */
#include "kernels.h"

#define VLMD_SIGNATURE(RETURN, NAME, PARAMETERS) #RETURN " " #NAME #PARAMETERS "\n"
const char vlmd_kernel_signatures[] = VLMD_KERNELS(VLMD_SIGNATURE);

#ifndef VLMD_VARIANT
#define VLMD_VARIANT "unnamed"
#endif
const char vlmd_kernel_variant[] = VLMD_VARIANT;
