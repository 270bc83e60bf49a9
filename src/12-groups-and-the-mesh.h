//@ lesson: groups and the mesh -- communicators of some of the ranks (dt_comm_split); the ranks as a grid of named dimensions, a group along each (dt_mesh_create)
/* ---- groups and the mesh -----------------------------------------------------
   Tensor, pipeline, context and expert parallelism each talk within a group
   of the ranks (the pair that splits a layer, the stages of one pipeline),
   while data parallelism talks across those groups. A group is a
   communicator of its own -- its own queue and communication thread, and on
   the CPU its own shared memory -- so that the groups of a mesh run their
   collectives side by side. The mesh names the dimensions, so that a stage
   asks for "tp" or "dp" rather than computing which ranks are which. */

/* Groups: collective over comm; the ranks that pass the same color (>= 0) form a
   new communicator, ranked by (key, rank in comm). It has its own queue and, on
   the CPU, its own shared memory, so groups run side by side; a rank that dies
   still stops the whole job. Free it with dt_comm_free before comm. */
dt_comm *dt_comm_split(dt_comm *comm, int color, int key);

/* Which machine rank `rank` of comm runs on: 0, 1, ... numbered by their
   first job rank, as the launcher placed the ranks (ranks on one machine share
   its memory; the run driver sees it at the rendezvous). Hierarchical
   collectives (ZeRO++, the FSDP chapter) talk within a machine first. */
int dt_comm_machine(const dt_comm *comm, int rank);

/* A mesh: the ranks of comm as a grid of named dimensions, the last varying
   fastest (a 2 x 2 "dp" x "tp" mesh: ranks 0, 1 are one tensor-parallel pair,
   ranks 0, 2 one data-parallel pair). Each dimension gets a communicator of the
   ranks that differ only along it. The sizes must multiply to comm's size. */
typedef struct dt_mesh dt_mesh;
#define DT_MESH_MAX_DIMS 4
dt_mesh *dt_mesh_create(dt_comm *comm, int ndims, const int *sizes, const char *const *names);
dt_comm *dt_mesh_comm(const dt_mesh *mesh, const char *name);   /* the group along `name` */
int dt_mesh_coord(const dt_mesh *mesh, const char *name);       /* this rank's place along it */
void dt_mesh_free(dt_mesh *mesh);                               /* frees its communicators */

//@ implementation
/* Groups: what each rank tells the others when a communicator splits. The
   first rank of each group makes its shared memory; the name follows from the
   maker's pid and serial, so one exchange is enough. */
typedef struct { int32_t color, key, pid, serial; } dt__split_entry;
/* Every rank's entry, through memory of the kind the transport takes, given
   back at once: not the step arena, which a thread rank that splits and then
   ends would leave behind. */
static void dt__split_gather(dt_comm *comm, const dt__split_entry *mine, dt__split_entry *all) {
    dt_device memory = comm->backend->memory;
    size_t one = sizeof *mine, bytes = one * (size_t)(comm->world + 1);
    char *buf = (char *)dt_alloc_on(memory, DT_ARENA_COMM, bytes);
    dt__upload_to(memory, buf, mine, one);
    dt_all_gather(comm, buf, buf + one, (int64_t)(one / 4), DT_F32);      /* bytes travel as they are */
    dt__download_from(memory, all, buf + one, bytes - one);
    dt_free_on(memory, DT_ARENA_COMM, buf, bytes);
}
static int dt__split_before(const dt__split_entry *all, int a, int b) {
    return all[a].key != all[b].key ? all[a].key < all[b].key : a < b;
}
int dt_comm_machine(const dt_comm *comm, int rank) {
    if (rank < 0 || rank >= comm->world) dt_fail("dt_comm_machine: rank %d of a communicator of %d", rank, comm->world);
    return comm->top->machine[comm->job_rank[rank]];
}
dt_comm *dt_comm_split(dt_comm *comm, int color, int key) {
    if (color < 0) dt_fail("dt_comm_split: color %d; a color is a number >= 0 naming the group to join", color);
    dt__split_entry mine = { color, key, (int32_t)getpid(), __atomic_fetch_add(&dt__shm_serial, 1, __ATOMIC_RELAXED) };
    dt__split_entry *all = (dt__split_entry *)calloc((size_t)comm->world, sizeof *all);
    if (!all) dt_fail("out of memory (dt_comm_split)");
    dt__split_gather(comm, &mine, all);
    int members[DT_MAX_RANKS], n = 0, rank = 0;
    for (int r = 0; r < comm->world; r++) {           /* insertion sort by (key, rank) */
        if (all[r].color != color) continue;
        int i = n++;
        for (; i > 0 && dt__split_before(all, r, members[i - 1]); i--) members[i] = members[i - 1];
        members[i] = r;
    }
    dt_comm *child = dt__comm_new(0, n, comm->timeout_s);
    for (int i = 0; i < n; i++) {
        if (members[i] == comm->rank) rank = i;
        child->job_rank[i] = comm->job_rank[members[i]];
    }
    child->rank = rank; child->backend = comm->backend; child->top = comm->top; child->parent = comm;
    if (!comm->backend->shares_memory) {     /* ranks that share no memory make groups that share none */
        free(all);
        comm->backend->split(comm, child, color, key);
        comm->children++;
        dt__comm_start(child, dt__private_header(child));
        return child;
    }
    char name[96];
    dt__path(name, sizeof name, "/dtrain-%d-%d-%d", (int)getuid(), all[members[0]].pid, all[members[0]].serial);
    child->map_bytes = dt__shm_bytes(n);
    int cleanup = -1;
    if (rank == 0) {
        child->hdr = dt__shm_map(name, child->map_bytes, 1, &cleanup);
        child->hdr->magic = DT_SHM_MAGIC;
        child->hdr->world = n;
    }
    dt_barrier(comm);                        /* every group's memory is made: open it */
    if (rank != 0) child->hdr = dt__shm_map(name, child->map_bytes, 0, NULL);
    dt_barrier(comm);                        /* every rank has mapped it: its name can go */
    if (rank == 0) { shm_unlink(name); dt__cleanup_done(cleanup); }
    free(all);
    comm->backend->split(comm, child, color, key);
    comm->children++;
    dt__comm_start(child, child->hdr);
    return child;
}

/* ---- a mesh: ranks as a grid of named dimensions ---- */
struct dt_mesh {
    int ndims, size[DT_MESH_MAX_DIMS], coord[DT_MESH_MAX_DIMS];
    char name[DT_MESH_MAX_DIMS][16];
    dt_comm *comm[DT_MESH_MAX_DIMS];
};
/* "dp=2 x tp=2", for messages. */
static void dt__mesh_describe(const dt_mesh *m, char *out, size_t n) {
    out[0] = 0;
    for (int d = 0; d < m->ndims; d++)
        snprintf(out + strlen(out), n - strlen(out), "%s%s=%d", d ? " x " : "", m->name[d], m->size[d]);
}
dt_mesh *dt_mesh_create(dt_comm *comm, int ndims, const int *sizes, const char *const *names) {
    if (ndims < 1 || ndims > DT_MESH_MAX_DIMS) dt_fail("dt_mesh_create: %d dimensions (1 to %d)", ndims, DT_MESH_MAX_DIMS);
    dt_mesh *m = (dt_mesh *)calloc(1, sizeof *m);
    if (!m) dt_fail("out of memory (mesh)");
    int64_t ranks = 1;
    for (int d = 0; d < ndims; d++) {
        if (sizes[d] < 1 || !names[d] || !names[d][0] || strlen(names[d]) >= sizeof m->name[d])
            dt_fail("dt_mesh_create: dimension %d has size %d and name '%s'; it needs a size >= 1 and a name of 1 to %zu "
                    "characters", d, sizes[d], names[d] ? names[d] : "(null)", sizeof m->name[d] - 1);
        for (int e = 0; e < d; e++)
            if (!strcmp(m->name[e], names[d])) dt_fail("dt_mesh_create: two dimensions are named '%s'", names[d]);
        dt__copy_str(m->name[d], sizeof m->name[d], names[d]);
        m->size[d] = sizes[d];
        m->ndims = d + 1;
        ranks *= sizes[d];
        if (ranks > DT_MAX_RANKS) break;
    }
    char shape[128];
    dt__mesh_describe(m, shape, sizeof shape);
    if (ranks != comm->world)
        dt_fail("dt_mesh_create: a %s mesh has %lld%s ranks, but the communicator has %d: the sizes must multiply to "
                "its size", shape, (long long)ranks, ranks > DT_MAX_RANKS ? " or more" : "", comm->world);
    int stride[DT_MESH_MAX_DIMS];
    for (int d = ndims - 1; d >= 0; d--) {
        stride[d] = d == ndims - 1 ? 1 : stride[d + 1] * m->size[d + 1];
        m->coord[d] = comm->rank / stride[d] % m->size[d];
    }
    /* Along d, the ranks that share every other coordinate: the same rank
       once its own coordinate is set to 0. The same order on every rank, as
       each split is collective. */
    for (int d = 0; d < ndims; d++) {
        m->comm[d] = dt_comm_split(comm, comm->rank - m->coord[d] * stride[d], m->coord[d]);
        m->comm[d]->in_mesh = 1;
    }
    return m;
}
static int dt__mesh_dim(const dt_mesh *m, const char *name) {
    for (int d = 0; d < m->ndims; d++)
        if (!strcmp(m->name[d], name)) return d;
    char shape[128];
    dt__mesh_describe(m, shape, sizeof shape);
    dt_fail("dt_mesh: no dimension named '%s' in this %s mesh", name, shape);
}
dt_comm *dt_mesh_comm(const dt_mesh *mesh, const char *name) { return mesh->comm[dt__mesh_dim(mesh, name)]; }
int dt_mesh_coord(const dt_mesh *mesh, const char *name) { return mesh->coord[dt__mesh_dim(mesh, name)]; }
void dt_mesh_free(dt_mesh *mesh) {
    if (!mesh) return;
    for (int d = mesh->ndims - 1; d >= 0; d--) {
        mesh->comm[d]->in_mesh = 0;
        dt_comm_free(mesh->comm[d]);
    }
    free(mesh);
}

