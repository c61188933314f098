"""Which implementation serves a call: the Hopper TileLang kernels or the portable PyTorch path."""

from __future__ import annotations

import functools
import logging

import torch

from .env import env_get
from .validation import Problem

logger = logging.getLogger("flash_gdn")

HOPPER = "hopper"
PORTABLE = "portable"

HOPPER_HEAD_DIMS = (64, 128)
HOPPER_DTYPES = (torch.float16, torch.bfloat16)

_announced: set[str] = set()


@functools.lru_cache(maxsize=None)
def _is_hopper(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) == (9, 0)


@functools.lru_cache(maxsize=None)
def tilelang_available() -> bool:
    try:
        import tilelang  # noqa: F401
    except Exception:  # pragma: no cover - depends on the host
        return False
    return True


def hopper_forward_supports(q: torch.Tensor, problem: Problem) -> tuple[bool, str]:
    """Whether the Hopper kernels take this call, and if not, why not."""
    if env_get("FLASH_GDN_FORCE_PORTABLE", "0") == "1":
        return False, "FLASH_GDN_FORCE_PORTABLE=1"
    if not q.is_cuda:
        return False, f"device {q.device} is not CUDA"
    if not _is_hopper(q.device.index if q.device.index is not None else torch.cuda.current_device()):
        return False, "GPU is not SM90 (Hopper)"
    if not tilelang_available():
        return False, "tilelang is not importable"
    if q.dtype not in HOPPER_DTYPES:
        return False, f"dtype {q.dtype} (kernels take float16 and bfloat16)"
    if problem.head_k != problem.head_v or problem.head_k not in HOPPER_HEAD_DIMS:
        return False, f"K={problem.head_k}, V={problem.head_v} (kernels take K = V in {HOPPER_HEAD_DIMS})"
    return True, "SM90 TileLang kernels"


def announce(path: str, reason: str) -> None:
    """One log line per path and process naming the path taken."""
    if path not in _announced:
        _announced.add(path)
        logger.info("flash_gdn: %s path (%s)", path, reason)
