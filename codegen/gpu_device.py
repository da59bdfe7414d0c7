"""The GPU of this machine, as the driver describes it (pycuda, imported only when asked: CPU-only
machines never load it)."""
from __future__ import annotations

from tensortune.tasks.search_task import HardwareParams


def device_hardware_params(device: int = 0) -> tuple[str, HardwareParams]:
    """(arch, limits) of a present GPU, read from the driver."""
    import pycuda.driver as cuda
    cuda.init()
    dev = cuda.Device(device)
    a = dev.get_attributes()
    A = cuda.device_attribute
    major, minor = dev.compute_capability()
    return f"sm_{major}{minor}", HardwareParams(
        num_cores=a[A.MULTIPROCESSOR_COUNT], vector_unit_bytes=16, cache_line_bytes=128,
        max_shared_memory_per_block=a[A.MAX_SHARED_MEMORY_PER_BLOCK], max_local_memory_per_block=2 ** 31 - 1,
        max_threads_per_block=a[A.MAX_THREADS_PER_BLOCK], max_vthread_extent=8, warp_size=a[A.WARP_SIZE])
