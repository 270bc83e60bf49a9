/* tests/00-build-and-tools.c -- tests of the build and the tools: the header
   in every configuration, its assembly from src/, make finds NCCL, make
   diff, the registry of tests. (tests/helpers.h: how the suite's files make
   one program.) */
#include "helpers.h"

/* ---- the build and the tools: make finds NCCL, make diff, make test T= ------ */

/* The header compiles without a warning (-Wall -Wextra -Werror) in each build a
   user may make of it: plain, with OpenMP, with a system BLAS, with stb_image,
   the host side of a CUDA build, and MPI where mpicc is found. The BLAS build once warned (an unused
   matmul routine) and no test compiled it: the first GPU machine had OpenBLAS.
   A stand-in cblas.h (the prototype only) serves where OpenBLAS is not installed. */
TEST(the_header_compiles_without_warnings_in_every_configuration, FULL) {
    char root[512], out[8192], dir[700], src[800];
    if (!getcwd(root, sizeof root)) SKIP("no working directory");
    snprintf(src, sizeof src, "%s/dtrain.h", root);
    if (access(src, R_OK) != 0) SKIP("run from the repository root: the header is compiled from there");
    const char *cc = getenv("CC") ? getenv("CC") : "cc";
    snprintf(dir, sizeof dir, "%s/configs", tmpdir);
    mkdir(dir, 0755);
    snprintf(src, sizeof src, "%s/cblas.h", dir);
    FILE *f = fopen(src, "w");
    CHECKF(f != NULL, "cannot write %s", src);
    if (!f) return;
    fputs("enum CBLAS_ORDER { CblasRowMajor = 101 };\nenum CBLAS_TRANSPOSE { CblasNoTrans = 111, CblasTrans = 112 };\n"
          "void cblas_sgemm(enum CBLAS_ORDER, enum CBLAS_TRANSPOSE, enum CBLAS_TRANSPOSE, int, int, int, float, const float *,\n"
          "                 int, const float *, int, float, float *, int);\n", f);
    fclose(f);
    snprintf(src, sizeof src, "%s/prog.c", dir);
    f = fopen(src, "w");
    CHECKF(f != NULL, "cannot write %s", src);
    if (!f) return;
    fputs("#define DTRAIN_IMPLEMENTATION\n#include \"dtrain.h\"\nint main(void) { return 0; }\n", f);
    fclose(f);
    /* -O0 is enough for unused code and takes a second; one build at -O2 adds
       the warnings that need the optimiser's analysis (uninitialised values) */
    static const struct { const char *name, *flags; int needs_stb; } configs[] = {
        { "plain", "-O0", 0 }, { "OpenMP", "-O0 -fopenmp", 0 }, { "a system BLAS", "-O0 -DDT_HAVE_CBLAS -I%s", 0 },
        { "stb_image", "-O0 -DDT_HAVE_STB", 1 }, { "the host side of CUDA", "-O0 -DDT_HAVE_CUDA", 0 },
        { "everything", "-O2 -fopenmp -DDT_HAVE_CBLAS -I%s -DDT_HAVE_STB -DDT_HAVE_CUDA", 1 },
    };
    int have_stb = access("/usr/include/stb/stb_image.h", R_OK) == 0;
    for (size_t i = 0; i < sizeof configs / sizeof configs[0]; i++) {
        if (configs[i].needs_stb && !have_stb) continue;
        char flags[1024];
        snprintf(flags, sizeof flags, configs[i].flags, dir, dir);
        int st = run_cmd(out, sizeof out, "%s -std=c11 -Wall -Wextra -Werror %s -I%s -c %s -o %s/prog.o", cc, flags, root,
                         src, dir);
        CHECKF(st == 0, "with %s (%s): warnings or errors\n%s", configs[i].name, flags, out);
    }
    /* a program of the Makefile's, with the implementation compiled apart: the declarations alone */
    int st = run_cmd(out, sizeof out, "%s -std=c11 -Wall -Wextra -Werror -O0 -DDTRAIN_IMPLEMENTATION_ELSEWHERE -I%s -c %s -o %s/prog.o",
                     cc, root, src, dir);
    CHECKF(st == 0, "with -DDTRAIN_IMPLEMENTATION_ELSEWHERE (the declarations only): warnings or errors\n%s", out);
    /* and a stage alone, as the README builds it without make */
    st = run_cmd(out, sizeof out, "%s -O2 %s/01-single-gpu/train.c -lm -o %s/stage01 && %s/stage01 --device cpu --bench --steps 2 "
                 "--batch-size 8 --dim 16", cc, root, dir, dir);
    CHECKF(st == 0 && strstr(out, "bench: workload=mlp"), "cc -O2 01-single-gpu/train.c -lm: exit %d\n%s", st, out);
    /* with MPI, where Open MPI's compiler wrapper says where it is */
    if (run_cmd(out, sizeof out, "mpicc --showme:compile") == 0) {
        st = run_cmd(out, sizeof out, "%s -std=c11 -Wall -Wextra -Werror -O2 -fopenmp -DDT_HAVE_MPI $(mpicc --showme:compile) -I%s "
                         "-c %s -o %s/prog.o", cc, root, src, dir);
        CHECKF(st == 0, "with MPI (-O2 -fopenmp -DDT_HAVE_MPI): warnings or errors\n%s", out);
    }
}

/* NCCL is found once, by the Makefile, for both compilers -- also where it
   comes as the Python wheel nvidia-nccl-cu13 (site-packages/nvidia/nccl, with
   libnccl.so.2 only). A fake wheel made of this machine's NCCL must be found,
   by NCCL_HOME and through Python, and its flags must link a program. */
static int make_var(const char *out, const char *key, char *val, size_t n) {
    const char *p = strstr(out, key);
    if (!p) return 0;
    p += strlen(key);
    size_t len = strcspn(p, "\n");
    if (len >= n) len = n - 1;
    memcpy(val, p, len);
    val[len] = 0;
    return 1;
}
TEST(make_finds_nccl_in_a_wheel_layout, FULL) {
    char out[8192], inc[1024], lib[1024], site[700], wheel[800], libs[2048];
    const char *root = repo_root();
    int st = run_cmd(out, sizeof out, "env -u MAKEFLAGS -u MAKELEVEL make -s -C %s print-nccl", root);
    if (st != 0 || !strstr(out, "NCCL_FOUND=1") || !make_var(out, "NCCL_INCLUDE=", inc, sizeof inc) ||
        !make_var(out, "NCCL_LIB=", lib, sizeof lib))
        SKIP("no NCCL on this machine to dress up as a wheel (%.200s)", out);
    snprintf(site, sizeof site, "%s/site-packages", tmpdir);
    snprintf(wheel, sizeof wheel, "%s/nvidia/nccl", site);
    st = run_cmd(out, sizeof out, "mkdir -p %s/include %s/lib && ln -sf %s/nccl.h %s/include/nccl.h && "
                 "ln -sf \"$(readlink -f %s)\" %s/lib/libnccl.so.2", wheel, wheel, inc, wheel, lib, wheel);
    CHECKF(st == 0, "making the fake wheel: %s", out);
    for (int how = 0; how < 2; how++) {
        st = how == 0 ? run_cmd(out, sizeof out, "env -u MAKEFLAGS -u MAKELEVEL make -s -C %s print-nccl NCCL_HOME=%s", root, wheel)
                      : run_cmd(out, sizeof out, "env -u MAKEFLAGS -u MAKELEVEL PYTHONPATH=%s make -s -C %s print-nccl "
                                "'NCCL_CANDIDATES=$(NCCL_WHEEL)'", site, root);
        char want[900];
        snprintf(want, sizeof want, "NCCL_INCLUDE=%s/include", wheel);
        CHECKF(st == 0 && strstr(out, want) && strstr(out, "-l:libnccl.so.2") && strstr(out, "-rpath"),
               "%s: the wheel was not found, or not linked by its .so.2:\n%s", how ? "through Python" : "NCCL_HOME", out);
    }
    /* those flags link and run a program against the wheel's library */
    CHECK(make_var(out, "NCCL_LIBS=", libs, sizeof libs));
    char src[800], exe[800];
    snprintf(src, sizeof src, "%s/ncclver.c", tmpdir);
    snprintf(exe, sizeof exe, "%s/ncclver", tmpdir);
    const char *prog = "int ncclGetVersion(int *);\n#include <stdio.h>\nint main(void){int v=0;ncclGetVersion(&v);printf(\"nccl %d\\n\",v);return v<=0;}\n";
    write_bytes(src, prog, strlen(prog));
    st = run_cmd(out, sizeof out, "cc %s -o %s %s && %s", src, exe, libs, exe);
    CHECKF(st == 0 && strstr(out, "nccl "), "linking with the wheel's flags: exit %d\n%s", st, out);
    /* a wrong NCCL_HOME is an error naming it, not a build without NCCL */
    st = run_cmd(out, sizeof out, "env -u MAKEFLAGS -u MAKELEVEL make -s -C %s print-nccl NCCL_HOME=%s/nowhere", root, tmpdir);
    CHECKF(st != 0 && strstr(out, "NCCL_HOME="), "NCCL_HOME pointing nowhere: exit %d\n%s", st, out);
}

/* dtrain.h is assembled from its chapters in src/ (tools/assemble), and the
   committed file is that assembly. No chapter is longer than 1,200 lines. In
   a copy: a chapter edited without assembling again fails the check; --write
   assembles it; and an edit made in dtrain.h itself is never overwritten. */
TEST(the_header_is_its_chapters_assembled, QUICK) {
    static char out[16384];
    char path[1200], line[4096];
    const char *root = repo_root();
    int st = run_cmd(out, sizeof out, "%s/tools/assemble --check", root);
    CHECKF(st == 0, "the committed dtrain.h is not its chapters' assembly (exit %d):\n%s", st, out);
    snprintf(path, sizeof path, "%s/src", root);
    DIR *d = opendir(path);
    CHECKF(d != NULL, "cannot list %s", path);
    int chapters = 0;
    for (struct dirent *e; d && (e = readdir(d));) {
        size_t n = strlen(e->d_name);
        if (n < 5 || !isdigit((unsigned char)e->d_name[0]) || strcmp(e->d_name + n - 2, ".h")) continue;
        snprintf(path, sizeof path, "%s/src/%s", root, e->d_name);
        FILE *f = fopen(path, "r");
        int lines = 0;
        while (f && fgets(line, sizeof line, f)) lines += strchr(line, '\n') != NULL;
        if (f) fclose(f);
        chapters++;
        CHECKF(lines <= 1200, "src/%s has %d lines: a chapter is at most 1,200 (split it where its idea splits)", e->d_name, lines);
    }
    if (d) closedir(d);
    CHECKF(chapters >= 20, "only %d chapters in %s/src", chapters, root);
    /* included twice, the implementation first (stb's way), and in C++: the
       include guard and extern "C" close where the declarations end */
    const char *cc = getenv("CC") ? getenv("CC") : "cc";
    char prog[800];
    snprintf(prog, sizeof prog, "%s/twice.c", tmpdir);
    const char *twice = "#define DTRAIN_IMPLEMENTATION\n#include \"dtrain.h\"\n#include \"dtrain.h\"\nint main(void) { return 0; }\n";
    write_bytes(prog, twice, strlen(twice));
    st = run_cmd(out, sizeof out, "%s -std=c11 -Wall -Wextra -Werror -fsyntax-only -I%s %s", cc, root, prog);
    CHECKF(st == 0, "dtrain.h included twice does not compile (exit %d)\n%.3000s", st, out);
    if (run_cmd(out, sizeof out, "c++ --version") == 0) {
        snprintf(prog, sizeof prog, "%s/twice.cc", tmpdir);
        const char *twice_cxx = "#include \"dtrain.h\"\n#include \"dtrain.h\"\nint main() { return dt_model_is_language(DT_MODEL_GPT) ? 0 : 1; }\n";
        write_bytes(prog, twice_cxx, strlen(twice_cxx));
        st = run_cmd(out, sizeof out, "c++ -Wall -Wextra -Werror -fsyntax-only -I%s %s", root, prog);
        CHECKF(st == 0, "dtrain.h included twice in C++ does not compile (exit %d)\n%.3000s", st, out);
    }
    /* a copy of the chapters and the tool, without git and never built */
    char copy[800];
    snprintf(copy, sizeof copy, "%s/copy", tmpdir);
    unsetenv("GIT_DIR");                          /* the copy is in no repository: git must not find one */
    unsetenv("GIT_WORK_TREE");
    st = run_cmd(out, sizeof out, "mkdir -p %s/tools && cp -r %s/src %s/ && cp %s/tools/assemble %s/tools/ && cp %s/dtrain.h %s/ && "
                 "printf '/* an edit in a chapter */\n' >> %s/src/01-errors.h && %s/tools/assemble --check",
                 copy, root, copy, root, copy, root, copy, copy, copy);
    CHECKF(st == 1 && strstr(out, "dtrain.h is not the assembly"), "a chapter edited, not assembled: --check exit %d\n%s", st, out);
    st = run_cmd(out, sizeof out, "%s/tools/assemble --write && %s/tools/assemble --check && grep -c 'an edit in a chapter' %s/dtrain.h",
                 copy, copy, copy);
    CHECKF(st == 0 && strstr(out, "dtrain.h.before") && strstr(out, "\n1\n"), "--write in a copy without git: exit %d\n%s", st, out);
    st = run_cmd(out, sizeof out, "printf '/* an edit in the header */\n' >> %s/dtrain.h && printf '/* more */\n' >> "
                 "%s/src/02-devices-and-memory.h && %s/tools/assemble --write", copy, copy, copy);
    CHECKF(st == 1 && strstr(out, "edited since it was assembled") && strstr(out, "not overwriting"),
           "an edit in dtrain.h and one in a chapter: --write exit %d\n%s", st, out);
    st = run_cmd(out, sizeof out, "grep -c 'an edit in the header' %s/dtrain.h", copy);
    CHECKF(st == 0 && atoi(out) == 1, "--write lost an edit made in dtrain.h (grep: %s)", out);
}

/* The lessons (the chapters whose first line says "//@ lesson:") come before
   the machinery and use nothing it defines: assembled alone (tools/assemble
   --lessons) they compile, in the plain build and with OpenMP and the host
   side of CUDA. A lesson that calls into the machinery -- here the optimizer
   calling dt_parse_args -- fails that, naming the call; and a machinery
   chapter numbered among the lessons is refused by the assembly. */
/* What make builds stays out of git: a program committed once is stale after
   the next change, and every clone carries it (.gitignore names each
   stage's train, the ones to come too). */
TEST(no_built_program_is_committed, QUICK) {
    static char out[1 << 16];
    const char *root = repo_root();
    /* the root of a checkout (tools/check_builds.sh tests a copy of the sources inside build/, which git ignores) */
    if (run_cmd(out, sizeof out, "git -C %s rev-parse --show-prefix", root) != 0) SKIP("%s is not a git checkout", root);
    if (out[0] && out[0] != '\n') SKIP("%s is a folder inside a checkout, not its root (a copy of the sources)", root);
    if (run_cmd(out, sizeof out, "git -C %s ls-files", root) != 0) SKIP("%s: git ls-files failed", root);
    int files = 0;
    for (char *name = strtok(out, "\n"); name; name = strtok(NULL, "\n")) {
        char path[1200], magic[4] = { 0 };
        snprintf(path, sizeof path, "%s/%s", root, name);
        FILE *f = fopen(path, "rb");
        size_t got = f ? fread(magic, 1, sizeof magic, f) : 0;
        if (f) fclose(f);
        files++;
        CHECKF(!(got == 4 && !memcmp(magic, "\x7f" "ELF", 4)), "%s is a built program, committed: git rm --cached it, and "
               "let .gitignore name it", name);
    }
    CHECKF(files > 50, "git ls-files listed only %d files in %s", files, root);
}

TEST(the_lessons_compile_without_the_machinery, QUICK) {
    static char out[16384];
    const char *root = repo_root();
    const char *cc = getenv("CC") ? getenv("CC") : "cc";
    char copy[800];
    snprintf(copy, sizeof copy, "%s/copy", tmpdir);
    /* plain; with the test hooks and the host side of CUDA; with OpenMP where the compiler has it */
    const char *flags[] = { "", "-DDT_TESTING -DDT_HAVE_CUDA", "-fopenmp" };
    int configs = run_cmd(out, sizeof out, "printf '#include <omp.h>\\nint main(void) { return omp_get_max_threads() < 1; }\\n' | "
                          "%s -fopenmp -x c - -o %s/omp", cc, tmpdir) == 0 ? 3 : 2;
    for (int i = 0; i < configs; i++) {
        /* the whole header with these flags first: a warning there is not the lessons' doing */
        int st = run_cmd(out, sizeof out, "%s -std=c11 -Wall -Wextra -Werror -fsyntax-only -DDTRAIN_IMPLEMENTATION %s -x c %s/dtrain.h",
                         cc, flags[i], root);
        CHECKF(st == 0, "dtrain.h itself (%s) does not compile without a warning\n%.3000s", flags[i][0] ? flags[i] : "plain", out);
        st = run_cmd(out, sizeof out, "%s/tools/assemble --lessons > %s/lessons.h && %s -std=c11 -Wall -Wextra -Werror "
                     "-fsyntax-only -DDTRAIN_IMPLEMENTATION %s -x c %s/lessons.h", root, tmpdir, cc, flags[i], tmpdir);
        CHECKF(st == 0, "the lessons alone (%s) do not compile: they use the machinery\n%.3000s", flags[i][0] ? flags[i] : "plain", out);
    }
    int st = run_cmd(out, sizeof out, "mkdir -p %s/tools && cp -r %s/src %s/ && cp %s/tools/assemble %s/tools/ && "
                     "printf 'int dt__lesson_peeks(void) { (void)dt_parse_args(0, 0, \"01\"); return 0; }\n' >> %s/src/09-optimizer.h && "
                     "%s/tools/assemble > %s/whole.h && %s -std=c11 -Wall -Wextra -Werror -fsyntax-only -DDTRAIN_IMPLEMENTATION -x c %s/whole.h",
                     copy, root, copy, root, copy, copy, copy, tmpdir, cc, tmpdir);
    CHECKF(st == 0, "the call put into a lesson does not compile even with the machinery (exit %d)\n%.2000s", st, out);
    st = run_cmd(out, sizeof out, "%s/tools/assemble --lessons > %s/lessons.h && %s -std=c11 -Wall -Wextra -Werror -fsyntax-only "
                 "-DDTRAIN_IMPLEMENTATION -x c %s/lessons.h", copy, tmpdir, cc, tmpdir);
    CHECKF(st != 0 && strstr(out, "dt_parse_args"), "a lesson calling dt_parse_args compiled without the machinery (exit %d)\n%.2000s",
           st, out);
    st = run_cmd(out, sizeof out, "cp %s/src/09-optimizer.h %s/src/ && mv %s/src/21-data.h %s/src/08-data.h && %s/tools/assemble",
                 root, copy, copy, copy, copy);
    CHECKF(st == 2 && strstr(out, "is a lesson chapter after a machinery one"),
           "a machinery chapter among the lessons: exit %d\n%.2000s", st, out);
}

/* A parallel wrapper's insides (its struct, what its callbacks cast
   dt_parallel * to) are its chapter's: the machinery asks through
   dt_parallel_report, and no other chapter casts a wrapper or tests which
   one a dt_parallel is (comparing a callback with a wrapper's function).
   Found from the chapters: a wrapper is a struct whose first member is its
   dt_parallel. A cast put into the checkpoints chapter makes it fail. */
static int wrapper_leaks(const char *srcdir, char *report, size_t n) {
    char names[16][64], owners[16][256], path[1200];
    int nw = 0, leaks = 0;
    report[0] = 0;
    DIR *d = opendir(srcdir);
    if (!d) return -1;
    char files[64][256];
    int nf = 0;
    for (struct dirent *e; (e = readdir(d)) && nf < 64;)
        if (strlen(e->d_name) > 3 && !strcmp(e->d_name + strlen(e->d_name) - 2, ".h")) snprintf(files[nf++], 256, "%.255s", e->d_name);
    closedir(d);
    for (int f = 0; f < nf; f++) {                      /* struct dt_X {  followed by  dt_parallel par; */
        snprintf(path, sizeof path, "%.900s/%.255s", srcdir, files[f]);
        char *text = read_text(path);
        for (char *p = text; p && (p = strstr(p, "\nstruct dt_")) && nw < 16; p++) {
            char name[64];
            if (sscanf(p + 8, "%63[a-z_0-9] {", name) != 1) continue;
            const char *body = strchr(p + 1, '{');
            if (!body || strncmp(body + 1 + strspn(body + 1, " \n"), "dt_parallel par;", 16)) continue;
            snprintf(names[nw], 64, "%.63s", name);
            snprintf(owners[nw++], 256, "%.255s", files[f]);
        }
        free(text);
    }
    for (int f = 0; f < nf; f++) {
        snprintf(path, sizeof path, "%.900s/%.255s", srcdir, files[f]);
        char *text = read_text(path);
        for (int w = 0; text && w < nw; w++) {
            if (!strcmp(files[f], owners[w])) continue;
            char cast[96], cast_const[96], identity[96];
            snprintf(cast, sizeof cast, "(%.63s *)", names[w]);
            snprintf(cast_const, sizeof cast_const, "(const %.63s *)", names[w]);
            snprintf(identity, sizeof identity, "== dt__%.60s_", names[w] + 3);     /* a callback compared with the wrapper's */
            const char *what[3] = { cast, cast_const, identity };
            for (int k = 0; k < 3; k++)
                if (strstr(text, what[k])) {
                    leaks++;
                    snprintf(report + strlen(report), n - strlen(report), "  %s has \"%s\" (%s is %s's)\n", files[f], what[k],
                             names[w], owners[w]);
                }
        }
        free(text);
    }
    return nw < 5 ? -nw - 1 : leaks;                     /* DataParallel, DDP, FSDP, tensor, pipeline parallelism */
}
TEST(no_chapter_casts_or_identifies_a_wrapper_but_its_own, QUICK) {
    char src[900], report[4096], out[4096];
    snprintf(src, sizeof src, "%s/src", repo_root());
    int leaks = wrapper_leaks(src, report, sizeof report);
    CHECKF(leaks == 0, "%d wrapper casts or identity tests outside the wrapper's chapter (or too few wrappers found: %d)\n%s",
           leaks, leaks, report);
    int st = run_cmd(out, sizeof out, "cp -r %s %s/src && printf 'static int dt__peek(dt_parallel *p) { return ((dt_fsdp *)p)->rank; }\n' "
                     ">> %s/src/23-checkpoints.h", src, tmpdir, tmpdir);
    CHECKF(st == 0, "copying the chapters: exit %d\n%s", st, out);
    snprintf(src, sizeof src, "%s/src", tmpdir);
    leaks = wrapper_leaks(src, report, sizeof report);
    CHECKF(leaks == 1 && strstr(report, "23-checkpoints.h has \"(dt_fsdp *)\""),
           "a cast of FSDP put into the checkpoints chapter was not found (%d)\n%s", leaks, report);
}

/* One gradient-averaging path and one optimizer-sharding path: of the
   parallel chapters (13 to 19, and the backend tables), only DDP's and
   FSDP's average (DT_AVG), and only FSDP's gives the optimizer less than the
   model to step (sets o->numel); tensor, pipeline and context parallelism
   leave both to the engine that wraps them. An average put into the pipeline's chapter makes it fail. */
static int averaging_leaks(const char *srcdir, char *report, size_t n) {
    static const char *const chapters[7] = { "13-data-parallel.h", "14-ddp.h", "15-fsdp.h", "16-tensor-parallel.h",
                                             "17-pipeline-parallel.h", "18-context-parallel.h", "20-backend-tables.h" };
    static const char *const owner[2] = { "14-ddp.h 15-fsdp.h", "15-fsdp.h" }, *const what[2] = { "DT_AVG", "o->numel =" };
    int leaks = 0;
    report[0] = 0;
    for (int c = 0; c < 7; c++) {
        char path[1200];
        snprintf(path, sizeof path, "%.900s/%s", srcdir, chapters[c]);
        char *text = read_text(path);
        if (!text) return -1;
        for (int k = 0; k < 2; k++)
            if (!strstr(owner[k], chapters[c]) && strstr(text, what[k])) {
                leaks++;
                snprintf(report + strlen(report), n - strlen(report), "  %s has \"%s\" (only %s's)\n", chapters[c], what[k], owner[k]);
            }
        free(text);
    }
    return leaks;
}
TEST(gradients_are_averaged_and_sharded_in_one_place, QUICK) {
    char src[900], report[2048], out[4096];
    snprintf(src, sizeof src, "%s/src", repo_root());
    int leaks = averaging_leaks(src, report, sizeof report);
    CHECKF(leaks == 0, "%d averages or sharded optimizer views outside the data-parallel engine's chapters\n%s", leaks, report);
    int st = run_cmd(out, sizeof out, "cp -r %s %s/src && printf 'static int dt__avg = DT_AVG;\n' >> %s/src/17-pipeline-parallel.h && "
                     "printf 'static void dt__v(dt_optimizer *o) { o->numel = 1; }\n' >> %s/src/16-tensor-parallel.h",
                     src, tmpdir, tmpdir, tmpdir);
    CHECKF(st == 0, "copying the chapters: exit %d\n%s", st, out);
    snprintf(src, sizeof src, "%s/src", tmpdir);
    leaks = averaging_leaks(src, report, sizeof report);
    CHECKF(leaks == 2 && strstr(report, "17-pipeline-parallel.h has \"DT_AVG\"") &&
           strstr(report, "16-tensor-parallel.h has \"o->numel =\""), "an average put into the pipeline's chapter and a sharded "
           "optimizer view into tensor parallelism's were not both found (%d)\n%s", leaks, report);
}

/* The README is a front page: every page of the project is one link away
   from it, and every link of every page names a file (and a heading) that
   exists (tools/check_links.py). A page left unlinked, and a link to a file
   that is not there, make the check fail. */
TEST(every_page_links_to_what_exists_and_is_one_link_from_the_readme, QUICK) {
    char out[8192], root[4200], cwd[2048];
    if (!getcwd(cwd, sizeof cwd)) SKIP("no working directory");
    if (repo_root()[0] == '/') snprintf(root, sizeof root, "%.2047s", repo_root());
    else snprintf(root, sizeof root, "%.2047s/%.2047s", cwd, repo_root());       /* the copy runs it from elsewhere */
    if (run_cmd(out, sizeof out, "python3 -c 1") != 0) SKIP("no python3 to run tools/check_links.py");
    char page[4300];
    snprintf(page, sizeof page, "%.4200s/README.md", root);
    if (access(page, R_OK) != 0) SKIP("no README.md in %.200s: a copy of the sources without the pages (make test-builds)", root);
    int st = run_cmd(out, sizeof out, "test -d %s && cd %s && python3 tools/check_links.py --front README.md README.md docs/*.md "
                     "0*/README.md", root, root);
    CHECKF(st == 0, "the project's pages: exit %d\n%s", st, out);
    st = run_cmd(out, sizeof out, "mkdir -p %s/copy && cd %s && cp -r README.md docs 0*-* %s/copy/ && cd %s/copy && "
                 "printf '# Lost\\n\\nSee [the guide](guide.md) and [a page](nowhere.md).\\n' > docs/lost.md && "
                 "python3 %s/tools/check_links.py --front README.md README.md docs/*.md 0*/README.md", tmpdir, root, tmpdir, tmpdir, root);
    CHECKF(st == 1 && strstr(out, "docs/lost.md: links to nowhere.md, which does not exist") &&
           strstr(out, "docs/lost.md: not linked from README.md"), "a broken link and an unlinked page: exit %d\n%s", st, out);
}

/* make diff ends each diff with the chapter lines to read next: for 03 -> 04,
   dt_fsdp_create where a chapter of dtrain.h (src/) declares and defines it
   today (found here from the chapters themselves, so an edit that moves it
   moves what is expected). And a test filter that names no test (make test
   T=typo) is an error that says so, not a green run of nothing. */
TEST(make_diff_names_the_header_lines_and_an_empty_filter_fails, FULL) {
    static char out[65536];
    char path[1200], line[4096], want[600], want_def[600], decl_in[300] = "", def_in[300] = "";
    const char *root = repo_root();
    int decl = 0, def = 0;
    snprintf(path, sizeof path, "%s/src", root);
    DIR *d = opendir(path);
    CHECKF(d != NULL, "cannot list %s", path);
    if (!d) return;
    for (struct dirent *e; (e = readdir(d));) {
        size_t n = strlen(e->d_name);
        if (n < 5 || !isdigit((unsigned char)e->d_name[0]) || strcmp(e->d_name + n - 2, ".h")) continue;
        snprintf(path, sizeof path, "%s/src/%s", root, e->d_name);
        FILE *h = fopen(path, "r");
        CHECKF(h != NULL, "cannot read %s", path);
        if (!h) continue;
        for (int ln = 1; fgets(line, sizeof line, h); ln++) {
            if (strncmp(line, "dt_fsdp *dt_fsdp_create(", 24) != 0) continue;
            size_t len = strcspn(line, "\n");
            while (len && line[len - 1] == ' ') len--;
            if (len && line[len - 1] == ';' && !decl) { decl = ln; snprintf(decl_in, sizeof decl_in, "src/%s", e->d_name); }
            if (len && line[len - 1] == '{' && !def) { def = ln; snprintf(def_in, sizeof def_in, "src/%s", e->d_name); }
        }
        fclose(h);
    }
    closedir(d);
    CHECKF(decl && def, "no chapter declares and defines dt_fsdp_create as this test expects (%d, %d)", decl, def);
    int st = run_cmd(out, sizeof out, "env -u MAKEFLAGS -u MAKELEVEL make -s -C %s diff", root);
    const char *from = strstr(out, "---- 03-ddp -> 04-fsdp: read next in src/");
    const char *to = from ? strstr(from + 1, "\n---- ") : NULL;
    const char *hit = from ? strstr(from, "\n    dt_fsdp_create ") : NULL;
    snprintf(want, sizeof want, "%s:%d (declared)", decl_in, decl);
    snprintf(want_def, sizeof want_def, "%s:%d (defined)", def_in, def);
    size_t hit_len = hit ? strcspn(hit + 1, "\n") : 0;
    CHECKF(st == 0 && hit && (!to || hit < to), "make diff (exit %d) lists no dt_fsdp_create after 03 -> 04:\n%.3000s", st, from ? from : out);
    if (hit) {
        char row[512];
        snprintf(row, sizeof row, "%.*s", (int)hit_len, hit + 1);
        CHECKF(strstr(row, want) && strstr(row, want_def), "make diff says \"%s\"; the chapters have %s and %s", row, want, want_def);
    }
    CHECKF(strstr(out, "03-ddp -> 04-fsdp:") && strstr(out, "lines changed"), "make diff lost its count of changed lines:\n%.2000s", out);
    st = run_cmd(out, sizeof out, "%s %s no_test_has_this_in_its_name", self_bin, train_bin);
    CHECKF(st == 2 && strstr(out, "no test name contains \"no_test_has_this_in_its_name\""), "a filter matching nothing: exit %d\n%s", st, out);
    st = run_cmd(out, sizeof out, "%s --list make_diff", self_bin);
    CHECKF(st == 0 && !strcmp(out, "make_diff_names_the_header_lines_and_an_empty_filter_fails\n"), "--list make_diff: exit %d\n%s", st, out);
    st = run_cmd(out, sizeof out, "env -u MAKEFLAGS -u MAKELEVEL make -n -s -C %s test T=some_part", root);
    CHECKF(strstr(out, "01-single-gpu/train 'some_part'"), "make test T=some_part does not hand the filter on:\n%.2000s", out);
}

/* `make test-programs` (what tools/gpu_check_tier2.sh builds with) builds the
   stages with the test hooks again when the header changed: its rule once
   came before the list it names was set, and built nothing at all. */
TEST(make_test_programs_builds_what_the_header_changed, QUICK) {
    char out[65536];
    int st = run_cmd(out, sizeof out, "env -u MAKEFLAGS -u MAKELEVEL make -n -W dtrain.h -C %s test-programs", repo_root());
    CHECKF(st == 0 && strstr(out, "-DDT_TESTING -c -o build/test/dtrain.o") && strstr(out, "-o build/test/01-single-gpu/train ") &&
           strstr(out, "-o build/test/07-pipeline-parallel/train "),
           "make -n -W dtrain.h test-programs (exit %d) would not build build/test/dtrain.o and the stages:\n%.2000s", st, out);
}

/* Every test registers itself (tests/runner.h), in one suite, and the
   runner lists them in the order the files define them (tests/NN-name.c by
   name, then by line): a file the build left out, or a test function
   written without TEST(), would never run, and is named here. */
static int by_name(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }
TEST(the_registry_lists_every_test_in_file_order, QUICK) {
    char path[800], out[65536];
    static char *names[T_MAX_TESTS + 2];
    int nf = 0;
    snprintf(path, sizeof path, "%s/tests", repo_root());
    DIR *d = opendir(path);
    if (!d) SKIP("no tests/ beside this build");
    for (struct dirent *e; (e = readdir(d)) && nf < T_MAX_TESTS;) {
        const char *n = e->d_name;
        size_t len = strlen(n);
        if (len > 5 && isdigit((unsigned char)n[0]) && isdigit((unsigned char)n[1]) && n[2] == '-' && !strcmp(n + len - 2, ".c"))
            names[nf++] = strdup(n);
    }
    closedir(d);
    qsort(names, (size_t)nf, sizeof names[0], by_name);
    names[nf++] = strdup("helpers.c");           /* they define no test, and sort after the chapters' files */
    names[nf++] = strdup("main.c");
    static char defined[T_MAX_TESTS][96], where[T_MAX_TESTS][64];
    int nd = 0;
    for (int f = 0; f < nf; f++) {
        snprintf(path, sizeof path, "%s/tests/%s", repo_root(), names[f]);
        char *text = read_text(path), *src = text ? (char *)malloc(strlen(text) + 2) : NULL;
        CHECKF(src != NULL, "cannot read %s", path);
        if (src) sprintf(src, "\n%s", text);   /* a TEST( on the first line too */
        for (const char *p = src; p && (p = strstr(p, "\nTEST(")) && nd < T_MAX_TESTS; p++) {
            snprintf(where[nd], sizeof where[nd], "%s", names[f]);
            sscanf(p + 6, "%95[a-z0-9_]", defined[nd++]);
        }
        for (const char *p = src; p && (p = strstr(p, "\nstatic void test_")); p++)
            CHECKF(0, "tests/%s: %.*s: a test function outside TEST(), which no suite runs", names[f], (int)strcspn(p + 1, "("), p + 1);
        free(text);
        free(src);
        free(names[f]);
    }
    int st = run_cmd(out, sizeof out, "%s --list --suite all", self_bin);
    CHECKF(st == 0, "--list --suite all: exit %d\n%.2000s", st, out);
    int nl = 0;
    for (char *line = strtok(out, "\n"); line; line = strtok(NULL, "\n"), nl++)
        if (nl < nd && strcmp(line, defined[nl])) {
            CHECKF(0, "the runner lists %s in place %d, but tests/%s defines %s there (is the file compiled?)", line, nl + 1,
                   where[nl], defined[nl]);
            break;
        }
    CHECKF(nd == nl && nd > 100, "%d tests defined with TEST(), %d listed", nd, nl);
    /* the two suites together are the whole (a test in both or neither stops the runner before main) */
    char quick[32768], full[32768];
    int qs = run_cmd(quick, sizeof quick, "%s --list --suite quick", self_bin), fs = run_cmd(full, sizeof full, "%s --list --suite full", self_bin);
    CHECKF(qs == 0 && fs == 0, "--list --suite quick: exit %d; full: exit %d", qs, fs);
    for (int i = 0; i < nd; i++)
        CHECKF(has_line(quick, defined[i]) || has_line(full, defined[i]), "%s is in neither suite's list", defined[i]);
}
