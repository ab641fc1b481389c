#include <stdio.h>

#include "cli/commands.h"

int shoal_cmd_version(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    printf("shoal %s\n", SHOAL_VERSION);
    return 0;
}
