/* suggest: "did you mean" for a mistyped command or flag. The candidates of
 * a flag are read from the command's own usage text (every "--name" in it),
 * so the suggestion can never name a flag the help does not show. */
#ifndef SHOAL_SUGGEST_H
#define SHOAL_SUGGEST_H

#include <stdio.h>

/* The candidate closest to word (optimal string alignment distance, at most
 * 2, or a quarter of word's length for long words; ties: the first), or
 * NULL when none is close. */
const char *shoal_suggest(const char *word, const char *const *cands, int n);
/* The "--flag" of the text usage(f) prints closest to word, or NULL; the
 * result lives in static storage until the next call (command lines only). */
const char *shoal_suggest_flag(const char *word, void (*usage)(FILE *f));
/* "shoal CMD: unknown option 'WORD'; did you mean --X? (shoal CMD --help lists
 * them)" on stderr, without the suggestion when none is close. */
void shoal_suggest_unknown_flag(const char *cmd, const char *word, void (*usage)(FILE *f));

#endif
