// A warp's page numbers looked up a window ahead, for the streaming loop-2 passes of
// packed_source.cu. The including file defines LEVELS and a Params with tables, t_row and
// t_level.
#pragma once
#include "common.cuh"

// Lane j of a window holds the page of group window * PER + j / LEVELS of the warp's list
// at level j % LEVELS, so a copy takes its page by a shuffle and never waits for a table
// entry behind the loads already in flight. ``next`` is loaded when a window opens, a
// whole window before its copies need it.
struct PageWindow {
    static constexpr int PER = 32 / LEVELS;  // groups a window covers
    int now, next, at;                        // entries of windows at and at + 1
};

// bit l set when level l of the row is dense (kinds[l] == 0): the levels a window covers
__device__ __forceinline__ unsigned dense_levels(const int (&kinds)[LEVELS]) {
    unsigned dense = 0;
#pragma unroll
    for (int l = 0; l < LEVELS; ++l) dense |= kinds[l] == 0 ? 1u << l : 0u;
    return dense;
}

// one window's entry of this lane: the warp's groups are first + warp + k WARPS, k < mine;
// ``dense``: bit l set when level l is dense (others are not copied here)
template <class Params>
__device__ __forceinline__ int window_entry(const Params& P, i64 row, unsigned dense, int first,
                                            int warp, int warps, int mine, int window,
                                            int lane) {
    constexpr int PER = PageWindow::PER;
    const int k = window * PER + lane / LEVELS, l = lane % LEVELS;
    if (lane >= PER * LEVELS || k >= mine || !(dense >> l & 1u)) return 0;
    return P.tables[row * P.t_row + (i64)l * P.t_level + first + warp + k * warps];
}

template <class Params>
__device__ __forceinline__ PageWindow open_windows(const Params& P, i64 row, unsigned dense,
                                                   int first, int warp, int warps, int mine,
                                                   int lane) {
    PageWindow w;
    w.at = 0;
    w.now = window_entry(P, row, dense, first, warp, warps, mine, 0, lane);
    w.next = window_entry(P, row, dense, first, warp, warps, mine, 1, lane);
    return w;
}

// moves the window on when the warp's k-th group opens the next one. Callers take k = 0,
// 1, 2, ... in order, as both kernels' rings do: a k that skipped a window would read the
// window loaded ahead for the wrong groups (a reload there would cost the keys pass
// registers on every path). The whole warp calls it before taking that group's pages.
template <class Params>
__device__ __forceinline__ void advance_window(const Params& P, i64 row, unsigned dense,
                                               int first, int warp, int warps, int mine, int k,
                                               PageWindow& w, int lane) {
    const int window = k / PageWindow::PER;
    if (window != w.at) {
        w.now = w.next;
        w.at = window;
        w.next = window_entry(P, row, dense, first, warp, warps, mine, window + 1, lane);
    }
}

// the page of level l of the warp's k-th group, its window current
__device__ __forceinline__ int window_page(const PageWindow& w, int k, int l) {
    return __shfl_sync(FULL_MASK, w.now, (k % PageWindow::PER) * LEVELS + l);
}
