/* tests/fuzz/cifar.c -- a CIFAR-10 binary batch: records of a label byte and
   3,072 pixel bytes (the input as test_batch.bin, the validation split). */
static void fuzz_cifar(const uint8_t *data, size_t n) {
    fuzz_file("data_batch_1.bin", data, n);
    fuzz_file("test_batch.bin", data, n);
    dt_dataset ds;
    dt_dataset_load(fuzz_dir, "val", 8, NULL, &ds);
    dt_dataset_free(&ds);
}
