# Sourced by the pairs benchmarks (modes.sh, progtime.sh, pairs.sh), from the repository root:
# builds heaptrace in release mode and the `pairs` fixture, sets $ht and $pairs, and takes the
# integration tests' system-wide lock exclusively on fd 9, so that no probing test (an --all
# one would trace the native runs too) runs in between.
cargo build --release -q -p heaptrace
mkdir -p target/fixtures
gcc -O1 -g -fno-builtin -fno-omit-frame-pointer -o target/fixtures/pairs tests/fixtures/pairs.c
ht=target/release/heaptrace
pairs=target/fixtures/pairs
exec 9>/tmp/heaptrace-tests.lock
flock 9
# The flag for a mode name: the floors (bare, bare-traps, bare-entry) are `--floor`, the rest
# `--mode`. Unquoted where used, so that it gives two arguments.
modeflag() {
    case $1 in
    bare*) echo "--floor $1" ;;
    *) echo "--mode $1" ;;
    esac
}
