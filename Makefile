# dtrain -- `make` builds, `make run` trains stage 01, `make test` tests.
#
#   make              every stage, the tools and the tests, on every core (-jN to choose)
#   make run          train stage 01 on the synthetic set (made on first use)
#   make test         the quick suite (within 3 minutes on 2 cores, build included);
#                     ends with "N passed, N failed, N skipped"; T=PART runs only the
#                     tests with PART in their name, of either suite (none: an error,
#                     exit 2); JOBS=N tests at once (default: one per core)
#   make test-all     the full suite: every test make test leaves out (CI runs both)
#   make test-list    the tests' names, each suite's (T=PART: those with PART in them)
#   make test-asan    the quick suite under AddressSanitizer + UndefinedBehaviorSanitizer
#                     (SUITE=full or all for the rest; T=PART too)
#   make test-msan    the same under MemorySanitizer (clang): reads of uninitialised memory
#   make fuzz         every loader under libFuzzer (clang, ASan, UBSan), FUZZ_SECONDS
#                     each (default 60): runs, coverage, and what was found
#   make test-builds  make CUDA=0 at -O0, -O2 and -O3 (LEVELS=...), each in build/cpu-O*/:
#                     the build without a warning at each, the quick suite at -O0 and -O2
#                     (SUITE_LEVELS=...; make test runs it at -O3); at -O2
#                     every stage's --bench, make bench --quick --only mlp
#   make bench        the scaling study (tools/bench): mlp and vit-tiny in stages 01-07,
#                     gpt at context 512 in 01, 03 and 08, at 1, 2 and 4 ranks -- speedup and efficiency measured and predicted by
#                     the cost model, compute and communication time, memory -- written to
#                     bench/results.csv, bench/scaling.svg, bench/memory.svg; on a GPU
#                     first vit-tiny and vit-base against PyTorch; BENCH_FLAGS=--quick
#                     for fewer timed steps
#   make diff         what each stage changes from the one before, and how many lines
#                     (the target: at most 40 between neighbours); after each diff, the
#                     functions and types of dtrain.h its added lines use, with the
#                     chapter lines (src/) that declare and define them (tools/read_next.awk)
#   make gpu-check    on a machine with an NVIDIA GPU: tier 1, what a GPU window must
#                     learn first, in at most 6 minutes on one H100 (GPU_CHECK_TIER=2:
#                     the rest, about 20), a report in GPU_CHECK_OUT (default
#                     gpu-check/); without a GPU it says so and exits 0
#   make print-nccl   which NCCL the build found (or why none)
#
# dtrain.h is written from its chapters in src/ (tools/assemble) when one of them
# changes: edit the chapters, not dtrain.h.
#
# Knobs: CC, OPT (default -O3 -march=native -mprefer-vector-width=512), BLAS=0
# (built-in matmul even when a system BLAS is found), STB=0 (no stb_image: PPM/PGM only), OPENMP=0,
# CUDA=0 (CPU only even when nvcc is found), NVCC, CUDA_ARCH, NCCL_HOME=DIR
# (NCCL's include/ and lib/ there), NCCL=0 (no NCCL: one GPU per job), MPI=0
# (no --comm mpi even when mpicc is found), MPICC, CURL=0 (no libcurl: --mlflow
# takes a folder only).

CC       ?= cc
# -mprefer-vector-width=512: gcc's tuning for Intel's AVX-512 processors
# vectorises loops 8 floats wide unless told otherwise; the element-wise ops
# (GELU and its derivative, the norms, softmax, AdamW) then ran at half the
# width the matmul uses. Same bits (no loop here sums in an order the width
# changes); vit-tiny's step 715 -> 689 ms at one thread on a Xeon with
# AVX-512 (median of 3 alternating runs). Without AVX-512 it changes
# nothing; a compiler that does not know it (gcc off x86) is not given it
# (VECTOR_WIDTH, below).
OPT      ?= -O3 -march=native $(VECTOR_WIDTH)
WARN     := -Wall -Wextra
CFLAGS   ?= $(OPT)
# -fno-math-errno: dtrain never reads errno after a math call, and with it set
# every sqrtf carries a branch to a library call (for errno), which keeps
# loops such as AdamW's from vectorising. -fno-trapping-math: dtrain never
# reads the floating-point exception flags, and with them kept, gcc does not
# turn a float choice (x < a ? a : x) into a vector blend on AVX2 without
# AVX-512, so exp, erf, tanh and the GELUs stayed scalar on such processors
# (most laptops). No result changes.
CFLAGS   += -std=c11 $(WARN) -fno-math-errno -fno-trapping-math
LDLIBS   := -lm
SHELL    := /bin/bash

probe = $(shell printf 'int main(void){return 0;}\n' | $(CC) $(1) -x c - -o /dev/null $(2) >/dev/null 2>&1 && echo 1)
VECTOR_WIDTH := $(if $(call probe,-mprefer-vector-width=512,),-mprefer-vector-width=512)

ifneq ($(OPENMP),0)
  ifeq ($(call probe,-fopenmp,),1)
    CFLAGS += -fopenmp
    LDLIBS += -fopenmp
  endif
endif

# MPI for --comm mpi (ranks on several CPU machines): Open MPI's compiler
# wrapper says where mpi.h and libmpi are (Debian: libopenmpi-dev); MPICH's
# through pkg-config. MPI=0 leaves it out; MPICC=... picks another wrapper.
ifneq ($(MPI),0)
  MPICC ?= mpicc
  MPI_CFLAGS := $(shell $(MPICC) --showme:compile 2>/dev/null || pkg-config --cflags mpich 2>/dev/null)
  MPI_LIBS   := $(shell $(MPICC) --showme:link 2>/dev/null || pkg-config --libs mpich 2>/dev/null)
  ifeq ($(call probe,$(MPI_CFLAGS) -include mpi.h,$(MPI_LIBS)),1)
    CFLAGS += -DDT_HAVE_MPI $(MPI_CFLAGS)
    LDLIBS += $(MPI_LIBS)
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

# libcurl for --mlflow http://HOST:PORT (MLflow's tracking server), through
# pkg-config (Debian: libcurl4-openssl-dev); without it --mlflow takes a folder
# only. CURL=0 leaves it out.
ifneq ($(CURL),0)
  ifeq ($(shell pkg-config --exists libcurl 2>/dev/null && echo 1),1)
    CFLAGS += -DDT_HAVE_CURL $(shell pkg-config --cflags libcurl)
    LDLIBS += $(shell pkg-config --libs libcurl)
  endif
endif

# A system BLAS for the matmuls when there is one (OpenBLAS through pkg-config).
ifneq ($(BLAS),0)
  ifeq ($(shell pkg-config --exists openblas 2>/dev/null && echo 1),1)
    CFLAGS += -DDT_HAVE_CBLAS $(shell pkg-config --cflags openblas)
    LDLIBS += $(shell pkg-config --libs openblas)
  endif
endif

# CUDA when nvcc is found: the CUDA section of dtrain.h is compiled once by nvcc
# into build/dtrain_cuda.o and linked into every program, which still runs on
# the CPU (--device cpu, or auto on a machine with no GPU).
NVCC     ?= $(or $(shell command -v nvcc 2>/dev/null),$(wildcard /usr/local/cuda/bin/nvcc))
# SASS for Turing (T4), Ampere (A100, RTX 30xx, also runs on 40xx) and Hopper,
# plus PTX that newer GPUs compile when the program starts.
CUDA_ARCH ?= -gencode arch=compute_75,code=sm_75 -gencode arch=compute_80,code=sm_80 \
             -gencode arch=compute_90,code=[sm_90,compute_90]
# --fmad=false: nvcc would fuse a * b + c into one rounding where gcc (with
# -std=c11) rounds twice, so the DT_HD arithmetic the CPU and the GPU share
# (casts, AdamW, SGD, sums) gives the same bits on both; the kernels it
# touches are memory-bound, and cuBLAS is not affected.
NVCCFLAGS ?= -O3 $(CUDA_ARCH) --fmad=false -Xcompiler -Wall,-Wextra
ifneq ($(CUDA),0)
  ifneq ($(NVCC),)
    CUDA_HOME := $(patsubst %/bin/nvcc,%,$(realpath $(NVCC)))
    CUDA_OBJ  := build/dtrain_cuda.o
    CFLAGS    += -DDT_HAVE_CUDA
    LDLIBS    += -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64
  endif
endif

# NCCL, found once for both compilers: in NCCL_HOME when it is given, else the
# first of NCCL_CANDIDATES -- the CUDA toolkit, /usr, and the Python wheel
# nvidia-nccl-cu13 (site-packages/nvidia/nccl, which ships libnccl.so.2 only)
# -- that has include/nccl.h and a libnccl.so or libnccl.so.2. The -I, -L and
# -rpath then all point at the same place.
ifneq ($(CUDA_OBJ),)
ifneq ($(NCCL),0)
  nccl_lib_in = $(firstword $(wildcard $(addprefix $(1)/,lib64/libnccl.so lib/libnccl.so lib/*/libnccl.so \
                  lib64/libnccl.so.2 lib/libnccl.so.2 lib/*/libnccl.so.2)))
  nccl_found_in = $(if $(and $(wildcard $(1)/include/nccl.h),$(call nccl_lib_in,$(1))),$(1))
  NCCL_WHEEL = $(shell python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null)
  NCCL_CANDIDATES ?= $(CUDA_HOME) /usr $(NCCL_WHEEL)
  ifneq ($(NCCL_HOME),)
    NCCL_DIR := $(call nccl_found_in,$(NCCL_HOME))
    ifeq ($(NCCL_DIR),)
      $(error NCCL_HOME=$(NCCL_HOME): no include/nccl.h with a lib/libnccl.so (or .so.2) there)
    endif
  else
    NCCL_DIR := $(firstword $(foreach d,$(NCCL_CANDIDATES),$(call nccl_found_in,$(d))))
  endif
  ifneq ($(NCCL_DIR),)
    NCCL_SO     := $(call nccl_lib_in,$(NCCL_DIR))
    NCCL_CFLAGS := -DDT_HAVE_NCCL -I$(NCCL_DIR)/include
    NCCL_LIB_DIR := $(patsubst %/,%,$(dir $(NCCL_SO)))
    NCCL_LIBS   := -L$(NCCL_LIB_DIR) -Wl,-rpath,$(NCCL_LIB_DIR) \
                   $(if $(filter %.so,$(NCCL_SO)),-lnccl,-l:libnccl.so.2)
  endif
endif
endif
ifneq ($(CUDA_OBJ),)
  LDLIBS += $(NCCL_LIBS) -lcudart -ldl -lstdc++   # cuBLAS: dlopen'd on a GPU's first use (dtrain.h's CUDA chapter)
endif

STAGES   := $(sort $(dir $(wildcard 0*/train.c)))
STAGE_BINS := $(addsuffix train,$(STAGES))
TOOLS    := tools/gen_synthetic tools/collectives tools/consolidate tools/merge-lora tools/bench tools/trace-summary tools/plot \
            tools/roofline
PROGRAMS := $(STAGE_BINS) $(TOOLS)
TEST_BIN := tests/test_dtrain

# Every core, unless make is given -j: the builds below are many small jobs.
# Not in a make that another make started (make test-builds): that one shares
# its parent's jobs.
NPROC    := $(shell nproc 2>/dev/null || getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1)
ifeq ($(MAKELEVEL),0)
  MAKEFLAGS += -j$(NPROC)
endif

all: $(PROGRAMS) $(TEST_BIN)

# dtrain.h is assembled from its chapters, src/NN-name.h (tools/assemble): edit a
# chapter and make writes dtrain.h again before it builds; an edit made in
# dtrain.h itself is never overwritten (the tool stops and names the chapter
# to move it into). A copy of the project without src/ builds dtrain.h as it is.
CHAPTERS := $(wildcard src/[0-9][0-9]-*.h)
ifneq ($(CHAPTERS),)
dtrain.h: $(CHAPTERS) tools/assemble
	@tools/assemble --write
endif

# dtrain.h's implementation (dtrain.c) is compiled once per configuration -- here
# build/dtrain.o; with the test hooks build/test/dtrain.o; under each
# sanitizer build/asan/ and build/msan/ -- and every program is its own short
# file compiled with -DDTRAIN_IMPLEMENTATION_ELSEWHERE (its #define
# DTRAIN_IMPLEMENTATION then asks for the declarations only) and linked to
# it. A stage still builds alone: cc -O2 01-single-gpu/train.c -lm.
ELSEWHERE := -DDTRAIN_IMPLEMENTATION_ELSEWHERE
build/obj/%.o: %.c dtrain.h
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(ELSEWHERE) -c -o $@ $<
build/dtrain.o: dtrain.c dtrain.h
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -c -o $@ dtrain.c
$(PROGRAMS): %: build/obj/%.o build/dtrain.o $(CUDA_OBJ)
	$(CC) $(CFLAGS) -o $@ $^ $(LDLIBS)
# tools/roofline opens OpenBLAS at run time (dlopen: libdl before glibc 2.34)
%roofline: LDLIBS += -ldl

# The test suite: a file per chapter of dtrain.h, tests/NN-name.c, every one
# that is there (tests/helpers.h: how they make one program). Its tests reach
# into the implementation (dt__ names, which are static), so they and the
# header whole are one translation unit, as a program that copies the header
# is: build/tests/suite.c includes tests/helpers.c, each tests/[0-9][0-9]-*.c
# in the order of their names, then tests/main.c. It is written again only
# when that list changes (a file added or removed), so that then, and only
# then, the suite is compiled again. The runner, tests/runner.c, is compiled
# on its own.
TEST_FILES := $(sort $(wildcard tests/[0-9][0-9]-*.c))
TEST_UNIT  := tests/helpers.c $(TEST_FILES) tests/main.c
TEST_DEPS  := build/tests/suite.c $(TEST_UNIT) tests/helpers.h tests/runner.h dtrain.h
build/tests/suite.c: FORCE
	@mkdir -p $(dir $@)
	@{ echo '/* written by make (the Makefile: TEST_UNIT): the test suite, one translation unit */'; \
	   $(foreach f,$(TEST_UNIT),echo '#include "$(f)"';) } > $@.new
	@if cmp -s $@.new $@; then rm -f $@.new; else mv -f $@.new $@; fi
build/tests/suite.o: $(TEST_DEPS)
	$(CC) $(CFLAGS) -iquote . -c -o $@ $<
build/tests/runner.o: tests/runner.c tests/runner.h
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -c -o $@ $<
$(TEST_BIN): build/tests/suite.o build/tests/runner.o $(CUDA_OBJ)
	$(CC) $(CFLAGS) -o $@ $^ $(LDLIBS)
FORCE:

# The object is rebuilt when its flags change (another NCCL_HOME, NCCL=0, ...).
CUDA_FLAGS := $(NVCC) $(NVCCFLAGS) $(NCCL_CFLAGS)
ifneq ($(CUDA_OBJ),)
  $(shell mkdir -p build; [ "$$(cat build/cuda.flags 2>/dev/null)" = '$(CUDA_FLAGS)' ] || echo '$(CUDA_FLAGS)' > build/cuda.flags)
endif
build/dtrain_cuda.o: dtrain.h build/cuda.flags
	@mkdir -p build
	$(NVCC) -x cu -DDTRAIN_CUDA_IMPLEMENTATION $(NVCCFLAGS) $(NCCL_CFLAGS) -c dtrain.h -o $@

print-nccl:
	@if [ -z "$(CUDA_OBJ)" ]; then echo "NCCL_FOUND=0 (a build without CUDA)"; \
	 elif [ "$(NCCL)" = 0 ]; then echo "NCCL_FOUND=0 (NCCL=0)"; \
	 elif [ -z "$(NCCL_DIR)" ]; then echo "NCCL_FOUND=0 (looked in: $(or $(NCCL_HOME),$(NCCL_CANDIDATES)))"; \
	 else echo "NCCL_FOUND=1"; echo "NCCL_INCLUDE=$(NCCL_DIR)/include"; echo "NCCL_LIB=$(NCCL_SO)"; \
	   echo "NCCL_LIBS=$(NCCL_LIBS)"; \
	   echo "NCCL_VERSION=$$(awk '/^#define NCCL_(MAJOR|MINOR|PATCH) /{v=v (v?".":"") $$3} END{print v}' $(NCCL_DIR)/include/nccl.h)"; fi

# Each tier builds what it runs (tier 1 only that, with every core).
gpu-check:
	GPU_CHECK_OUT="$(or $(GPU_CHECK_OUT),gpu-check)" GPU_CHECK_TIER="$(or $(GPU_CHECK_TIER),1)" tools/gpu_check.sh

run: 01-single-gpu/train
	./01-single-gpu/train

# The suite in two parts, every test in one: `make test` the quick part (what
# a student runs: each stage against stage 01 on tiny models, bad input,
# checkpoints and exact resume, the collectives, the launchers installed),
# `make test-all` the rest (the learning curves, finite differences, Python's
# tools reading what dtrain wrote, the header in every configuration).
# T=PART: the tests of either part with PART in their name instead. JOBS=N:
# tests at once (default: one per core; each runs in a process of its own).
# The sanitizer builds run the quick part, or SUITE=full|all.
SUITE    ?= quick
TEST_ARGS = $(if $(JOBS),-j $(JOBS)) $(if $(T),,--suite $(1)) $(2) $(if $(T),'$(T)')

# The suite runs the stages built into build/test/ with -DDT_TESTING, which
# compiles in dtrain.h's test hooks (a rank that dies on cue, a signal at a
# given step); the binaries `make` builds, and any program that copies the
# header, have none. The hooks' build is one more dtrain.o (build/test/),
# linked to the same program objects: nothing else is compiled twice.
TEST_PROGRAMS := $(addprefix build/test/,$(PROGRAMS))
build/test/dtrain.o: dtrain.c dtrain.h
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -DDT_TESTING -c -o $@ dtrain.c
$(TEST_PROGRAMS): build/test/%: build/obj/%.o build/test/dtrain.o $(CUDA_OBJ)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -o $@ $^ $(LDLIBS)
# After TEST_PROGRAMS is set: a rule's prerequisites are expanded where make reads it, and above
# this line the list was empty, so `make test-programs` built nothing at all
test-programs: $(TEST_PROGRAMS)
TESTING = @echo "testing with: $(CC) $(CFLAGS)$(if $(CUDA_OBJ), + $(CUDA_OBJ) from $(NVCC)); the stages and tools under test with -DDT_TESTING"
test: all $(TEST_PROGRAMS)
	$(TESTING)
	./$(TEST_BIN) $(call TEST_ARGS,quick,build/test/01-single-gpu/train)
test-all: all $(TEST_PROGRAMS)
	$(TESTING)
	./$(TEST_BIN) $(call TEST_ARGS,full,build/test/01-single-gpu/train)

test-list: $(TEST_BIN)
	@./$(TEST_BIN) --list $(if $(T),'$(T)') >/dev/null
	@echo "# make test (the quick suite)"; ./$(TEST_BIN) --list --suite quick $(if $(T),'$(T)') 2>/dev/null || true
	@echo "# make test-all (the full suite)"; ./$(TEST_BIN) --list --suite full $(if $(T),'$(T)') 2>/dev/null || true

# The sanitizers build into build/NAME/ so the fast binaries stay as they are:
# $(call sanitized,NAME,COMPILER AND FLAGS,OBJECTS,LIBRARIES) adds the rules for
# every program, its dtrain.o and the test suite there.
define sanitized
build/$(1)/obj/%.o: %.c dtrain.h
	@mkdir -p $$(dir $$@)
	$(2) $(ELSEWHERE) -c -o $$@ $$<
build/$(1)/dtrain.o: dtrain.c dtrain.h
	@mkdir -p $$(dir $$@)
	$(2) -c -o $$@ dtrain.c
$(addprefix build/$(1)/,$(PROGRAMS)): build/$(1)/%: build/$(1)/obj/%.o build/$(1)/dtrain.o $(3)
	@mkdir -p $$(dir $$@)
	$(2) -o $$@ $$^ $(4)
build/$(1)/tests/suite.o: $(TEST_DEPS)
	@mkdir -p $$(dir $$@)
	$(2) -iquote . -c -o $$@ $$<
build/$(1)/tests/runner.o: tests/runner.c tests/runner.h
	@mkdir -p $$(dir $$@)
	$(2) -c -o $$@ $$<
build/$(1)/test_dtrain: build/$(1)/tests/suite.o build/$(1)/tests/runner.o $(3)
	$(2) -o $$@ $$^ $(4)
endef
SANITIZED = $(addprefix build/$(1)/,$(PROGRAMS) test_dtrain)

# AddressSanitizer + UBSan: out-of-bounds, use after free, leaks, overflow.
ASAN_FLAGS := -DDT_TESTING -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=undefined
$(eval $(call sanitized,asan,$(CC) $(filter-out -O3 -O2,$(CFLAGS)) $(ASAN_FLAGS),$(CUDA_OBJ),$(LDLIBS)))
test-asan: $(call SANITIZED,asan)
	ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1 \
	  ./build/asan/test_dtrain $(call TEST_ARGS,$(SUITE),build/asan/01-single-gpu/train)

# MemorySanitizer: a value read before anything wrote it (which ASan and UBSan
# do not see, and which -O3's lucky zeros on the stack hide). clang only, and
# every byte a program reads must come from instrumented code, so this build
# has no OpenMP, stb_image, BLAS or CUDA (their libraries are not instrumented
# and would be reported falsely); the tests that need those skip, saying why.
# -O2 with AVX2 and FMA (x86-64-v3, where clang knows it), so that the
# matmul and the other loops run in their vector form: at -O1 on plain x86-64
# the full suite took 16 of CI's 45 minutes (stage 05's mixed-precision run
# of the suite: 69 s, 22 s so). Not -march=native: clang 14's MemorySanitizer
# then reported, in AVX-512 code, values the test had plainly written (two
# tests that pass without it). -ffp-contract=off, as gcc's -std=c11 has it:
# clang would fuse multiplies and adds that gcc keeps apart, and the
# equivalence tests' tolerances were measured on gcc's arithmetic. The
# origins (where a bad value was made) stay.
MSAN_CC    ?= clang
MSAN_ARCH  := $(shell printf 'int main(void){return 0;}\n' | $(MSAN_CC) -march=x86-64-v3 -x c - -o /dev/null >/dev/null 2>&1 && echo -march=x86-64-v3)
MSAN_FLAGS := -DDT_TESTING -O2 $(MSAN_ARCH) -ffp-contract=off -g -fno-omit-frame-pointer -fsanitize=memory \
              -fsanitize-memory-track-origins=2 -fno-sanitize-recover=memory -std=c11 $(WARN)
$(eval $(call sanitized,msan,$(MSAN_CC) $(MSAN_FLAGS),,-lm))
$(call SANITIZED,msan): | msan-toolchain
msan-toolchain:
	@printf 'int main(void){return 0;}\n' | $(MSAN_CC) -fsanitize=memory -x c - -o /dev/null 2>/dev/null || \
	  { echo "make test-msan: '$(MSAN_CC) -fsanitize=memory' cannot build a program here" \
	         "(Debian: apt-get install clang libclang-rt-dev; or MSAN_CC=another clang)" >&2; exit 1; }
test-msan: $(call SANITIZED,msan)
	MSAN_OPTIONS=halt_on_error=1:exitcode=86 ./build/msan/test_dtrain $(call TEST_ARGS,$(SUITE),build/msan/01-single-gpu/train)

# Fuzzing (tests/fuzz/, tools/fuzz.sh): every loader -- safetensors, config.json
# and the index, .npy, JSON lines, PPM/PGM, CIFAR-10, the rendezvous's messages
# -- under libFuzzer with ASan and UBSan (clang), FUZZ_SECONDS each (default
# 60), from the test suite's own files and build/fuzz/corpus/.
FUZZ_CC  ?= clang
build/fuzz/fuzz: $(wildcard tests/fuzz/*.c) dtrain.h | fuzz-toolchain
	@mkdir -p build/fuzz
	$(FUZZ_CC) -std=c11 $(WARN) -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
	  -DDT_FUZZING -DDT_TESTING -o $@ tests/fuzz/fuzz.c -lm -lpthread
fuzz-toolchain:
	@printf 'int LLVMFuzzerTestOneInput(const char *d, long n){(void)d;(void)n;return 0;}\n' | \
	  $(FUZZ_CC) -fsanitize=fuzzer -x c - -o /dev/null 2>/dev/null || \
	  { echo "make fuzz: '$(FUZZ_CC) -fsanitize=fuzzer' cannot build a program here" \
	         "(Debian: apt-get install clang libclang-rt-dev; or FUZZ_CC=another clang)" >&2; exit 1; }
fuzz: build/fuzz/fuzz $(TEST_BIN)
	+tools/fuzz.sh

# The CPU-only build at other optimisation levels (tools/check_builds.sh).
test-builds:
	+LEVELS="$(or $(LEVELS),-O0 -O2 -O3)" tools/check_builds.sh

TORCH_PY = $(shell for p in python3 /usr/bin/python3; do $$p -c 'import torch' 2>/dev/null && echo $$p && break; done)

# The scaling study (tools/bench.c): each stage's own --bench at 1, 2 and 4
# ranks (devices in 02) on mlp and vit-tiny (and 08 on gpt-512, a context of 512
# tokens, beside 01 and 03), speedup and efficiency against the
# same stage at 1 rank next to the cost model's prediction, with the link
# measured by tools/collectives; bench/results.csv, bench/scaling.svg and
# bench/memory.svg. On a CPU the ranks share the cores one rank already uses,
# so this measures what data parallelism costs, not what it gains; runs with
# more ranks x threads than cores are marked oversubscribed. On a GPU it first
# runs tools/bench_gpu.sh (dtrain against PyTorch, DDP's overhead, stage 05's
# dtypes on vit-base); then tools/bench_cpu.sh, stage 01 against PyTorch on
# the CPU (when it is installed) at 1 and 2 threads, medians of 3 alternating
# runs (BENCH_CPU=0 skips it; REPEATS, THREADS, BIG=0, BIG_REPEATS are its knobs), and
# tools/bench_qwen2.sh: a fine-tuning step of Qwen2-0.5B's shape against PyTorch +
# transformers (build/pyvenv's) on the same weights, tokens/s and peak RSS at two
# threads (BENCH_QWEN2=0 skips it: about 12 minutes and 14 GB of memory). At 4
# ranks tools/bench ends with the layouts study: gpt-char on every D x T x P
# of 4 ranks in stage 07, against 01 and the cost model (bench/layouts.csv,
# bench/layouts.svg; tools/bench --layouts N alone for another size).
bench: $(STAGE_BINS) tools/collectives tools/bench tools/roofline
	@if [ -n "$(CUDA_OBJ)" ] && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then \
	  tools/bench_gpu.sh 01-single-gpu/train "$(TORCH_PY)" 03-ddp/train 05-accum-mixed-precision/train; \
	else echo "(no GPU here, or a build without CUDA: CPU benchmarks only)"; fi
	./tools/bench --out bench $(BENCH_FLAGS)
	@if [ "$(BENCH_CPU)" != 0 ]; then \
	   [ -z "$$OPENBLAS_CORETYPE" ] || echo "(OPENBLAS_CORETYPE=$$OPENBLAS_CORETYPE limits PyTorch's OpenBLAS to that core type)"; \
	   tools/bench_cpu.sh 01-single-gpu/train "$(TORCH_PY)"; fi
	@if [ "$(BENCH_QWEN2)" != 0 ]; then tools/bench_qwen2.sh 01-single-gpu/train build/pyvenv/bin/python; fi

# Each stage against the stage it builds on: the one before it, unless its
# file says "Builds on NN-name." (06 builds on 03: it drops 04-05's sharding,
# accumulation and mixed precision to teach one thing).
base_of = $$(sed -n 's/.*Builds on \(0[0-9]-[a-z-]*[a-z]\).*/\1/p' $$s/train.c | head -1)
diff:
	@prev=""; for s in $(STAGES); do s=$${s%/}; b=$(base_of); b=$${b:-$$prev}; \
	  if [ -n "$$b" ]; then echo "==== $$b -> $$s"; diff -u $$b/train.c $$s/train.c; \
	    diff $$b/train.c $$s/train.c | awk -f tools/read_next.awk $(or $(CHAPTERS),dtrain.h) $$b/train.c $$s/train.c -; fi; prev=$$s; \
	done; prev=""; for s in $(STAGES); do s=$${s%/}; b=$(base_of); b=$${b:-$$prev}; \
	  if [ -n "$$b" ]; then \
	    d=$$(diff $$b/train.c $$s/train.c); \
	    printf '%-32s %3d lines changed (%d removed, %d added)\n' "$$b -> $$s:" \
	      $$(printf '%s\n' "$$d" | grep -c '^[<>]') $$(printf '%s\n' "$$d" | grep -c '^<') $$(printf '%s\n' "$$d" | grep -c '^>'); \
	  fi; prev=$$s; \
	done; if [ "$(words $(STAGES))" -lt 2 ]; then echo "(only one stage so far: nothing to compare)"; fi; true

clean:
	rm -rf $(STAGE_BINS) $(TOOLS) $(TEST_BIN) build

.PHONY: FORCE all run test test-all test-list test-asan test-msan msan-toolchain fuzz fuzz-toolchain test-builds bench diff clean print-nccl gpu-check test-programs
