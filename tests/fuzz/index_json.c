/* tests/fuzz/index_json.c -- model.safetensors.index.json: the weight map
   that names a sharded folder's files. */
static void fuzz_index_json(const uint8_t *data, size_t n) {
    char path[200];
    snprintf(path, sizeof path, "%s/model.safetensors", fuzz_dir);
    unlink(path);                                            /* the index is read only without one */
    fuzz_file("model.safetensors.index.json", data, n);
    char **files = NULL;
    int count = dt__hf_weight_files(fuzz_dir, &files);
    for (int i = 0; i < count; i++) free(files[i]);
    free(files);
}
