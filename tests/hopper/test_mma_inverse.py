"""The warpgroup chunk inverse of ``hopper/mma_inverse`` (a building block for the fused forward):
it compiles for sm_90a with its ``mma.sync`` products, and on a Hopper GPU it matches an fp64
inverse as closely as ``tiles.blocked_unit_lower_inverse`` does."""

import shutil

import pytest
import torch

tilelang = pytest.importorskip("tilelang")


def _gdn_lower(n: int, decay: float, dev) -> torch.Tensor:
    """n strictly lower matrices as the forward forms them: beta_i k_i.k_j e^(gamma_i - gamma_j), unit keys, fp64."""
    gen = torch.Generator(device="cpu").manual_seed(int(decay * 1000) + n)
    k = torch.nn.functional.normalize(torch.randn(n, 64, 128, generator=gen, dtype=torch.float64), dim=-1)
    beta = torch.rand(n, 64, 1, generator=gen, dtype=torch.float64)
    gamma = torch.cumsum(-decay * torch.rand(n, 64, generator=gen, dtype=torch.float64), dim=-1)
    a = beta * (k @ k.transpose(-1, -2)) * torch.exp(gamma[:, :, None] - gamma[:, None, :])
    return torch.tril(a, -1).to(dev)


@pytest.mark.compile
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("mma", [True, False])
def test_inverse_probe_compiles_for_sm90a(mma):
    from tilelang import tvm

    from flash_gdn.hopper.mma_inverse import build_inverse_probe, build_inverse_stamps

    with tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}):
        source = build_inverse_probe(mma).get_kernel_source()
        if mma:  # the clock64 probe too
            assert "flash_gdn_inverse64(" in build_inverse_stamps().get_kernel_source()
    if mma:
        assert "flash_gdn_inverse64(" in source
        assert "mma.sync.aligned.m16n8k16" in source and "mma.sync.aligned.m16n8k8" in source
    else:
        assert "wgmma" in source


@pytest.mark.gpu
@pytest.mark.parametrize("decay", [0.0, 0.1, 3.0, 20.0])
def test_mma_inverse_matches_fp64(decay):
    """Gates from none to ~-20 a token; outputs poisoned; the same error class as the blocked
    inverse (fp32 diagonal blocks, fp16 operands elsewhere); two runs bitwise equal."""
    from flash_gdn.hopper.mma_inverse import build_inverse_probe

    dev = torch.device("cuda")
    lower = _gdn_lower(264, decay, dev)
    ref = torch.linalg.inv(torch.eye(64, device=dev, dtype=torch.float64) + lower)
    l32 = lower.float().contiguous()
    errors = {}
    for mma in (True, False):
        x = torch.full_like(l32, float("nan"))
        build_inverse_probe(mma)(l32, x)
        torch.cuda.synchronize()
        assert torch.isfinite(x).all(), f"mma={mma}: unwritten or non-finite elements"
        assert torch.equal(torch.triu(x, 1), torch.zeros_like(x)), f"mma={mma}: nonzero above the diagonal"
        errors[mma] = ((x.double() - ref).norm() / ref.norm()).item()
        if mma:
            again = torch.full_like(l32, float("nan"))
            build_inverse_probe(mma)(l32, again)
            assert torch.equal(x, again), "two runs differ"
    assert errors[True] < 5e-4, errors
    assert errors[True] <= 1.5 * errors[False] + 1e-6, errors


def _wavefronts(byte_addresses: list[int], width: int) -> int:
    """Shared-memory wavefronts of one warp's access of ``width`` bytes a lane: the warp is served
    in groups of 128 bytes' worth of lanes (32 lanes of 4 bytes, 16 of 8, 8 of 16), and a group
    takes as many wavefronts as the most distinct 4-byte words any one of its 32 banks holds (fewer
    than 32 addresses: the first lanes only)."""
    per_group = 128 // max(width, 4)
    total = 0
    for first in range(0, 32, per_group):
        words_by_bank: dict[int, set[int]] = {}
        for address in byte_addresses[first:first + per_group]:
            for word in range(address // 4, (address + width + 3) // 4):
                words_by_bank.setdefault(word % 32, set()).add(word)
        total += max((len(words) for words in words_by_bank.values()), default=0)
    return total


def test_inverse_tiles_are_free_of_bank_conflicts_in_the_fragment_layout():
    """L's fp32 rows (``L_STRIDE``) and the fp16 scratch's (``XH_STRIDE``) are padded so that the
    accesses of the mma fragment layout (lane l: row l // 4, columns 2 (l % 4) and + 1) take one
    wavefront per 128 bytes: L's staging, its levels' C blocks and results (float2), the scratch's
    operand words (4 bytes) and transposed B halves (2 bytes). At L_STRIDE = 68 the float2 accesses
    were two-way conflicts (s58: 23 % of prepare_wu's shared wavefronts)."""
    from flash_gdn.hopper.mma_inverse import L_STRIDE, XH_STRIDE

    lanes = range(32)
    for row0, col0 in [(0, 0), (8, 0), (16, 8), (40, 16), (56, 48)]:
        l_float2 = [((row0 + l // 4) * L_STRIDE + col0 + 2 * (l % 4)) * 4 for l in lanes]
        assert _wavefronts(l_float2, 8) == 2, (row0, col0)
        xh_word = [((row0 + l // 4) * XH_STRIDE + col0 + 2 * (l % 4)) * 2 for l in lanes]
        assert _wavefronts(xh_word, 4) == 1, (row0, col0)
        xh_half_t = [((row0 + 2 * (l % 4)) * XH_STRIDE + col0 + l // 4) * 2 for l in lanes]
        assert _wavefronts(xh_half_t, 2) == 1, (row0, col0)
    # the model itself: the old stride's two-way conflict
    assert _wavefronts([((l // 4) * 68 + 2 * (l % 4)) * 4 for l in lanes], 8) == 4


def _swizzled(row: int, col: int) -> int:
    """Byte offset of element (row, col) of a [64][64] tile of 2-byte elements in the 128-byte swizzle
    (``fg_swz`` in ``flash_gdn_inverse64_scaled``)."""
    return row * 128 + ((((col >> 3) ^ row) & 7) << 4) + ((col & 7) << 1)


def test_scaled_inverse_tiles_are_free_of_bank_conflicts():
    """The scaled variant's accesses (s59): the output tile's 4-byte fragment writes (lane l: row
    l // 4, columns 2 (l % 4) and + 1) and level 0's 16-byte row writes take one wavefront per 128
    bytes in the 128-byte swizzle (in plain rows of 128 bytes they would be 8-way); the fp32 diagonal
    blocks (``LD_STRIDE``) are read by level 0 as float4 rows without conflicts and staged as float2
    with at most two-way ones; L's fp16 staging (4-byte words, ``XH_STRIDE``) is conflict-free."""
    from flash_gdn.hopper.mma_inverse import LD_STRIDE, XH_STRIDE

    lanes = range(32)
    for row0, col0 in [(0, 0), (8, 0), (16, 8), (40, 16), (56, 48)]:
        out_word = [_swizzled(row0 + l // 4, col0 + 2 * (l % 4)) for l in lanes]
        assert _wavefronts(out_word, 4) == 1, (row0, col0)
        assert _wavefronts([(row0 + l // 4) * 128 + (col0 + 2 * (l % 4)) * 2 for l in lanes], 4) == 8
        lh_word = [((row0 + l // 4) * XH_STRIDE + col0 + 2 * (l % 4)) * 2 for l in lanes]
        assert _wavefronts(lh_word, 4) == 1, (row0, col0)
    for w in range(4):  # level 0: lanes 0..15 row 16 w + l, columns r & ~7 onwards (and their mirrors)
        rows = [16 * w + (l & 15) for l in lanes]
        for half in (0, 1):
            assert _wavefronts([r * LD_STRIDE * 4 + 16 * half for r in rows], 16) == 4
        out_row = [_swizzled(r, r & ~7) for r in rows[:16]]
        assert _wavefronts(out_row, 16) == 2  # 256 bytes
        for h in (0, 1):  # the staging: a warp's row 16 w + 8 h + l // 4, columns 2 (l % 4), + 1
            ld_float2 = [((16 * w + 8 * h + l // 4) * LD_STRIDE + 2 * (l % 4)) * 4 for l in lanes]
            assert _wavefronts(ld_float2, 8) <= 4
