"""GPU test helpers: poisoned allocations and references on the device."""

import contextlib

import torch


def poison_cache(nbytes: int = 1 << 30) -> None:
    """Fill a large block with NaN and free it, so torch.empty hands back NaN-filled memory:
    any output element a kernel forgets to write then fails the comparison."""
    block = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda")
    block.fill_(float("nan"))
    del block


@contextlib.contextmanager
def poisoned():
    torch.cuda.synchronize()
    poison_cache()
    yield
    torch.cuda.synchronize()
