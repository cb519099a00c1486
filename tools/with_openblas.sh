#!/bin/sh
# Run a command with OpenBLAS in place of the reference BLAS the mlx[cpu] wheel bundles:
#     tools/with_openblas.sh python tools/scale_bench.py --dtype float32 ...
# Preloaded, OpenBLAS comes first in the dynamic linker's scope and MLX's float32 products go
# through it (speculative/measure/blas.py reports which BLAS a run used). Debian/Ubuntu:
# apt-get install libopenblas0-pthread. DYNO_OPENBLAS names another libopenblas.so.0.
lib="${DYNO_OPENBLAS:-}"
if [ -z "$lib" ]; then
    for f in /usr/lib/*/openblas-pthread/libopenblas.so.0 /usr/lib/*/libopenblas.so.0 /usr/lib64/libopenblas.so.0; do
        if [ -f "$f" ]; then lib="$f"; break; fi
    done
fi
if [ -z "$lib" ] || [ ! -f "$lib" ]; then
    echo "dyno: error: no libopenblas.so.0 found (apt-get install libopenblas0-pthread, or set DYNO_OPENBLAS)" >&2
    exit 2
fi
if [ "$#" -eq 0 ]; then
    echo "dyno: error: usage: tools/with_openblas.sh COMMAND [ARGS...]" >&2
    exit 2
fi
# One thread unless told: on a few shared cores a second OpenBLAS thread spins against MLX's and other
# work (measured on 2 busy cores: 4 rows cost 1.9x one row with two threads, 1.0-1.2x with one).
export OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-1}"
LD_PRELOAD="$lib${LD_PRELOAD:+:$LD_PRELOAD}" exec "$@"
