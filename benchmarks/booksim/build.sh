#!/bin/sh
# Build a trace-driven BookSim 2.0 outside the repository (issue #27).
#
# Usage: benchmarks/booksim/build.sh [BOOKSIM_SRC [BUILD_DIR]]
#   BOOKSIM_SRC  the read-only BookSim 2.0 tree (default ../shared/vendor/booksim2 from the
#                repository root, or $BOOKSIM_SRC)
#   BUILD_DIR    where to copy and build it (default $TMPDIR/hdamoe-booksim)
# Copies the sources, adds this directory's trace traffic manager (sim_type = trace, options
# trace_file and trace_out) with four small sed edits, builds with make, and prints the path
# of the binary. Needs g++, make, flex and bison. BookSim sources are never written into the
# repository.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
src=${1:-${BOOKSIM_SRC:-$root/../shared/vendor/booksim2}}
build=${2:-${TMPDIR:-/tmp}/hdamoe-booksim}
for tool in g++ make flex bison; do
    command -v "$tool" >/dev/null 2>&1 || { echo "build.sh: $tool not found" >&2; exit 3; }
done
[ -f "$src/src/trafficmanager.cpp" ] || { echo "build.sh: no BookSim sources at $src" >&2; exit 3; }
if [ ! -f "$build/src/trafficmanager.cpp" ]; then  # a fresh copy (an existing one is reused)
    mkdir -p "$build"
    cp -r "$src/." "$build/"
    chmod -R u+w "$build"
fi
cd "$build/src"
for f in tracetrafficmanager.hpp tracetrafficmanager.cpp; do
    cmp -s "$here/$f" "$f" || cp "$here/$f" "$f"
done
if ! grep -q 'new TraceTrafficManager' trafficmanager.cpp; then
    # 1. _GeneratePacket becomes virtual, so the trace manager can choose size and destination
    sed -i 's/^\(\s*\)void _GeneratePacket( int source, int size, int cl, int time );/\1virtual void _GeneratePacket( int source, int size, int cl, int time );/' trafficmanager.hpp
    grep -q 'virtual void _GeneratePacket' trafficmanager.hpp
    # 2. sim_type = trace selects it
    sed -i 's/#include "packet_reply_info.hpp"/#include "packet_reply_info.hpp"\n#include "tracetrafficmanager.hpp"/' trafficmanager.cpp
    sed -i 's/    } else if(sim_type == "batch") {/    } else if(sim_type == "trace") {\n        result = new TraceTrafficManager(config, net);\n    } else if(sim_type == "batch") {/' trafficmanager.cpp
    grep -q 'new TraceTrafficManager' trafficmanager.cpp
    # 3. its two options
    sed -i 's/  AddStrField( "sim_type", "latency" );/  AddStrField( "sim_type", "latency" );\n  AddStrField( "trace_file", "" );\n  AddStrField( "trace_out", "" );/' booksim_config.cpp
    grep -q 'trace_file' booksim_config.cpp
    # 4. torus DOR: on an exact tie (distance = half the ring) take the +1 direction, as
    #    hdamoe_env.noc.topology does, instead of a random one (same routes in both simulators)
    sed -i 's/( ( dist2 == 0 ) \&\& ( RandomInt( 1 ) ) ) ) {/( dist2 == 0 ) ) {/' routefunc.cpp
    grep -q '( dist2 == 0 ) ) {' routefunc.cpp
fi
make -j2 >make.log 2>&1 || { tail -20 make.log >&2; exit 1; }
echo "$build/src/booksim"
