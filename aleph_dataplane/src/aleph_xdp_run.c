/* Loader and packet runner for the XDP tier (src/aleph_xdp.bpf.c), with libbpf.
 *
 *   aleph_xdp_run OBJ --port P --job J --iters K --elems E --children N --my-id I
 *                     --parent-ip A.B.C.D --parent-port P --parent-mac aa:bb:cc:dd:ee:ff
 *                     [--child-addrs IP:PORT,...] [--attach IFNAME [--xdp-mode auto|native|skb]]
 *   aleph_xdp_run OBJ --prog aleph_xdp_pass --attach IFNAME [--xdp-mode ...]
 *
 * Loads the object (the kernel's verifier checks every packet access) and fills the config map; --child-addrs (one
 * IPV4:PORT per child, in src id order, as the relay node takes them) pins each child id to its source address in the
 * program's aleph_children map: without it each id is pinned by its first valid DATA. Then either
 *
 * - (no --attach) reads frames from stdin -- each a little-endian uint32 length and that many bytes of Ethernet
 *   frame -- and runs the program on each with BPF_PROG_TEST_RUN (the kernel runs it on a copy of the frame, no
 *   interface involved). Per frame it prints a JSON line {"verdict": "DROP|PASS|TX|...", "ns": run time, "out": hex
 *   of the frame after the program}; at the end {"counters": {...}} (summed over CPUs); or
 * - (--attach IFNAME) attaches the program to that interface of the caller's network namespace through a BPF link
 *   (bpf_link_create with the XDP mode flag: the kernel detaches it when this process exits, however it exits):
 *   native (driver) mode, or generic (SKB) mode, or auto = native where the driver takes it, else generic. It prints
 *   {"attached": IFNAME, "mode": "native|skb", ...}, keeps the program attached until stdin is closed (or a line is
 *   read), then prints {"counters": {...}, "run_cnt": N, "run_time_ns": T} -- the kernel's own count and total run
 *   time of the program (BPF_ENABLE_STATS, held while attached) -- and detaches.
 *
 * --prog names the program (aleph_xdp, the aggregator; aleph_xdp_pass for a veth peer: see aleph_xdp.bpf.c); only
 * that one is loaded. Exit 0 when everything ran; 3 when the object cannot be loaded or attached (the reason on
 * stderr: flowlane/aleph/xdp.py skips on it); 2 for a bad command line (naming the value).
 */
#include <arpa/inet.h>
#include <errno.h>
#include <linux/if_link.h>
#include <net/if.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <bpf/bpf.h>
#include <bpf/libbpf.h>

struct cfg { /* struct aleph_xdp_cfg in aleph_xdp.bpf.c */
    uint32_t configured;
    uint16_t port, job;
    uint32_t iters, elems, nchildren, my_id, parent_ip;
    uint16_t parent_port;
    uint8_t parent_mac[6];
};

struct child_addr { /* struct child_addr in aleph_xdp.bpf.c (the kernel leaves the lock word alone on an update) */
    uint32_t lock;
    uint32_t ip;   /* network order */
    uint16_t port; /* network order */
    uint16_t pinned;
};

static const char *const COUNTERS[] = {"rx",        "added",     "tx_up",       "pass",      "bad_len",
                                       "bad_magic", "bad_version", "bad_type",  "bad_job",   "bad_flags",
                                       "bad_iter",  "bad_src",   "bad_seg",     "bad_count", "bad_scale",
                                       "dup",       "stale",     "overflow",    "not_configured",
                                       "resent_up", "bad_addr"};
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

/* --child-addrs: "IPV4:PORT,..." into kids[], the count into *n (exit 2 naming the value when malformed). */
static void parse_child_addrs(const char *v, struct child_addr *kids, uint32_t *n) {
    *n = 0;
    for (const char *a = v; a; a = strchr(a, ',') ? strchr(a, ',') + 1 : NULL) {
        char one[64], *colon;
        size_t len = strcspn(a, ",");
        struct in_addr ip;
        if (*n == 32 || len == 0 || len >= sizeof one) {
            fprintf(stderr, "aleph_xdp_run: --child-addrs=%s: more than 32, an empty or an overlong address\n", v);
            exit(2);
        }
        memcpy(one, a, len);
        one[len] = 0;
        if (!(colon = strrchr(one, ':'))) {
            fprintf(stderr, "aleph_xdp_run: --child-addrs=%s: %s is not IPV4:PORT\n", v, one);
            exit(2);
        }
        *colon = 0;
        if (inet_pton(AF_INET, one, &ip) != 1) {
            fprintf(stderr, "aleph_xdp_run: --child-addrs=%s: %s is not an IPv4 address\n", v, one);
            exit(2);
        }
        kids[*n] = (struct child_addr){.ip = ip.s_addr,
                                       .port = htons((uint16_t)parse_num("--child-addrs port", colon + 1, 1, 65535)),
                                       .pinned = 1};
        (*n)++;
    }
}

static const char *verdict_name(uint32_t v) {
    static const char *const names[] = {"ABORTED", "DROP", "PASS", "TX", "REDIRECT"};
    return v < 5 ? names[v] : "UNKNOWN";
}

/* {"counters": {...}} summed over CPUs, and with a prog_fd >= 0 the program's run count and time (BPF stats). */
static int print_counters(int cnt_fd, int prog_fd) {
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
    printf("}");
    if (prog_fd >= 0) {
        struct bpf_prog_info info;
        uint32_t len = sizeof info;
        memset(&info, 0, sizeof info);
        if (bpf_obj_get_info_by_fd(prog_fd, &info, &len) == 0)
            printf(", \"run_cnt\": %llu, \"run_time_ns\": %llu", (unsigned long long)info.run_cnt,
                   (unsigned long long)info.run_time_ns);
    }
    printf("}\n");
    fflush(stdout);
    free(per);
    return 0;
}

/* Attach through a BPF link in the asked mode ("auto": native, else generic), report, wait for stdin, detach. */
static int attached(int prog_fd, unsigned ifindex, const char *ifname, const char *mode) {
    int stats_fd = bpf_enable_stats(BPF_STATS_RUN_TIME); /* run_cnt / run_time_ns while held; -1: not counted */
    const char *got = NULL, *native_err = "";
    int link = -1;
    char why[160] = "";
    if (strcmp(mode, "skb")) {
        LIBBPF_OPTS(bpf_link_create_opts, o, .flags = XDP_FLAGS_DRV_MODE);
        link = bpf_link_create(prog_fd, (int)ifindex, BPF_XDP, &o);
        if (link >= 0)
            got = "native";
        else {
            snprintf(why, sizeof why, "%s", strerror(errno));
            native_err = why;
        }
    }
    if (link < 0 && strcmp(mode, "native")) {
        LIBBPF_OPTS(bpf_link_create_opts, o, .flags = XDP_FLAGS_SKB_MODE);
        link = bpf_link_create(prog_fd, (int)ifindex, BPF_XDP, &o);
        if (link >= 0)
            got = "skb";
    }
    if (link < 0) {
        fprintf(stderr, "aleph_xdp_run: cannot attach to %s in %s mode: %s%s%s\n", ifname, mode, strerror(errno),
                *native_err ? " (native: " : "", *native_err ? native_err : "");
        if (*native_err)
            fprintf(stderr, ")\n");
        return 3;
    }
    printf("{\"attached\": \"%s\", \"ifindex\": %u, \"mode\": \"%s\", \"native_error\": \"%s\", "
           "\"stats\": %s}\n",
           ifname, ifindex, got, native_err, stats_fd >= 0 ? "true" : "false");
    fflush(stdout);
    char line[64];
    (void)!fgets(line, sizeof line, stdin); /* a line or EOF: the caller is done */
    close(link);
    if (stats_fd >= 0)
        close(stats_fd);
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: aleph_xdp_run OBJ --port P --job J --iters K --elems E --children N --my-id I "
                        "--parent-ip A.B.C.D --parent-port P --parent-mac aa:bb:cc:dd:ee:ff "
                        "[--child-addrs IP:PORT,...]\n");
        return 2;
    }
    struct cfg c = {.configured = 1};
    struct child_addr kids[32];
    uint32_t nkids = 0;
    const char *kids_arg = NULL;
    const char *prog_name = "aleph_xdp", *ifname = NULL, *mode = "auto";
    for (int i = 2; i < argc; i += 2) {
        if (i + 1 >= argc) {
            fprintf(stderr, "aleph_xdp_run: %s needs a value\n", argv[i]);
            return 2;
        }
        const char *k = argv[i], *v = argv[i + 1];
        if (!strcmp(k, "--prog")) {
            if (strcmp(v, "aleph_xdp") && strcmp(v, "aleph_xdp_pass")) {
                fprintf(stderr, "aleph_xdp_run: --prog=%s is not aleph_xdp or aleph_xdp_pass\n", v);
                return 2;
            }
            prog_name = v;
        } else if (!strcmp(k, "--attach"))
            ifname = v;
        else if (!strcmp(k, "--xdp-mode")) {
            if (strcmp(v, "auto") && strcmp(v, "native") && strcmp(v, "skb")) {
                fprintf(stderr, "aleph_xdp_run: --xdp-mode=%s is not auto, native or skb\n", v);
                return 2;
            }
            mode = v;
        } else if (!strcmp(k, "--port"))
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
        else if (!strcmp(k, "--child-addrs")) {
            parse_child_addrs(v, kids, &nkids);
            kids_arg = v;
        } else if (!strcmp(k, "--parent-ip")) {
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
    int aggregator = !strcmp(prog_name, "aleph_xdp");
    if (!aggregator && !ifname) {
        fprintf(stderr, "aleph_xdp_run: --prog=%s runs attached only (give --attach IFNAME)\n", prog_name);
        return 2;
    }
    unsigned ifindex = 0;
    if (ifname && !(ifindex = if_nametoindex(ifname))) {
        fprintf(stderr, "aleph_xdp_run: --attach=%s is not an interface of this network namespace\n", ifname);
        return 2;
    }
    if (aggregator && (!c.port || !c.iters || !c.elems || !c.nchildren || !c.parent_ip || !c.parent_port)) {
        fprintf(stderr, "aleph_xdp_run: --port, --iters, --elems, --children, --parent-ip and --parent-port are "
                        "required\n");
        return 2;
    }
    if (kids_arg && (!aggregator || nkids != c.nchildren)) {
        fprintf(stderr, "aleph_xdp_run: --child-addrs=%s needs --prog aleph_xdp and one address per child "
                        "(--children=%u)\n", kids_arg, c.nchildren);
        return 2;
    }
    libbpf_set_strict_mode(LIBBPF_STRICT_ALL);
    struct bpf_object *obj = bpf_object__open_file(argv[1], NULL);
    if (!obj) {
        fprintf(stderr, "aleph_xdp_run: cannot open %s: %s\n", argv[1], strerror(errno));
        return 3;
    }
    struct bpf_program *p;
    bpf_object__for_each_program(p, obj) bpf_program__set_autoload(p, !strcmp(bpf_program__name(p), prog_name));
    int err = bpf_object__load(obj);
    if (err) {
        fprintf(stderr, "aleph_xdp_run: the kernel refused to load %s: %s\n", argv[1], strerror(-err));
        return 3;
    }
    struct bpf_program *prog = bpf_object__find_program_by_name(obj, prog_name);
    int cfg_fd = bpf_object__find_map_fd_by_name(obj, "aleph_cfg");
    int cnt_fd = bpf_object__find_map_fd_by_name(obj, "aleph_counters");
    int kids_fd = bpf_object__find_map_fd_by_name(obj, "aleph_children");
    if (!prog || cfg_fd < 0 || cnt_fd < 0 || kids_fd < 0) {
        fprintf(stderr, "aleph_xdp_run: %s lacks the program %s or its maps\n", argv[1], prog_name);
        return 3;
    }
    uint32_t zero = 0;
    for (uint32_t k = 0; k < nkids; k++) /* the children's sources, when given: pinned before any packet runs */
        if (bpf_map_update_elem(kids_fd, &k, &kids[k], BPF_ANY)) {
            fprintf(stderr, "aleph_xdp_run: cannot write the children map: %s\n", strerror(errno));
            return 3;
        }
    if (aggregator && bpf_map_update_elem(cfg_fd, &zero, &c, BPF_ANY)) {
        fprintf(stderr, "aleph_xdp_run: cannot write the config map: %s\n", strerror(errno));
        return 3;
    }
    int prog_fd = bpf_program__fd(prog);
    if (ifname) {
        int rc = attached(prog_fd, ifindex, ifname, mode);
        if (rc == 0 && aggregator)
            print_counters(cnt_fd, prog_fd);
        else if (rc == 0)
            printf("{\"counters\": {}}\n");
        bpf_object__close(obj); /* closes the link: the program is detached */
        return rc;
    }
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
    if (print_counters(cnt_fd, -1))
        return 3;
    bpf_object__close(obj);
    return 0;
}
