#!/usr/bin/env bash
# make gpu-wheels: on a CPU machine that reaches the package index, prepare in .whl/ what the
# GPU machines lack (Ray and the dependencies of it they do not have), small enough to travel
# with one device command (64 MiB with the working tree).  Ray's wheel (79 MB for 2.60, cp312)
# does not fit as it is: it goes as a tar.xz of the wheel's contents without what a training
# job on that machine never loads (the Java jars, RLlib, the dashboard's web build, test
# folders), about 25 MB; make gpu-check unpacks it.  PYVER and RAY_VERSION choose the build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER=${PYVER:-3.12}
PYTHON=${PYTHON:-python3}
RAY_VERSION=${RAY_VERSION:-$($PYTHON -c 'import ray; print(ray.__version__)' 2>/dev/null || echo 2.60.0)}
# Ray's dependencies that the GPU image lacks (its package list: .library/device/KINDS.md).
# Ray Data's iterators import ray.train, which needs pydantic (the first GPU check failed its
# fed-step tests on "ray.train.v2 requires the pydantic package"); pydantic pins pydantic-core
# exactly, so both come at this machine's versions when it has them.
pinned() { $PYTHON -c "import importlib.metadata as m; print('$1=='+m.version('$1'))" 2>/dev/null || echo "$1"; }
MISSING="jsonschema jsonschema-specifications referencing rpds-py $(pinned pydantic) $(pinned pydantic-core) annotated-types typing-inspection"
OUT=.whl
rm -rf "$OUT" && mkdir -p "$OUT/download" "$OUT/ray"
tag=${PYVER/./}
echo "gpu-wheels: ray==$RAY_VERSION and $MISSING for CPython $PYVER (manylinux x86_64) into $OUT/"
$PYTHON -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$OUT/download" "ray==$RAY_VERSION" $MISSING
unzip -q "$OUT"/download/ray-*-cp"$tag"-*.whl -d "$OUT/ray"
rm -rf "$OUT/ray/ray/jars" "$OUT/ray/ray/rllib" "$OUT/ray/ray/dashboard/client/build"
find "$OUT/ray" -name tests -type d -prune -exec rm -rf {} +
tar -C "$OUT/ray" -cf - . | xz -T0 -6 > "$OUT/ray-trimmed.tar.xz"
mv "$OUT"/download/*.whl "$OUT/" && rm -f "$OUT"/ray-*.whl
rm -rf "$OUT/download" "$OUT/ray"
ls -l "$OUT"
echo "gpu-wheels: $(du -sh "$OUT" | cut -f1) in $OUT/ (ignored by git); carry it: run(carry=['.whl'], ...)"
