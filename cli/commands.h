/* The subcommand table. Add one line per command; the function
 * int shoal_cmd_NAME(int argc, char **argv) is defined in its module
 * (argv[0] is the command name). */
#ifndef SHOAL_COMMANDS_H
#define SHOAL_COMMANDS_H

#include "cli/version.h"

#define SHOAL_COMMANDS(X)                                                   \
    X(version, "print the version and the kernel ISA")                     \
    X(inspect, "check a K3 config / model directory: schedule, inventory, bytes") \
    X(run, "run a prompt through the model in this process")               \
    X(bench, "benchmarks: 'bench kernels [--threads N] [--json]'")         \
    X(plan, "place the routed experts on a cluster: plan.json (docs/CLUSTER.md)") \
    X(doctor, "measure a cluster's hosts and links for plan --measured (docs/CLUSTER.md)") \
    X(pack, "write one worker's experts of a plan into a pack directory (docs/DEPLOY.md)") \
    X(pull, "download one worker's pack straight from a Hugging Face-style hub (docs/DEPLOY.md)") \
    X(keygen, "make a CURVE key pair for authenticated, encrypted links (docs/DEPLOY.md)") \
    X(trace, "routing traces: 'trace stats FILE [--plan plan.json]'")      \
    X(tokenize, "print the token ids of a text (K3 tokenizer)")            \
    X(detokenize, "print the text of token ids (K3 tokenizer)")            \
    X(expert, "serve a shard of the routed experts to coordinators (ZeroMQ)") \
    X(top, "live per-shard view of a running coordinator (--once: text)")  \
    X(serve, "serve the OpenAI-compatible HTTP API (docs/API.md)")

#define SHOAL_CMD_DECL(name, help) int shoal_cmd_##name(int argc, char **argv);
SHOAL_COMMANDS(SHOAL_CMD_DECL)
#undef SHOAL_CMD_DECL

/* 0, or 2 after one message naming the kernels' variables (cli/version.c) */
int shoal_cli_kernels_check(const char *cmd);

#endif
