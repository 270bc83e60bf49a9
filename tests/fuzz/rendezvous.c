/* tests/fuzz/rendezvous.c -- the rendezvous's messages as they arrive from the
   network: a hello (what rank 0 admits) or a welcome (what a rank accepts
   before it maps anything), with and without a job secret. The first byte
   picks which; the rest is the message, cut short or padded with zeros. */
static void fuzz_rendezvous(const uint8_t *data, size_t n) {
    static const uint64_t key[2] = { 1, 2 };
    unsigned char nonce[16] = { 7 };
    if (n == 0) return;
    int hello = data[0] & 1, secret = data[0] & 2;
    data++, n--;
    if (hello) {
        dt__pending p;
        int joined[4] = { 0, 0, 1, 0 };
        dt__host hosts[4];
        memset(&p, 0, sizeof p);
        p.fd = -1;                                           /* a refusal goes nowhere */
        memcpy(p.nonce, nonce, sizeof nonce);
        memcpy(&p.h, data, n < sizeof p.h ? n : sizeof p.h);
        if (memcmp(p.h.magic, DT_RDZV_MAGIC, 8)) return;     /* turned away before it is read */
        dt__rendezvous_admit(&p, "SLURM_JOB_ID=1", secret ? key : NULL, 4, joined, hosts);
    } else {
        dt__welcome w;
        memset(&w, 0, sizeof w);
        memcpy(&w, data, n < sizeof w ? n : sizeof w);
        dt__welcome_check(&w, secret ? key : NULL, nonce, "fuzz", 1, "MASTER_PORT");
    }
}
