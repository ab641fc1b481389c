/* Intrinsics that SIMDe 0.7.4 (Debian 12) lacks, built from its 256-bit
 * ones; used only by test_kernels_avx512_emul.sh. All are exact lane-wise
 * conversions, so composing them from halves cannot change a result. */
#ifndef KERNELS_AVX512_EMUL_SHIM_H
#define KERNELS_AVX512_EMUL_SHIM_H
static inline simde__m512 shim_mm512_cvtepi32_ps(simde__m512i a)
{
    simde__m256 lo = simde_mm256_cvtepi32_ps(simde_mm512_castsi512_si256(a));
    simde__m256 hi = simde_mm256_cvtepi32_ps(simde_mm512_extracti64x4_epi64(a, 1));
    return simde_mm512_castpd_ps(
        simde_mm512_insertf64x4(simde_mm512_castpd256_pd512(simde_mm256_castps_pd(lo)), simde_mm256_castps_pd(hi), 1));
}
static inline simde__m512i shim_mm512_cvtepu16_epi32(simde__m256i a)
{
    simde__m256i lo = simde_mm256_cvtepu16_epi32(simde_mm256_castsi256_si128(a));
    simde__m256i hi = simde_mm256_cvtepu16_epi32(simde_mm256_extracti128_si256(a, 1));
    return simde_mm512_inserti64x4(simde_mm512_castsi256_si512(lo), hi, 1);
}
static inline simde__m512i shim_mm512_cvtepu8_epi32(simde__m128i a)
{
    simde__m256i lo = simde_mm256_cvtepu8_epi32(a);
    simde__m256i hi = simde_mm256_cvtepu8_epi32(simde_mm_srli_si128(a, 8));
    return simde_mm512_inserti64x4(simde_mm512_castsi256_si512(lo), hi, 1);
}
#define simde_mm512_cvtepi32_ps shim_mm512_cvtepi32_ps
#define simde_mm512_cvtepu8_epi32 shim_mm512_cvtepu8_epi32
#define simde_mm512_cvtepu16_epi32 shim_mm512_cvtepu16_epi32
#endif
