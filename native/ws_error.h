/* The error reporting of the core's objects: each keeps the message of its last
 * failure in `char last_error[N]`. */
#ifndef WS_ERROR_H
#define WS_ERROR_H

#include <stdarg.h>
#include <stdio.h>

#include "warmslot.h"

/* Defines `static ws_status NAME(const TYPE *obj, ws_status st, const char *fmt, ...)`,
 * which formats the message into obj->last_error and returns st (the object is
 * const for its callers: only its message changes). */
#define WS_DEFINE_FAIL(NAME, TYPE)                                                      \
    __attribute__((format(printf, 3, 4))) static ws_status NAME(const TYPE *cobj,       \
                                                                ws_status st,           \
                                                                const char *fmt, ...) { \
        TYPE *obj = (TYPE *)cobj;                                                       \
        va_list ap;                                                                     \
        va_start(ap, fmt);                                                              \
        vsnprintf(obj->last_error, sizeof obj->last_error, fmt, ap);                    \
        va_end(ap);                                                                     \
        return st;                                                                      \
    }

/* returns the status of `expr` from the calling function unless it is WS_OK */
#define TRY(expr)                     \
    do {                              \
        ws_status st_ = (expr);       \
        if (st_ != WS_OK) return st_; \
    } while (0)

#endif
