/* ws_mem.h - freeing the buffers an object of the core owns (internal). */
#ifndef WS_MEM_H
#define WS_MEM_H

#include <stddef.h>
#include <stdlib.h>

/* free() on each of the n pointers of ptrs, in order (NULL ones are no-ops) */
static inline void ws_free_each(void *const *ptrs, size_t n) {
    for (size_t i = 0; i < n; i++) free(ptrs[i]);
}

/* WS_FREE_ALL(a, b, c) frees a, then b, then c: an object's free function names its
   buffers once, the object itself last */
#define WS_FREE_ALL(...)                                      \
    ws_free_each((void *const[]){__VA_ARGS__},                \
                 sizeof((void *const[]){__VA_ARGS__}) / sizeof(void *))

#endif
