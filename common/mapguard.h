/* mapguard: the SIGBUS safety net under mapped model files, shared by the
 * coordinator (engine/mapped.c, shoal_model_guard) and the expert worker
 * (worker/bank.c, shoal_bank_guard). A read of a page past the end of a file
 * that shrank under its mapping (or whose storage failed) raises SIGBUS; the
 * handler writes one line naming the file and the address to stderr and exits
 * with status 4, never a silent death by the signal. The size checks before
 * each read catch the ordinary case; this catches the race after them.
 * One guard per process (the handler is process-wide). */
#ifndef SHOAL_MAPGUARD_H
#define SHOAL_MAPGUARD_H

#include <stdint.h>

/* Names the mapped file holding addr, or NULL when none of owner's does. Runs
 * inside the signal handler: async-signal-safe code only (no malloc, no
 * locks, no stdio). */
typedef const char *(*shoal_mapguard_find_fn)(const void *owner, uintptr_t addr);

/* The line's words, all static strings:
 * "<who>: fatal: SIGBUS reading <path|unknown> at 0x<16 hex> (<why>); exiting with status 4" */
typedef struct {
    const char *who;     /* the process: "shoal", "shoal expert" */
    const char *unknown; /* named when find finds no file */
    const char *why;     /* the parenthesis after the address */
} shoal_mapguard_text;

/* Installs the handler for owner (find and text as above; text must outlive
 * the guard), or with owner NULL restores the default action. */
void shoal_mapguard_set(const void *owner, shoal_mapguard_find_fn find, const shoal_mapguard_text *text);

/* The owner of the installed guard, or NULL. */
const void *shoal_mapguard_owner(void);

#endif
