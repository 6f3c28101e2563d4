#!/usr/bin/env bash
# Kernel compile caches that outlive a device machine. Each device call starts a fresh
# machine, and Triton (and FlashInfer's JIT) compile every kernel again: minutes of
# device time per call. The caches live in .device_cache/ (git-ignored), which a call
# carries beside .whl and packs back into $OUT before it ends.
#
# Unpacked, the caches outgrow what a call carries (64 MiB), so they travel packed:
# On the device machine, after the prelude:
#   source .whl/prelude.sh && source scripts/device_cache.sh && ... ; device_cache_save
#   (run's carry: [".whl", ".device_cache_parts"]; sourcing unpacks the parts)
# Here, after the call, to keep what came back for the next call:
#   bash scripts/device_cache.sh stash /work/.device/N     (the packed parts, to carry)
#   bash scripts/device_cache.sh unpack /work/.device/N    (unpacked, to look inside)
CACHE_ROOT=${CACHE_ROOT:-$PWD/.device_cache}
CACHE_PARTS=triton_flashinfer_cache.tar.xz.part-
STASH=${STASH:-$PWD/.device_cache_parts}

device_cache_save() {
  # Triton's whole cache (a kernel loads from every file of its group) and FlashInfer's
  # built modules, xz-packed in parts under the 16 MiB a returned file may have
  local fi="$CACHE_ROOT/flashinfer/.cache/flashinfer"
  (cd "$CACHE_ROOT" && find triton -type f > /tmp/cache_files \
    && { [ -d "$fi" ] && find "${fi#"$CACHE_ROOT"/}" -name '*.so' >> /tmp/cache_files; true; } \
    && tar -cf - -T /tmp/cache_files | xz -T0 -6 \
    | split -b 15M - "${OUT:?OUT}/$CACHE_PARTS")
  du -ch "$OUT/$CACHE_PARTS"* | tail -1
}

if [ "${1:-}" = stash ]; then
  from=${2:?stash DIR: the files_at folder of the call}
  rm -rf "$STASH" && mkdir -p "$STASH" && cp "$from/$CACHE_PARTS"* "$STASH/"
  du -sh "$STASH"
elif [ "${1:-}" = unpack ]; then
  from=${2:?unpack DIR: the files_at folder of the call}
  mkdir -p "$CACHE_ROOT"
  cat "$from/$CACHE_PARTS"* | xz -d | tar -xf - -C "$CACHE_ROOT"
  du -sh "$CACHE_ROOT"
else
  mkdir -p "$CACHE_ROOT/triton" "$CACHE_ROOT/flashinfer"
  if [ -d "$STASH" ] && [ -z "$(ls -A "$CACHE_ROOT/triton")" ]; then  # a fresh machine
    cat "$STASH/$CACHE_PARTS"* | xz -d | tar -xf - -C "$CACHE_ROOT" && echo "device cache: unpacked"
  fi
  export TRITON_CACHE_DIR="$CACHE_ROOT/triton"
  export FLASHINFER_WORKSPACE_BASE="$CACHE_ROOT/flashinfer"
fi
