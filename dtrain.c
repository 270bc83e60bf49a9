/* dtrain.c -- the one C file that holds dtrain.h's implementation (USE, at
   the top of dtrain.h). The Makefile compiles it once per configuration
   (build/dtrain.o; with the test hooks build/test/dtrain.o; under each
   sanitizer build/asan/, build/msan/) and links it to every program, which
   it compiles with -DDTRAIN_IMPLEMENTATION_ELSEWHERE. */
#define DTRAIN_IMPLEMENTATION
#include "dtrain.h"
