#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
static void *work(void *name) {
  unsigned char cfg[64]; memset(cfg, 0, 64); cfg[0] = 1;
  for (int t = 0; t < 8; t++) { cfg[16 + 2 * t] = 64; cfg[48 + t] = 16; }
  static char buf[1024] __attribute__((aligned(64)));
  _tile_loadconfig(cfg); _tile_loadd(0, buf, 64); _tile_zero(1); _tile_release();
  printf("%s: tileloadd ok\n", (char *)name); return 0;
}
int main(void) {
  long r = syscall(SYS_arch_prctl, 0x1023, 18);
  printf("ARCH_REQ_XCOMP_PERM -> %ld\n", r);
  work("main thread");
  pthread_t t; pthread_create(&t, 0, work, "second thread"); pthread_join(t, 0);
  return 0;
}
