/*
 * plain_stream.c - the baseline for the throughput benchmark: one blocking
 * TCP socket, sender writes ITERS messages of BYTES, receiver reads them into
 * one buffer. Same message/warm-up accounting as fl_driver bench-stream.
 *   plain_stream BYTES ITERS   (forks receiver + sender over 127.0.0.1)
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void die(const char* what) {
  perror(what);
  exit(1);
}

int main(int argc, char** argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: plain_stream BYTES ITERS\n");
    return 2;
  }
  size_t bytes = strtoull(argv[1], NULL, 0);
  int iters = atoi(argv[2]);
  if (bytes == 0 || iters < 2) return 2;
  int ls = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t al = sizeof(a);
  if (ls < 0 || bind(ls, (struct sockaddr*)&a, sizeof(a)) || listen(ls, 1) || getsockname(ls, (struct sockaddr*)&a, &al))
    die("listen");
  uint8_t* buf = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (buf == MAP_FAILED) die("mmap");
  memset(buf, 2, bytes);
  pid_t pid = fork();
  if (pid == 0) { /* sender */
    int s = socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    if (connect(s, (struct sockaddr*)&a, sizeof(a))) die("connect");
    for (int i = 0; i < iters; i++)
      for (size_t off = 0; off < bytes;) {
        ssize_t w = write(s, buf + off, bytes - off);
        if (w <= 0) die("write");
        off += (size_t)w;
      }
    close(s);
    _exit(0);
  }
  int c = accept(ls, NULL, NULL);
  if (c < 0) die("accept");
  double t0 = 0;
  for (int i = 0; i < iters; i++) {
    for (size_t off = 0; off < bytes;) {
      ssize_t r = read(c, buf + off, bytes - off);
      if (r <= 0) die("read");
      off += (size_t)r;
    }
    if (i == 0) t0 = now_s(); /* first message = warm-up */
  }
  double dt = now_s() - t0;
  double total = (double)bytes * (iters - 1);
  waitpid(pid, NULL, 0);
  printf("{\"bytes\": %.0f, \"seconds\": %.6f, \"gbytes_per_s\": %.4f}\n", total, dt, total / dt / 1e9);
  return 0;
}
