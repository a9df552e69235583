#!/bin/sh
# ctest `install_package`: install the just-built tree into a scratch prefix
# under the build directory, then build tests/install/main.c against it
#   (a) with `cc $(pkg-config --cflags --libs mla)` (shared) and the static
#       library through `pkg-config --static` (skipped, with a message, when
#       pkg-config is not installed: Debian package pkgconf), and
#   (b) as a CMake project using find_package(mla) via CMAKE_PREFIX_PATH
#       (mla::mla and mla::mla_static),
# and run every program (each prints "OK libmla x.y.z"). Any failure fails.
#
# usage: run.sh <build dir> <source dir> <C compiler> <cmake>
set -eu
BUILD=$1
SRC=$2
CC=$3
CMAKE=$4
HERE=$SRC/tests/install
WORK=$BUILD/install-test
PREFIX=$WORK/prefix

fail() { echo "FAIL: $*" >&2; exit 1; }
run_ok() { # run a program and require its "OK" line
  out=$("$@") || fail "$1 exited with status $?"
  echo "$out"
  case $out in OK*) ;; *) fail "$1 did not print OK" ;; esac
}

rm -rf "$WORK"
mkdir -p "$WORK"
"$CMAKE" --install "$BUILD" --prefix "$PREFIX" >"$WORK/install.log" 2>&1 ||
  { cat "$WORK/install.log"; fail "cmake --install"; }

# What must be there, wherever GNUInstallDirs put the library directory.
PC=$(find "$PREFIX" -name mla.pc -path '*/pkgconfig/*' | head -n 1)
[ -n "$PC" ] || fail "no pkgconfig/mla.pc installed"
LIBDIR=$(dirname "$(dirname "$PC")")
for f in "$PREFIX/include/mla.h" "$LIBDIR/libmla.a" "$LIBDIR/libmla.so" \
         "$LIBDIR/cmake/mla/mlaConfig.cmake" "$LIBDIR/cmake/mla/mlaConfigVersion.cmake" \
         "$LIBDIR/cmake/mla/mlaTargets.cmake" "$PREFIX/bin/mla"; do
  [ -e "$f" ] || fail "missing $f"
done
# The shared library has a SONAME (libmla.so.MAJOR) and that file is installed.
if command -v readelf >/dev/null 2>&1; then
  SONAME=$(readelf -d "$LIBDIR/libmla.so" | sed -n 's/.*(SONAME).*\[\(.*\)\].*/\1/p')
  case $SONAME in libmla.so.[0-9]*) ;; *) fail "libmla.so has SONAME '$SONAME'" ;; esac
  [ -e "$LIBDIR/$SONAME" ] || fail "SONAME $SONAME is not installed"
fi
# Only the `mla` CLI goes to bin (no test programs), only mla.h to include.
for f in "$PREFIX"/bin/* "$PREFIX"/include/*; do
  case $f in "$PREFIX/bin/mla" | "$PREFIX/include/mla.h") ;; *) fail "unexpected file installed: $f" ;; esac
done

# (a) pkg-config
if command -v pkg-config >/dev/null 2>&1; then
  export PKG_CONFIG_PATH="$LIBDIR/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
  pkg-config --exists mla || fail "pkg-config does not find mla in $LIBDIR/pkgconfig"
  [ "$(pkg-config --variable=libdir mla)" = "$LIBDIR" ] || fail "mla.pc libdir is not $LIBDIR"
  # shellcheck disable=SC2046
  "$CC" "$HERE/main.c" -o "$WORK/pc_shared" $(pkg-config --cflags --libs mla) \
    -Wl,-rpath,"$LIBDIR" || fail "build with pkg-config --libs mla"
  run_ok "$WORK/pc_shared"
  # Static: libmla.a plus Libs.private only (-Bstatic keeps the linker off
  # libmla.so), so a missing private dependency fails the link.
  STATIC_LIBS=$(pkg-config --static --libs mla | sed 's/-lmla\b/-Wl,-Bstatic -lmla -Wl,-Bdynamic/')
  # shellcheck disable=SC2046,SC2086
  "$CC" "$HERE/main.c" -o "$WORK/pc_static" $(pkg-config --cflags mla) $STATIC_LIBS ||
    fail "build with pkg-config --static --libs mla"
  run_ok "$WORK/pc_static"
  if command -v readelf >/dev/null 2>&1 && readelf -d "$WORK/pc_static" | grep -q 'libmla\.so'; then
    fail "pc_static links libmla.so"
  fi
else
  echo "skipped: pkg-config half (pkg-config is not installed; Debian package: pkgconf)"
fi

# (b) find_package(mla) through CMAKE_PREFIX_PATH
"$CMAKE" -S "$HERE" -B "$WORK/consumer" -DCMAKE_PREFIX_PATH="$PREFIX" \
  -DCMAKE_C_COMPILER="$CC" -DCMAKE_BUILD_TYPE=Release >"$WORK/consumer.log" 2>&1 ||
  { cat "$WORK/consumer.log"; fail "configure the find_package(mla) project"; }
grep -q "^mla_DIR:PATH=$LIBDIR/cmake/mla\$" "$WORK/consumer/CMakeCache.txt" ||
  fail "find_package(mla) did not use $LIBDIR/cmake/mla"
"$CMAKE" --build "$WORK/consumer" >>"$WORK/consumer.log" 2>&1 ||
  { cat "$WORK/consumer.log"; fail "build the find_package(mla) project"; }
run_ok "$WORK/consumer/consumer_shared"
run_ok "$WORK/consumer/consumer_static"
echo "install test passed"
