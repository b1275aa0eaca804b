// Patterns that need independent thread scheduling (Volta+): a thread spins until another one,
// parked behind it, makes progress.
extern "C" __global__ void spin_lock(int *lock, int *counter) {
    while (atomicCAS(lock, 0, 1) != 0) { }          // losers spin; the winner is past the loop
    int c = *(volatile int *)counter;               // non-atomic read-modify-write under the lock
    *(volatile int *)counter = c + 1;
    __threadfence();
    atomicExch(lock, 0);
}

// Block 1 waits for a flag that block 0 sets.
extern "C" __global__ void flag_wait(volatile int *flag, volatile int *data, int *out) {
    if (blockIdx.x == 1) {
        while (*flag == 0) { }
        out[threadIdx.x] = *data + threadIdx.x;
    } else if (threadIdx.x == 0) {
        *data = 42;
        __threadfence();
        *flag = 1;
    }
}
