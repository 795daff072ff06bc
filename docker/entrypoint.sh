#!/bin/sh
# Entrypoint of the GPU and Jetson images (docs/tensorrt.md). A TensorRT plan runs only on the GPU model and
# TensorRT version that built it, so these images ship no ladder: the first start builds one on the device it
# runs on, into the volume at $ANYTIME_LADDER, and later starts serve it at once. The server answers /readyz
# with 200 only once every engine is loaded and warm; until then (the build included) it is not ready, and
# readiness, not a fixed start period, decides when traffic comes.
#
#   ANYTIME_BUILD_BACKEND  tensorrt (the images' default), auto or onnxruntime
#   ANYTIME_BUILD_ARGS     more `anytime build` arguments, split on spaces (e.g. "--members none")
#   ANYTIME_REBUILD=1      run the build even though a ladder is there (another GPU or TensorRT version):
#                          it redoes only the steps whose inputs changed
set -eu

ladder="${ANYTIME_LADDER:-/data/ladder}"
if [ ! -f "$ladder/ladder.json" ] || [ "${ANYTIME_REBUILD:-0}" = 1 ]; then
    echo "entrypoint: building the ladder in $ladder on this device (backend ${ANYTIME_BUILD_BACKEND:-auto}); this takes minutes" >&2
    # shellcheck disable=SC2086 # ANYTIME_BUILD_ARGS is a list of words
    anytime build --backend "${ANYTIME_BUILD_BACKEND:-auto}" --out "$ladder" ${ANYTIME_BUILD_ARGS:-}
fi
exec anytime serve --ladder "$ladder" "$@"
