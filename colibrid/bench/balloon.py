"""A memory balloon: lock RAM away so a benchmark runs with only ``--leave-gb`` available.

Why mlock: a model "far bigger than RAM" is only that if the runtime cannot keep it in
the page cache, and a 24 GB machine would cache a 19 GB model whole. Locked anonymous
pages can be neither swapped nor reclaimed, so the page cache (llama.cpp's mmap) and
colibri's budget both see what is left. Needs CAP_IPC_LOCK or a large enough
``ulimit -l``; it says so when the kernel refuses.

Run as ``python -m colibrid.bench.balloon --leave-gb N``: prints ``ready <bytes locked>``
once the pages are locked and holds them until its standard input closes.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import mmap
import os
import sys

from colibrid.store.budget import mem_available

GB = 1 << 30
CHUNK = 256 << 20  # locked piece by piece, so a refusal leaves what was locked, not nothing


def lock_until_closed(leave: int) -> int:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    want = max(0, mem_available() - leave)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    pieces, locked = [], 0
    while locked + CHUNK <= want:
        m = mmap.mmap(-1, CHUNK, flags=flags)
        buf = (ctypes.c_char * CHUNK).from_buffer(m)
        if libc.mlock(ctypes.addressof(buf), CHUNK) != 0:
            err = ctypes.get_errno()
            del buf
            m.close()
            raise OSError(
                err,
                f"mlock refused after {locked / GB:.1f} GB ({os.strerror(err)}): run as root "
                "or raise `ulimit -l`",
            )
        pieces.append((m, buf))
        locked += CHUNK
    print(f"ready {locked}", flush=True)
    sys.stdin.read()  # the parent closes our stdin (or dies): give everything back
    return locked


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m colibrid.bench.balloon", description=__doc__)
    p.add_argument("--leave-gb", type=float, required=True, help="GB to leave available")
    args = p.parse_args(argv)
    try:
        lock_until_closed(int(args.leave_gb * GB))
    except OSError as exc:
        print(f"error: {exc.strerror}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
