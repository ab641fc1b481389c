/* shoal: one executable, subcommands dispatched from this table. Each
 * subcommand lives in its module (coordinator/ or worker/) as
 * int shoal_cmd_<name>(int argc, char **argv) and returns an exit code:
 * 0 ok, 2 usage error, 3 invalid model or config, 4 run failed part-way. */
#include <stdio.h>
#include <string.h>

#include "cli/commands.h"
#include "cli/omp_wait.h"
#include "common/log.h"
#include "common/suggest.h"

static const struct {
    const char *name;
    int (*fn)(int argc, char **argv);
    const char *help;
} commands[] = {
#define SHOAL_CMD(name, help) {#name, shoal_cmd_##name, help},
    SHOAL_COMMANDS(SHOAL_CMD)
#undef SHOAL_CMD
};

/* the commands that run the kernels */
static int computes(const char *cmd)
{
    return !strcmp(cmd, "run") || !strcmp(cmd, "serve") || !strcmp(cmd, "expert") || !strcmp(cmd, "bench");
}

static int help_asked(int argc, char **argv)
{
    for (int i = 2; i < argc; i++)
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h"))
            return 1;
    return 0;
}

static void usage(FILE *f)
{
    fprintf(f, "usage: shoal COMMAND [ARGS...]   (shoal --version: the version)\n\ncommands:\n");
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
        fprintf(f, "  %-12s %s\n", commands[i].name, commands[i].help);
    fprintf(f, "\nRun 'shoal COMMAND --help' for a command's options.\n"
               "\nexit codes:\n"
               "  0  ok\n"
               "  2  usage mistake (a bad or conflicting flag or value, a key file named by a flag)\n"
               "  3  invalid model or config (also a manifest or plan, or a model, version or\n"
               "     ownership mismatch with the workers)\n"
               "  4  the run failed part-way or could not start (the reason is printed)\n"
               "(docs/CONFIG.md, \"Exit codes\")\n");
}

int main(int argc, char **argv)
{
    shoal_omp_wait_apply(argv); /* before any OpenMP region: may re-exec */
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    if (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        usage(stdout);
        return 0;
    }
    if (!strcmp(argv[1], "--version") || !strcmp(argv[1], "-V"))
        return shoal_cmd_version(argc - 1, argv + 1);
    const char *names[sizeof commands / sizeof commands[0]];
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++) {
        if (!strcmp(argv[1], commands[i].name)) {
            /* the commands that compute refuse a bad kernel variable alike, before anything starts */
            if (computes(argv[1]) && !help_asked(argc, argv) && shoal_cli_kernels_check(argv[1]))
                return 2;
            return commands[i].fn(argc - 1, argv + 1);
        }
        names[i] = commands[i].name;
    }
    const char *near = shoal_suggest(argv[1], names, (int)(sizeof names / sizeof names[0]));
    if (near) /* a typo: the suggestion, not the whole help */
        fprintf(stderr, "shoal: unknown command '%s'; did you mean '%s'? ('shoal --help' lists them)\n", argv[1],
                near);
    else {
        fprintf(stderr, "shoal: unknown command '%s'\n", argv[1]);
        usage(stderr);
    }
    return 2;
}
