/* exp for x <= 0 on a GCC vector type, Cephes-style (~1 ulp): shared by the kernels.
 *
 * VECTOR_EXP_NONPOSITIVE(name, vector type, int vector type of the same width) defines
 * `static inline vector name(vector x)`. Scores minus their running maximum are <= 0;
 * below -87 the result is clamped to exp(-87) (float32's smallest normal is ~exp(-87.3)).
 * build.py hashes this header with each kernel's source, so an edit here rebuilds them.
 */
#ifndef VLMD_VECTOR_EXP_H
#define VLMD_VECTOR_EXP_H

#define VECTOR_EXP_NONPOSITIVE(NAME, VF, VI)                                                 \
    static inline VF NAME(VF x) {                                                            \
        const VF floor_ = x * 0.0f - 87.0f;                                                  \
        VI low = x < floor_;                                                                 \
        x = (VF)(((VI)x & ~low) | ((VI)floor_ & low));                                       \
        const float magic = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */    \
        VF shifted = x * 1.44269504088896341f + magic;                                       \
        VF n = shifted - magic;                                                              \
        VF r = x - n * 0.693359375f + n * 2.12194440e-4f;                                    \
        VF p = r * 1.9875691500e-4f + 1.3981999507e-3f;                                      \
        p = p * r + 8.3334519073e-3f;                                                        \
        p = p * r + 4.1665795894e-2f;                                                        \
        p = p * r + 1.6666665459e-1f;                                                        \
        p = p * r + 5.0000001201e-1f;                                                        \
        VF y = p * r * r + r + 1.0f;                                                         \
        VI exponent = ((VI)shifted - 0x4B400000 + 127) << 23;                                \
        return y * (VF)exponent;                                                             \
    }

#endif
