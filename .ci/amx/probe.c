/* Exits 132 (SIGILL) where the CPU advertises AMX and the kernel grants its tile state, but the machine
   traps the instructions (some virtual machines); 0 where AMX works; 2 where the state is refused. */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(void) {
    if (syscall(SYS_arch_prctl, 0x1023, 18)) return 2;
    struct { uint8_t palette, start; uint8_t reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } __attribute__((packed)) cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1; cfg.colsb[0] = 64; cfg.rows[0] = 16;
    _tile_loadconfig(&cfg);
    _tile_zero(0);
    _tile_release();
    return 0;
}
