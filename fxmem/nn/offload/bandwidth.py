"""How fast a tier is: a write + read round trip of a buffer, in bytes per second."""
from __future__ import annotations

import os
import shutil
import tempfile
import time

import torch

from .scratch import SCRATCH_PREFIX, TIERS, cleanup_files, pread_all, pwrite_all


def probe_bandwidth(tier: str, nbytes: int = 32 << 20, scratch_root: str | None = None) -> float:
    """Bytes per second of a write + read round trip to the tier (a quick probe, ~0.1 s)."""
    if tier == "disk":
        src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
        dst = torch.empty_like(src)
        probe_dir = tempfile.mkdtemp(prefix=SCRATCH_PREFIX, dir=scratch_root)
        path = os.path.join(probe_dir, "probe.bin")
        try:
            descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except BaseException:
            shutil.rmtree(probe_dir, ignore_errors=True)
            raise
        try:
            start = time.perf_counter()
            pwrite_all(descriptor, memoryview(src.numpy()), 0)
            pread_all(descriptor, memoryview(dst.numpy()), 0)
            elapsed = time.perf_counter() - start
        finally:
            cleanup_files([descriptor], path, probe_dir)
        return 2 * nbytes / max(elapsed, 1e-9)
    if tier == "cpu":
        if not torch.cuda.is_available():
            raise ValueError("the 'cpu' offload tier moves CUDA tensors to host memory; this host has no CUDA")
        device_buffer = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        host_buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        host_buffer.copy_(device_buffer, non_blocking=True)
        device_buffer.copy_(host_buffer, non_blocking=True)
        torch.cuda.synchronize()
        return 2 * nbytes / max(time.perf_counter() - start, 1e-9)
    raise ValueError(f"offload tier must be one of {TIERS}, got {tier!r}")
