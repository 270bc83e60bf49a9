#!/usr/bin/awk -f
# Reads "bench:" lines (key=value pairs), prints each as it comes, then a
# table: per stage and workload, samples/s at 1, 2 and 4 ranks (devices in
# 02), speedup and efficiency against the same stage at 1, and where the time
# went, and the largest rank's peak memory: all device arenas; "state", the
# parameters, gradients and optimizer state that FSDP shards; "host", offloaded.
# Runs with more ranks x threads than cores are marked oversubscribed.
# usage: ... | tools/bench_table.awk -v cores=N
function val(key,   i, kv) {
    for (i = 2; i <= NF; i++) { split($i, kv, "="); if (kv[1] == key) return kv[2] }
    return ""
}
/^bench:/ {
    print; fflush()
    n = ++rows
    stage[n] = val("stage"); work[n] = val("workload"); ranks[n] = val("ranks") + 0; threads[n] = val("threads") + 0
    rate[n] = val("samples_per_s") + 0
    compute[n] = val("fwd_ms") + val("bwd_ms") + val("opt_ms")
    comm[n] = val("comm_ms") + 0; hidden[n] = val("comm_hidden_ms") + 0
    peak[n] = val("peak_mem_mb") + 0; state[n] = val("peak_state_mb") + 0; host[n] = val("peak_host_mb") + 0
    next
}
{ print }
END {
    printf "\n%-34s %-9s %5s %7s %10s %8s %10s %10s %8s %7s %8s %8s %8s  %s\n", "stage", "workload", "ranks", "threads",
           "samples/s", "speedup", "efficiency", "compute ms", "comm ms", "hidden", "peak MB", "state MB", "host MB", "note"
    for (i = 1; i <= rows; i++) {
        base = 0
        for (j = 1; j <= rows && !base; j++)
            if (stage[j] == stage[i] && work[j] == work[i] && ranks[j] == 1 && (ranks[i] > 1 || threads[j] == threads[i]))
                base = rate[j]
        sp = base > 0 ? rate[i] / base : 0
        note = ranks[i] * threads[i] > cores ? "oversubscribed: " ranks[i] " x " threads[i] " threads on " cores " cores" : ""
        printf "%-34s %-9s %5d %7d %10.1f %7.2fx %9.0f%% %10.1f %8.1f %7.1f %8.1f %8.1f %8.1f  %s\n", stage[i], work[i], ranks[i],
               threads[i], rate[i], sp, 100 * sp / ranks[i], compute[i], comm[i], hidden[i], peak[i], state[i], host[i], note
    }
}
