"""Puts the machine's free memory into a state a long-running shared host can
be in, and holds it there while a command runs, so a measurement can be
repeated under it (issue 46: the huge-page advice won in some processes and
lost in others).

``fragment``: touches free memory in 4 KiB pages (``MADV_NOHUGEPAGE``) and
gives back all but one page in every ``--keep-every``, so that few free
blocks of 2 MiB remain: a huge-page fault must then compact (move pages) or
fall back to 4 KiB pages. Holds about 1/keep_every of what it touched.

``churn``: allocates and frees ``--churn-mib`` over and over, each touched in
4 KiB pages, with ``--churn-pause-ms`` between, as a neighbour's test suite
does: freed memory merges into large free blocks, which the page-reporting
driver of a virtio-balloon guest hands back to the host.

``hugechurn``: the same with the memory advised to huge pages
(``MADV_HUGEPAGE``): a neighbour that takes the 2 MiB blocks a process has
just freed, so that its next huge pages come from elsewhere.

Prints /proc/buddyinfo and the vmstat compaction and huge-page counters
before and after. Usage:
    python benchmarks/probes/memory_state.py fragment [--touch-gib 12] [--keep-every 16] -- CMD...
    python benchmarks/probes/memory_state.py churn|hugechurn [--churn-mib 1024] -- CMD...
Linux only.
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing
import subprocess
import sys
import time

import numpy as np

PAGE = 4096
CHUNK = 256 << 20
COUNTERS = ("thp_fault_alloc", "thp_fault_fallback", "compact_stall", "compact_fail",
            "compact_success", "compact_migrate_scanned", "compact_free_scanned")


def buddyinfo() -> str:
    with open("/proc/buddyinfo") as f:
        return f.read().rstrip()


def vmstat() -> dict[str, int]:
    out = {}
    with open("/proc/vmstat") as f:
        for line in f:
            k, v = line.split()
            if k in COUNTERS:
                out[k] = int(v)
    return out


def available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def fragment(touch: int, keep_every: int, reserve: int) -> list[mmap.mmap]:
    """Touches up to `touch` bytes chunk by chunk, keeping one page in
    `keep_every` of each; stops while `reserve` bytes are still available."""
    held = []
    done = 0
    while done < touch and available_bytes() - CHUNK > reserve:
        m = mmap.mmap(-1, CHUNK, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        m.madvise(mmap.MADV_NOHUGEPAGE)
        view = np.frombuffer(m, dtype=np.uint8)
        view[::PAGE] = 1  # one write per page: every page faulted in, 4 KiB each
        del view
        # Give back every run of (keep_every - 1) pages between the kept ones.
        run = (keep_every - 1) * PAGE
        for start in range(PAGE, CHUNK, keep_every * PAGE):
            m.madvise(mmap.MADV_DONTNEED, start, min(run, CHUNK - start))
        held.append(m)
        done += CHUNK
    return held


def churn(mib: int, pause_ms: float, stop, huge: bool = False) -> None:
    size = mib << 20
    while not stop.is_set():
        m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        m.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE)
        view = np.frombuffer(m, dtype=np.uint8)
        view[::PAGE] = 1
        del view
        m.close()
        time.sleep(pause_ms / 1e3)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("state", choices=("fragment", "churn", "hugechurn"))
    p.add_argument("--touch-gib", type=float, default=12.0)
    p.add_argument("--keep-every", type=int, default=16)
    p.add_argument("--reserve-gib", type=float, default=3.0,
                   help="leave at least this much available (other processes need it)")
    p.add_argument("--churn-mib", type=int, default=1024)
    p.add_argument("--churn-pause-ms", type=float, default=200.0)
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    args, command = p.parse_args(argv[:split]), argv[split + 1:]
    print("buddyinfo before:\n" + buddyinfo(), flush=True)
    v0 = vmstat()
    held, stop, worker = [], None, None
    if args.state == "fragment":
        held = fragment(int(args.touch_gib * (1 << 30)), args.keep_every,
                        int(args.reserve_gib * (1 << 30)))
        print(f"fragmented {len(held) * CHUNK >> 20} MiB, holding about "
              f"{len(held) * CHUNK // args.keep_every >> 20} MiB", flush=True)
    else:
        stop = multiprocessing.Event()
        worker = multiprocessing.Process(
            target=churn, args=(args.churn_mib, args.churn_pause_ms, stop, args.state == "hugechurn"))
        worker.start()
    print("buddyinfo while held:\n" + buddyinfo(), flush=True)
    rc = 0
    try:
        if command:
            rc = subprocess.run(command).returncode
    finally:
        if worker is not None:
            stop.set()
            worker.join()
        for m in held:
            m.close()
    v1 = vmstat()
    print("vmstat during: " + " ".join(f"{k} +{v1[k] - v0[k]}" for k in COUNTERS), flush=True)
    print("buddyinfo after:\n" + buddyinfo(), flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
