/* cmd: the coordinator's commands -- the front ends that wire the rooms
 * together: `shoal run` (run.c), `serve` (serve.c), `inspect`, `plan`
 * (plan_cmd.c over the planner, plan.h), `pack`, `top`, `trace` (trace_cmd.c,
 * replay.c), `tokenize` / `detokenize` (tokenize.c). Each command's entry
 * point, int shoal_cmd_NAME(int argc, char **argv), is declared in
 * cli/commands.h; the planner and the trace replay are also libraries, for
 * tests and fuzzers.
 * May use: every room and layer. Nothing includes this room but cli/ and
 * tests: the commands sit at the top. */
#ifndef SHOAL_CMD_H
#define SHOAL_CMD_H

#include "cli/commands.h"
#include "coordinator/cmd/plan.h"
#include "coordinator/cmd/replay.h"

#endif
