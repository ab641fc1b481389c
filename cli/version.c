#include <stdio.h>
#include <string.h>

#include "cli/commands.h"
#include "cli/omp_wait.h"
#include "common/err.h"
#include "kernels/kernels.h"

/* Prints the version and the kernel variant this machine would use (CPUID, or
 * the SHOAL_ISA override): the ISA decides nothing about the results (every
 * matrix kernel is bit-identical across variants), only the speed. */
/* the kernels' environment (SHOAL_ISA, SHOAL_MX_DECODE, SHOAL_MU_FOLD, SHOAL_AMX_VARIANT),
 * checked once before a command that computes: a bad value is a usage
 * mistake (exit 2) named the same way by every command */
int shoal_cli_kernels_check(const char *cmd)
{
    int rc = shoal_kernels_init();
    if (rc >= 0)
        return 0;
    fprintf(stderr, "shoal %s: kernels: %s (SHOAL_ISA asks for a variant this CPU lacks, or SHOAL_ISA / "
                    "SHOAL_MX_DECODE / SHOAL_MU_FOLD / SHOAL_AMX_VARIANT names an unknown one)\n", cmd, shoal_strerror(rc));
    return 2;
}

int shoal_cmd_version(int argc, char **argv)
{
    /* no arguments: anything given is a usage mistake (exit 2), not ignored */
    if (argc > 1) {
        if (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
            printf("usage: shoal version\nPrints the version, the kernel variant and the OpenMP wait policy.\n");
            return argc == 2 ? 0 : 2;
        }
        fprintf(stderr, "shoal version: unexpected argument '%s' (usage: shoal version)\n", argv[1]);
        return 2;
    }
    printf("shoal %s\n", SHOAL_VERSION);
    if (shoal_cli_kernels_check("version"))
        return 2;
    printf("kernels %s\n", shoal_isa_name(shoal_kernels_isa()));
    if (shoal_kernels_isa() == SHOAL_ISA_AVX512) /* the portable MXFP4 decode (SHOAL_MX_DECODE; same bits) */
        printf("mxfp4 decode %s\n", shoal_mx_decode_name(shoal_kernels_mx_decode()));
    /* the opt-in matrix-unit-order kernels (kernels/README.md): AMX only after its self-test */
    printf("mu-order kernels %s\n", shoal_kernels_mu_path());
    if (!shoal_kernels_mu_fold()) /* SHOAL_MU_FOLD=off: the mu MXFP4 table path everywhere (same bits) */
        printf("mu mxfp4 fold off\n");
    /* the numerics class a command runs without --numerics, and what --numerics mu computes with */
    printf("numerics %s (default; --numerics mu runs the matrix-unit order on %s)\n",
           shoal_numerics_name(shoal_kernels_numerics()), shoal_kernels_mu_engine());
    printf("openmp wait %s (%s)\n", shoal_omp_wait_policy(), shoal_omp_wait_origin());
    return 0;
}
