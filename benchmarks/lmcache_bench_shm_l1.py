"""Run `lmcache bench l2` with its L1 buffer in shared memory, as the LMCache server has it.

`lmcache bench l2` puts its L1 buffer in anonymous memory (``torch.empty``); the LMCache
server allocates its L1 pool as a POSIX shared-memory file (``/dev/shm/lmcache_l1_pool_<pid>``,
LMCache's own ``_allocate_cpu_memory(shm_name=...)``). This launcher swaps the benchmark's
buffer allocation for that same allocator and then runs the unchanged `lmcache` CLI with the
given arguments, so an adapter sees L1 memory as it would inside the server. Usage::

    python benchmarks/lmcache_bench_shm_l1.py bench l2 --l2-adapter '<json>' ...
"""

from __future__ import annotations

import atexit
import os
import sys


def main() -> int:
    from lmcache.cli.commands.bench.l2_adapter_bench import data
    from lmcache.cli.main import main as lmcache_main
    from lmcache.v1.memory_management import _allocate_cpu_memory, _free_cpu_memory

    name = f"lmcache_l1_pool_bench_{os.getpid()}"

    def shm_tensor(num_bytes: int, align_bytes: int = 1, use_hugepages: bool = False):
        if use_hugepages:
            raise SystemExit("--l1-use-hugepages and a shared-memory L1 exclude each other (as in the server)")
        buf = _allocate_cpu_memory(num_bytes, shm_name=name).view(-1)   # page aligned
        if buf.data_ptr() % align_bytes:
            raise SystemExit(f"shared-memory L1 is not {align_bytes}-byte aligned")
        atexit.register(_free_cpu_memory, buf, num_bytes, shm_name=name)
        return buf

    data.make_aligned_tensor = shm_tensor
    sys.argv = ["lmcache", *sys.argv[1:]]
    return lmcache_main()


if __name__ == "__main__":
    sys.exit(main())
