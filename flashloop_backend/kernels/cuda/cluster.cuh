// Thread-block cluster primitives (sm_90): the CTA's rank, the cluster-wide barrier, and
// stores into another CTA's shared memory (distributed shared memory), in PTX.
#pragma once
#include "common.cuh"

__device__ __forceinline__ int cluster_rank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return (int)r;
}

// Every thread of every CTA of the cluster arrives; shared-memory writes before it (local
// or remote) are visible to every CTA after it. The warp reconverges first: the .aligned
// barrier needs all its threads at the same instruction.
__device__ __forceinline__ void cluster_sync() {
    __syncwarp();
    asm volatile(
        "barrier.cluster.arrive.release.aligned;\n"
        "barrier.cluster.wait.acquire.aligned;\n" ::
            : "memory");
}

// the address of this CTA's shared ``p`` in CTA ``rank``'s shared memory window
__device__ __forceinline__ u32 cluster_map(const void* p, int rank) {
    u32 r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(smem_addr(p)), "r"(rank));
    return r;
}
__device__ __forceinline__ void cluster_store(u32 address, int v) {
    asm volatile("st.shared::cluster.s32 [%0], %1;\n" ::"r"(address), "r"(v) : "memory");
}
__device__ __forceinline__ void cluster_store(u32 address, float v) {
    asm volatile("st.shared::cluster.f32 [%0], %1;\n" ::"r"(address), "f"(v) : "memory");
}
