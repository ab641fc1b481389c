/* `shoal keygen`: a CURVE key pair for a coordinator or a worker
 * (common/curve.h, docs/DEPLOY.md "Keys"). */
#include <stdio.h>
#include <string.h>

#include "cli/commands.h"
#include "common/curve.h"
#include "common/err.h"

static void usage(FILE *f)
{
    fprintf(f, "usage: shoal keygen -o PREFIX [--force]\n"
               "\n"
               "Make a ZeroMQ CURVE key pair: PREFIX.key (public and secret key, mode 0600: stays on\n"
               "the host that uses it) and PREFIX.pub (the public key, given to the peers). Prints the\n"
               "public key. A worker lists the coordinators it accepts (--curve-allow FILE of public\n"
               "keys); the coordinator pins each worker's public key (docs/DEPLOY.md).\n"
               "  --force   replace an existing PREFIX.key\n");
}

int shoal_cmd_keygen(int argc, char **argv)
{
    const char *prefix = NULL;
    int force = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-o") && i + 1 < argc)
            prefix = argv[++i];
        else if (!strcmp(argv[i], "--force"))
            force = 1;
        else if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            usage(stdout);
            return 0;
        } else {
            usage(stderr);
            return 2;
        }
    }
    if (!prefix) {
        usage(stderr);
        return 2;
    }
    shoal_curve_keypair kp;
    char err[4200];
    int rc;
    if ((rc = shoal_curve_keygen(&kp, err, sizeof err)) || (rc = shoal_curve_write(&kp, prefix, force, err, sizeof err))) {
        fprintf(stderr, "shoal keygen: %s\n", err);
        return shoal_err_exit_code(rc); /* 2: refusing to overwrite without --force; 4: could not write */
    }
    printf("%s\n", kp.pub);
    return 0;
}
