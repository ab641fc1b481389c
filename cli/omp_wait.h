/* The OpenMP wait policy of a shoal process (cli/omp_wait.c). */
#ifndef SHOAL_CLI_OMP_WAIT_H
#define SHOAL_CLI_OMP_WAIT_H

/* Called first in main(): unless OMP_WAIT_POLICY or GOMP_SPINCOUNT is set,
 * sets OMP_WAIT_POLICY=passive and re-executes this program (returns only
 * when no re-exec is needed or it failed). */
void shoal_omp_wait_apply(char **argv);
/* The policy in effect ("passive", "active", "GOMP_SPINCOUNT", "default")
 * and where it came from ("shoal's default", "from the environment", ...). */
const char *shoal_omp_wait_policy(void);
const char *shoal_omp_wait_origin(void);

#endif
