#!/usr/bin/env python3
"""The pages of an artifact a fresh process pages in: the file's page-cache
pages are dropped (fsync, then posix_fadvise DONTNEED: clean pages only, no
root needed), `maxrun` runs a one-token prompt and one decode step
(`--no-verify`: the checksum would read every page), and mincore(2) counts the
file's pages in memory after it, in all and per 64 MiB of the file. For a
mixture of experts (issue #64): at most the dense weights plus the experts the
two steps chose, plus 10% (docs/performance.md, "Mixtures of experts").

    scripts/resident_pages.py X.mef [--maxrun target/release/maxrun]

Linux only (mincore through ctypes); the page cache is shared, so run it with
no other reader of the file.
"""
import argparse
import ctypes
import os
import subprocess

libc = ctypes.CDLL("libc.so.6", use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
PROT_READ, MAP_SHARED, PAGE = 1, 1, os.sysconf("SC_PAGE_SIZE")


def residency(path):
    """Per page of `path`, whether it is in memory."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        ptr = libc.mmap(None, size, PROT_READ, MAP_SHARED, fd, 0)
        if ptr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap")
        pages = (size + PAGE - 1) // PAGE
        vec = (ctypes.c_ubyte * pages)()
        if libc.mincore(ctypes.c_void_p(ptr), ctypes.c_size_t(size), vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore")
        libc.munmap(ctypes.c_void_p(ptr), ctypes.c_size_t(size))
        return [v & 1 for v in vec], size
    finally:
        os.close(fd)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact")
    ap.add_argument("--maxrun", default="target/release/maxrun")
    args = ap.parse_args()
    os.sync()
    fd = os.open(args.artifact, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    before, size = residency(args.artifact)
    print(f"before: {sum(before) * PAGE / 1e6:.1f} MB of {size / 1e6:.1f} MB in memory")
    run = subprocess.run([args.maxrun, args.artifact, "--token-ids", "5", "-n", "2", "--no-verify", "--temperature", "0", "--ignore-eos"], capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"maxrun failed: {run.stderr}")
    after, _ = residency(args.artifact)
    print(f"after a one-token prompt and one decode step: {sum(after) * PAGE / 1e6:.1f} MB")
    bucket = (64 << 20) // PAGE
    print("per 64 MiB (tenths in memory):", "".join(str(min(9, 10 * sum(after[i:i + bucket]) // len(after[i:i + bucket]))) for i in range(0, len(after), bucket)))


if __name__ == "__main__":
    main()
