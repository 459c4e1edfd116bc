/* Loader and packet runner for the XDP tier (src/aleph_xdp.bpf.c), with libbpf.
 *
 *   aleph_xdp_run OBJ --port P --job J --iters K --elems E --children N --my-id I
 *                     --parent-ip A.B.C.D --parent-port P --parent-mac aa:bb:cc:dd:ee:ff
 *
 * Loads the object (the kernel's verifier checks every packet access), fills the config map, then reads frames from
 * stdin -- each a little-endian uint32 length and that many bytes of Ethernet frame -- and runs the program on each
 * with BPF_PROG_TEST_RUN (the kernel runs it on a copy of the frame, no interface involved). Per frame it prints a
 * JSON line {"verdict": "DROP|PASS|TX|...", "ns": run time, "out": hex of the frame after the program}; at the end
 * {"counters": {...}} (summed over CPUs). Exit 0 when everything ran; 3 when the object cannot be loaded (the reason
 * on stderr: flowlane/aleph/xdp.py skips on it); 2 for a bad command line (naming the value).
 */
#include <arpa/inet.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <bpf/bpf.h>
#include <bpf/libbpf.h>

struct cfg { /* struct aleph_xdp_cfg in aleph_xdp.bpf.c */
    uint32_t configured;
    uint16_t port, job;
    uint32_t iters, elems, nchildren, my_id, parent_ip;
    uint16_t parent_port;
    uint8_t parent_mac[6];
};

static const char *const COUNTERS[] = {"rx",        "added",     "tx_up",       "pass",      "bad_len",
                                       "bad_magic", "bad_version", "bad_type",  "bad_job",   "bad_flags",
                                       "bad_iter",  "bad_src",   "bad_seg",     "bad_count", "bad_scale",
                                       "dup",       "stale",     "overflow",    "not_configured"};
#define NCOUNTERS (sizeof COUNTERS / sizeof *COUNTERS)

static unsigned long parse_num(const char *what, const char *s, unsigned long lo, unsigned long hi) {
    char *end;
    errno = 0;
    unsigned long v = strtoul(s, &end, 10);
    if (errno || *s == '\0' || *end != '\0' || v < lo || v > hi) {
        fprintf(stderr, "aleph_xdp_run: %s=%s is not an integer in [%lu, %lu]\n", what, s, lo, hi);
        exit(2);
    }
    return v;
}

static const char *verdict_name(uint32_t v) {
    static const char *const names[] = {"ABORTED", "DROP", "PASS", "TX", "REDIRECT"};
    return v < 5 ? names[v] : "UNKNOWN";
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: aleph_xdp_run OBJ --port P --job J --iters K --elems E --children N --my-id I "
                        "--parent-ip A.B.C.D --parent-port P --parent-mac aa:bb:cc:dd:ee:ff\n");
        return 2;
    }
    struct cfg c = {.configured = 1};
    for (int i = 2; i < argc; i += 2) {
        if (i + 1 >= argc) {
            fprintf(stderr, "aleph_xdp_run: %s needs a value\n", argv[i]);
            return 2;
        }
        const char *k = argv[i], *v = argv[i + 1];
        if (!strcmp(k, "--port"))
            c.port = (uint16_t)parse_num(k, v, 1, 65535);
        else if (!strcmp(k, "--job"))
            c.job = (uint16_t)parse_num(k, v, 0, 65535);
        else if (!strcmp(k, "--iters"))
            c.iters = (uint32_t)parse_num(k, v, 1, 0xffffffffu);
        else if (!strcmp(k, "--elems"))
            c.elems = (uint32_t)parse_num(k, v, 1, 8192u * 128u);
        else if (!strcmp(k, "--children"))
            c.nchildren = (uint32_t)parse_num(k, v, 1, 32);
        else if (!strcmp(k, "--my-id"))
            c.my_id = (uint32_t)parse_num(k, v, 0, 31);
        else if (!strcmp(k, "--parent-port"))
            c.parent_port = htons((uint16_t)parse_num(k, v, 1, 65535));
        else if (!strcmp(k, "--parent-ip")) {
            struct in_addr a;
            if (inet_pton(AF_INET, v, &a) != 1) {
                fprintf(stderr, "aleph_xdp_run: --parent-ip=%s is not an IPv4 address\n", v);
                return 2;
            }
            c.parent_ip = a.s_addr;
        } else if (!strcmp(k, "--parent-mac")) {
            unsigned m[6];
            char tail;
            if (sscanf(v, "%x:%x:%x:%x:%x:%x%c", &m[0], &m[1], &m[2], &m[3], &m[4], &m[5], &tail) != 6) {
                fprintf(stderr, "aleph_xdp_run: --parent-mac=%s is not aa:bb:cc:dd:ee:ff\n", v);
                return 2;
            }
            for (int j = 0; j < 6; j++)
                c.parent_mac[j] = (uint8_t)m[j];
        } else {
            fprintf(stderr, "aleph_xdp_run: unknown option %s\n", k);
            return 2;
        }
    }
    if (!c.port || !c.iters || !c.elems || !c.nchildren || !c.parent_ip || !c.parent_port) {
        fprintf(stderr, "aleph_xdp_run: --port, --iters, --elems, --children, --parent-ip and --parent-port are "
                        "required\n");
        return 2;
    }
    libbpf_set_strict_mode(LIBBPF_STRICT_ALL);
    struct bpf_object *obj = bpf_object__open_file(argv[1], NULL);
    if (!obj) {
        fprintf(stderr, "aleph_xdp_run: cannot open %s: %s\n", argv[1], strerror(errno));
        return 3;
    }
    int err = bpf_object__load(obj);
    if (err) {
        fprintf(stderr, "aleph_xdp_run: the kernel refused to load %s: %s\n", argv[1], strerror(-err));
        return 3;
    }
    struct bpf_program *prog = bpf_object__find_program_by_name(obj, "aleph_xdp");
    int cfg_fd = bpf_object__find_map_fd_by_name(obj, "aleph_cfg");
    int cnt_fd = bpf_object__find_map_fd_by_name(obj, "aleph_counters");
    if (!prog || cfg_fd < 0 || cnt_fd < 0) {
        fprintf(stderr, "aleph_xdp_run: %s lacks the program aleph_xdp or its maps\n", argv[1]);
        return 3;
    }
    uint32_t zero = 0;
    if (bpf_map_update_elem(cfg_fd, &zero, &c, BPF_ANY)) {
        fprintf(stderr, "aleph_xdp_run: cannot write the config map: %s\n", strerror(errno));
        return 3;
    }
    int prog_fd = bpf_program__fd(prog);
    unsigned char in[2048], out[2048];
    uint32_t len;
    while (fread(&len, sizeof len, 1, stdin) == 1) {
        if (len == 0 || len > sizeof in || fread(in, 1, len, stdin) != len) {
            fprintf(stderr, "aleph_xdp_run: frame of %u bytes: empty, over %zu bytes or cut short\n", len,
                    sizeof in);
            return 2;
        }
        LIBBPF_OPTS(bpf_test_run_opts, t, .data_in = in, .data_size_in = len, .data_out = out,
                    .data_size_out = sizeof out, .repeat = 1);
        if (bpf_prog_test_run_opts(prog_fd, &t)) {
            fprintf(stderr, "aleph_xdp_run: BPF_PROG_TEST_RUN failed: %s\n", strerror(errno));
            return 3;
        }
        printf("{\"verdict\": \"%s\", \"ns\": %u, \"out\": \"", verdict_name(t.retval), t.duration);
        for (uint32_t j = 0; j < t.data_size_out && j < sizeof out; j++)
            printf("%02x", out[j]);
        printf("\"}\n");
    }
    int ncpu = libbpf_num_possible_cpus();
    if (ncpu <= 0) {
        fprintf(stderr, "aleph_xdp_run: cannot count the CPUs\n");
        return 3;
    }
    uint64_t *per = calloc((size_t)ncpu, sizeof *per);
    printf("{\"counters\": {");
    for (uint32_t k = 0; k < NCOUNTERS; k++) {
        uint64_t sum = 0;
        if (per && bpf_map_lookup_elem(cnt_fd, &k, per) == 0)
            for (int j = 0; j < ncpu; j++)
                sum += per[j];
        printf("%s\"%s\": %llu", k ? ", " : "", COUNTERS[k], (unsigned long long)sum);
    }
    printf("}}\n");
    free(per);
    bpf_object__close(obj);
    return 0;
}
