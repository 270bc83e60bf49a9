# dtrain -- `make` builds, `make run` trains stage 01, `make test` tests.
#
#   make              every stage, the tools and the tests
#   make run          train stage 01 on the synthetic set (made on first use)
#   make test         the test suite; ends with "N passed, N failed"
#   make test-asan    the same under AddressSanitizer + UndefinedBehaviorSanitizer
#   make bench        time the reference workloads (mlp, vit-tiny) at 1 and 2 threads
#   make diff         what each stage changes from the one before
#
# Knobs: CC, OPT (default -O3 -march=native), BLAS=0 (built-in matmul even when
# a system BLAS is found), STB=0 (no stb_image: PPM/PGM only), OPENMP=0.

CC       ?= cc
OPT      ?= -O3 -march=native
WARN     := -Wall -Wextra
CFLAGS   ?= $(OPT)
CFLAGS   += -std=c11 $(WARN)
LDLIBS   := -lm
SHELL    := /bin/bash

probe = $(shell printf 'int main(void){return 0;}\n' | $(CC) $(1) -x c - -o /dev/null $(2) >/dev/null 2>&1 && echo 1)

ifneq ($(OPENMP),0)
  ifeq ($(call probe,-fopenmp,),1)
    CFLAGS += -fopenmp
    LDLIBS += -fopenmp
  endif
endif

# stb_image from the system (Debian: libstb-dev); without it PPM/PGM only.
ifneq ($(STB),0)
  ifeq ($(shell test -f /usr/include/stb/stb_image.h && echo 1)$(call probe,,-lstb),11)
    CFLAGS += -DDT_HAVE_STB
    LDLIBS += -lstb
    HAVE_STB := 1
  endif
endif

# A system BLAS for the matmuls when there is one (OpenBLAS through pkg-config).
ifneq ($(BLAS),0)
  ifeq ($(shell pkg-config --exists openblas 2>/dev/null && echo 1),1)
    CFLAGS += -DDT_HAVE_CBLAS $(shell pkg-config --cflags openblas)
    LDLIBS += $(shell pkg-config --libs openblas)
  endif
endif

STAGES   := $(sort $(dir $(wildcard 0*/train.c)))
STAGE_BINS := $(addsuffix train,$(STAGES))
TOOLS    := tools/gen_synthetic
TEST_BIN := tests/test_dtrain

all: $(STAGE_BINS) $(TOOLS) $(TEST_BIN)

%/train: %/train.c dtrain.h
	$(CC) $(CFLAGS) -o $@ $< $(LDLIBS)

tools/%: tools/%.c dtrain.h
	$(CC) $(CFLAGS) -o $@ $< $(LDLIBS)

$(TEST_BIN): tests/test_dtrain.c dtrain.h
	$(CC) $(CFLAGS) -o $@ $< $(LDLIBS)

run: 01-single-gpu/train
	./01-single-gpu/train

test: $(STAGE_BINS) $(TEST_BIN)
	@echo "testing with: $(CC) $(CFLAGS)"
	./$(TEST_BIN) 01-single-gpu/train

# The sanitizers build into build/asan so the fast binaries stay as they are.
ASAN_FLAGS := -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=undefined
build/asan/%/train: %/train.c dtrain.h
	@mkdir -p $(dir $@)
	$(CC) $(filter-out -O3 -O2,$(CFLAGS)) $(ASAN_FLAGS) -o $@ $< $(LDLIBS)
build/asan/test_dtrain: tests/test_dtrain.c dtrain.h
	@mkdir -p $(dir $@)
	$(CC) $(filter-out -O3 -O2,$(CFLAGS)) $(ASAN_FLAGS) -o $@ $< $(LDLIBS)

test-asan: build/asan/01-single-gpu/train build/asan/test_dtrain
	ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1 \
	  ./build/asan/test_dtrain build/asan/01-single-gpu/train

bench: 01-single-gpu/train
	@for t in 1 2; do \
	  OMP_NUM_THREADS=$$t ./01-single-gpu/train --bench --model mlp; \
	  OMP_NUM_THREADS=$$t ./01-single-gpu/train --bench --model vit --dim 192 --depth 6 --heads 3 --patch 4 --batch-size 64; \
	done
	@py=$$(for p in python3 /usr/bin/python3; do $$p -c 'import torch' 2>/dev/null && echo $$p && break; done); \
	 if [ -n "$$py" ]; then \
	   [ -z "$$OPENBLAS_CORETYPE" ] || echo "(OPENBLAS_CORETYPE=$$OPENBLAS_CORETYPE limits PyTorch's OpenBLAS to that core type)"; \
	   $$py tools/bench_torch.py; \
	 else echo "(PyTorch not installed: no comparison; Debian: apt-get install python3-torch)"; fi

diff:
	@prev=""; for s in $(STAGES); do \
	  if [ -n "$$prev" ]; then echo "==== $$prev -> $$s"; diff -u $$prev/train.c $$s/train.c; fi; prev=$$s; \
	done; if [ -z "$$prev" ] || [ "$(words $(STAGES))" = 1 ]; then echo "(only one stage so far: nothing to compare)"; fi; true

clean:
	rm -rf $(STAGE_BINS) $(TOOLS) $(TEST_BIN) build

.PHONY: all run test test-asan bench diff clean
