"""Every Hopper kernel variant compiles for sm_90a, on any machine with tilelang and nvcc.

This is how CI (no GPU) proves the kernels build; it also checks that the matrix products
went to wgmma, the Hopper tensor-core instruction.
"""

import re
import shutil

import pytest

tilelang = pytest.importorskip("tilelang")

from flash_gdn.hopper.variants import all_variants  # noqa: E402

pytestmark = [
    pytest.mark.compile,
    pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc"),
]

VARIANTS = dict(all_variants())


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_kernel_compiles_for_sm90a(name, capfd):
    from tilelang import tvm

    with tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}):
        kernel = VARIANTS[name]()
    # TileLang's ThreadSync pass moves a barrier out of a branch whose condition it cannot prove
    # the same for the whole CTA, and only warns: the barrier then no longer separates what it
    # guarded (s71, a branch's segment_scan: its walk's loop barrier, hoisted). The warning comes
    # where the kernel is lowered here, so on a cold kernel cache (CI's).
    hoisted = "[ThreadSync] Hoisting sync" in capfd.readouterr().err
    assert not hoisted, f"{name}: TileLang hoisted a barrier out of a branch (a race; see its warning)"
    source = kernel.get_kernel_source()
    if name.startswith(("sequence_prefix", "cut_pieces")):  # integer planning: no products
        assert "__global__" in source
    elif name.startswith("group_grads"):  # sums and row dots over 16-bit rows: no products either
        assert "__global__" in source and "uint4" in source, f"{name}: rows not read 16 bytes at a time"
    else:
        assert "wgmma" in source, f"{name}: no wgmma in the generated CUDA"


ASYNC_PRODUCT_KERNELS = ("state_output", "chunk_states", "state_grads", "segment_state")
ROLES_KERNEL = "state_output_roles"  # explicit roles, not TileLang's pipelined loop: its own test
GRADS_ROLES_KERNEL = "state_grads_roles"  # the same for the backward's state-gradient pass


@pytest.mark.parametrize("name", sorted(n for n in VARIANTS
                                         if n.startswith(ASYNC_PRODUCT_KERNELS)
                                         and not n.startswith((ROLES_KERNEL, GRADS_ROLES_KERNEL))))
def test_tiles_read_by_async_products_are_released_after_the_wait(name):
    """Kernels with asynchronous wgmma groups inside a warp-specialised pipeline re-read a
    tile after their last wait (tiles.py), so TileLang hands the tile back to the TMA
    producer only once the products reading it are done. Pin that the generated consumer
    loop still ends that way: a release (mbarrier arrive) after the last full wait and its
    read, never between them."""
    from tilelang import tvm

    with tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}):
        source = VARIANTS[name]().get_kernel_source()
    assert "tl::wait_wgmma<" in source, f"{name}: no asynchronous products"
    tail = source[source.rindex("tl::wait_wgmma<0>();"):]
    read_after_wait = tail.find("sink = ")
    release = tail.find(".arrive();")
    assert 0 <= read_after_wait < release, f"{name}: a tile is released before its products have finished"


@pytest.mark.parametrize("name", sorted(n for n in VARIANTS if n.startswith(ROLES_KERNEL)))
def test_roles_hand_stages_back_only_after_their_products(name):
    """``state_output_roles`` hands a stage back by hand: each state warpgroup arrives on
    ``empty`` only once its products reading that stage's tiles have finished (a wait for all
    wgmma groups right before the arrival), and the producer fences its generic stores of P^T
    and the factors for the async proxy before it arrives on ``full``."""
    from tilelang import tvm

    with tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}):
        source = VARIANTS[name]().get_kernel_source()
    lines = [line.strip() for line in source.splitlines()]
    empty = [i for i, line in enumerate(lines) if line.startswith("empty[") and line.endswith(".arrive();")]
    full = [i for i, line in enumerate(lines) if line.startswith("full[") and line.endswith(".arrive();")]
    # one per state warpgroup (two with lead-in segments or in place, which runs windows: the lead-in chunks' path
    # too); the producer
    leads = "lead_in=True" in name or "in_place=True" in name
    assert len(empty) == (4 if leads else 2) and len(full) == 1, (empty, full)
    assert all(lines[i - 1] == "tl::wait_wgmma<0>();" for i in empty), [lines[i - 1] for i in empty]
    assert lines[full[0] - 1] == "tl::fence_proxy_async();", lines[full[0] - 1]


@pytest.mark.parametrize("name", sorted(n for n in VARIANTS if n.startswith(ROLES_KERNEL)))
def test_roles_output_tile_is_written_before_its_store(name):
    """Each state warpgroup writes its output tile by transposing stmatrix in a device function
    TileLang does not see into (``STORE_OT_PRELUDE``); the call passes the tile as a write access,
    so the sync pass puts the warpgroup's 128-thread barrier between the call and the TMA store
    that reads the tile. Pin that barrier, the conversion for the variant's dtype, and the tile's
    128-byte swizzle that the device function assumes (the TMA store's layout)."""
    from tilelang import tvm

    with tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}):
        source = VARIANTS[name]().get_kernel_source()
    dtype = "bfloat16" if "bfloat16" in name else "float16"
    lines = [line.strip() for line in source.splitlines()]
    calls = [i for i, line in enumerate(lines) if line.startswith("flash_gdn_store_ot_trans_")]
    assert len(calls) == 2 and all(lines[i].startswith(f"flash_gdn_store_ot_trans_{dtype}(") for i in calls)
    for i in calls:
        store = next(k for k in range(i, len(lines)) if lines[k].startswith("tl::tma_store(o_desc"))
        assert any(line.startswith("tl::__sync_thread_partial(") for line in lines[i + 1:store]), lines[i:store]
    # the partial-chunk store reads the tile back with the same swizzle: chunk (c ^ row % 8)
    assert "((((((int)threadIdx.x) & 15) >> 3) + (((int)threadIdx.x) & 1)) & 1) * 8)" in source


@pytest.mark.parametrize("name", sorted(n for n in VARIANTS if n.startswith(ROLES_KERNEL)))
def test_roles_producer_loads_a_chunk_ahead_and_stores_pt_by_stmatrix(name):
    """The roles kernel's producer (s36) issues chunk c + 1's TMA loads (tiles and factor rows,
    into stage (c + 1) % 3 once ``empty`` frees it) before it waits for chunk c's and forms its
    P^T; P^T goes to its stage's tile by plain stmatrix (``flash_gdn_store_acc``) behind the
    producer's barrier and before its proxy fence; the pass over K Q^T is one exponential of a
    difference of base-2 exponents per element (no exp(min(.)) with a multiplied mask)."""
    from tilelang import tvm

    with tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}):
        source = VARIANTS[name]().get_kernel_source()
    dtype = "bfloat16" if "bfloat16" in name else "float16"
    lines = [line.strip() for line in source.splitlines()]
    loop = next(i for i, line in enumerate(lines) if line.startswith("for (int c = 0; c < num_chunks; ++c)"))
    next_empty = next(i for i in range(loop, len(lines)) if lines[i].startswith("empty[((c + 1) % 3)].wait("))
    next_loads = [i for i in range(loop, len(lines)) if "tl::tma_load(" in lines[i] and "((c + 1) % 3)" in lines[i]]
    this_wait = next(i for i in range(loop, len(lines)) if lines[i].startswith("loaded[(c % 3)].wait("))
    assert len(next_loads) == 7 and next_empty < min(next_loads) and max(next_loads) < this_wait
    store = next(i for i in range(this_wait, len(lines)) if lines[i].startswith("flash_gdn_store_acc_"))
    assert lines[store].startswith(f"flash_gdn_store_acc_{dtype}(pt, ")
    assert lines[store - 1].startswith("tl::__sync_thread_partial(") and lines[store + 1] == "tl::fence_proxy_async();"
    pass_lines = "\n".join(lines[this_wait:store])
    assert "exp2f(" in pass_lines and "min(" not in pass_lines.split("tl::wait_wgmma<0>();")[-1]


def _grads_roles_state_warpgroups(name: str) -> int:
    """State warpgroups of a ``state_grads_roles`` variant, from its column block (``bv=``)."""
    from flash_gdn.hopper.state_grads_roles import state_warpgroups

    return state_warpgroups(int(name.split("bv=")[1].split(",")[0].split("]")[0]))


@pytest.mark.parametrize("name", sorted(n for n in VARIANTS if n.startswith(GRADS_ROLES_KERNEL)))
def test_grads_roles_hand_stages_over_after_mt_and_back_after_their_products(name):
    """state_grads_roles: the producer hands a stage over (``full``) only after M^T is in shared
    memory and fenced for the async proxy, and each state warpgroup hands it back (``empty``) only
    after its last wgmma wait of the chunk; a state warpgroup rewrites its dS' and dV_new tiles only
    after the previous chunk's TMA stores have read them (store wait, then its own barrier)."""
    from tilelang import tvm

    with tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}):
        source = VARIANTS[name]().get_kernel_source()
    lines = [line.strip() for line in source.splitlines()]
    full = [i for i, line in enumerate(lines) if line.startswith("full[") and line.endswith(".arrive();")]
    empty = [i for i, line in enumerate(lines) if line.startswith("empty[") and line.endswith(".arrive();")]
    wg = _grads_roles_state_warpgroups(name)
    assert len(full) == 1 and len(empty) == wg, (full, empty)
    assert "tl::fence_proxy_async();" in lines[full[0] - 3:full[0]], lines[full[0] - 3:full[0] + 1]
    for i in empty:
        assert lines[i - 1] == "tl::wait_wgmma<0>();", lines[i - 2:i + 1]
    waits = [i for i, line in enumerate(lines) if line.startswith("tl::tma_store_wait<0")]
    barriers = [i for i, line in enumerate(lines) if line.startswith("tl::__sync_thread_partial(12")
                or line.startswith("tl::__sync_thread_partial(13")]
    assert len(barriers) == wg and all(lines[b - 1].startswith("tl::tma_store_wait<0") for b in barriers)
    assert len(waits) >= 2 * wg  # in the loop and after it


@pytest.mark.parametrize("name", sorted(n for n in VARIANTS if n.startswith("state_output_vmajor")))
def test_vmajor_state_is_a_register_operand(name):
    """The V-major forward feeds its state to wgmma from registers (wgmma with an RS operand)
    and never stages it in shared memory: only P^T and the output tile are stored there."""
    from tilelang import tvm

    with tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}):
        source = VARIANTS[name]().get_kernel_source()
    assert source.count("tl::wgmma_rs<") >= 4, f"{name}: products with the state or V_new not from registers"
    assert "state_s" not in source and "vn_s" not in source


@pytest.mark.parametrize("name", sorted(n for n in VARIANTS if n.startswith(("wy_grads", "qk_grads"))))
def test_chunk_parallel_grads_ask_for_two_ctas_per_sm(name):
    """wy_grads reads A_r from prepare_wu instead of recomputing the inverse, and qk_grads runs
    dq and dk in separate CTAs with one state tile each; both are under half an SM's shared
    memory, and two CTAs per SM (one's products overlapping the other's element-wise phases)
    was the measured win, so the launch bounds must keep asking for them (ptxas then holds
    the kernel to 128 registers)."""
    from tilelang import tvm

    with tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}):
        source = VARIANTS[name]().get_kernel_source()
    assert "__launch_bounds__(256, 2)" in source
    if name.startswith("wy_grads"):
        assert "blocked_unit_lower_inverse" not in source and "diag16" not in source
    else:  # whole chunks of dq and dk leave by TMA stores (guarded element stores were ~20 % of its instructions)
        assert source.count("tl::tma_store(") >= 2


@pytest.mark.parametrize("name", sorted(n for n in VARIANTS if n.startswith(("prepare_wu", "wy_grads"))))
def test_unused_chunk_slots_end_before_their_first_load(name):
    """A CTA of an unused chunk slot (a varlen plan's spare capacity, start == end) ends at once
    (``tiles.exit_if_empty``, s79: 6 % of these kernels' CTAs at 8 sequences of 1024 tokens), and it
    ends before the CTA issues its first TMA load, so no load is in flight into a CTA that has left."""
    from tilelang import tvm

    with tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}):
        source = VARIANTS[name]().get_kernel_source()
    body = source[source.index("__global__"):]
    exit_call = body.find("flash_gdn_exit_if_empty(")
    assert exit_call >= 0, f"{name}: unused chunk slots are not ended"
    assert body.count("flash_gdn_exit_if_empty(") == 1
    assert exit_call < body.index("tl::tma_load("), f"{name}: a TMA load before the exit"


PARTIAL_SUM_KERNELS = ("fused_grads", "qk_grads", "wy_grads")


@pytest.mark.parametrize("name", sorted(n for n in VARIANTS if n.startswith(PARTIAL_SUM_KERNELS)))
def test_sums_come_from_partial_sums_over_two_warpgroups(name):
    """These kernels' row and column sums are ``partial_sums``' shuffles over the accumulator layout
    of a 64-row product shared by two warpgroups (256 threads), not TileLang's reductions (a barrier
    and a shared round trip per element, s56); the device functions assume that thread count and
    that split (the products' N per warpgroup half the fragment's width)."""
    from tilelang import tvm

    with tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}):
        source = VARIANTS[name]().get_kernel_source()
    assert "__launch_bounds__(256" in source, f"{name}: not 256 threads"
    assert "fgdn_row_partials_" in source.split("__global__")[-1], f"{name}: no partial sums"
    assert "tl::AllReduce<tl::SumOp, 256" not in source, f"{name}: a TileLang reduction across the warpgroups"


@pytest.mark.parametrize("name", sorted(n for n in VARIANTS if n.startswith("qk_grads")))
def test_qk_grads_loads_each_value_heads_tiles_a_value_head_ahead(name):
    """The first value head's dO (and V_new, gamma, state tile) go out with q and k, before the
    value-head loop; each next one's, in each CTA role, after the current value head's products
    have finished (a full wgmma wait), behind a CTA barrier and the proxy fence that order the
    reads of those tiles before the TMA writes."""
    from tilelang import tvm

    with tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}):
        source = VARIANTS[name]().get_kernel_source()
    lines = [line.strip() for line in source.splitlines()]
    loads = [i for i, line in enumerate(lines) if line.startswith("tl::tma_load(do_desc")]
    loop = next(i for i, line in enumerate(lines) if line.startswith("for (int member"))
    assert len(loads) == 3 and loads[0] < loop < loads[1] < loads[2], (loads, loop)
    for i in loads[1:]:
        wait = max(j for j in range(loop, i) if lines[j] == "tl::wait_wgmma<0>();")
        between = lines[wait:i]
        assert "__syncthreads();" in between and "tl::fence_proxy_async();" in between
        assert between.index("__syncthreads();") < len(between) - 1 - between[::-1].index("tl::fence_proxy_async();")


def _stores_into(source: str, tile: str) -> list[str]:
    """The generated lines that write the shared tile ``tile`` from the threads (vector or
    scalar stores, stmatrix); TMA loads into it are not among them."""
    found = []
    for line in (raw.strip() for raw in source.splitlines()):
        if "stmatrix" in line and f"*){tile})" in line:
            found.append(line)
        elif line.startswith(("*(", "((")) and " = " in line and f"*){tile})" in line.split(" = ", 1)[0]:
            found.append(line)
    return found


_TILE_CONSUMERS = ("initialize_wgmma_descriptor", "CumSum1D", "tma_store(", "AtomicAdd")


@pytest.mark.parametrize("name", sorted(n for n in VARIANTS if n.startswith("qk_grads")))
def test_qk_grads_writes_out_each_barrier_its_shared_tiles_need(name):
    """qk_grads is built without TileLang's sync pass (s64), so its barriers are the source's. Each
    shared tile that threads write and a product (wgmma), the cumsum, a TMA store or dg's atomic
    adds then read has a ``__syncthreads()`` between its last write before that reader and the
    reader, in the generated code's order."""
    from tilelang import tvm

    with tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}):
        source = VARIANTS[name]().get_kernel_source()
    lines = [line.strip() for line in source.splitlines()]
    tiles = {m for line in lines for m in re.findall(r"\*\)(\w+)\)\[", line)}
    checked = 0
    for tile in sorted(tiles):
        writes = set(_stores_into(source, tile))
        written_at = [i for i, line in enumerate(lines)
                      if line in writes or ("CumSum1D" in line and line.rstrip(");").endswith(f"*){tile})[0])), 128"))]
        for i, line in enumerate(lines):
            if f"*){tile})" not in line or not any(c in line for c in _TILE_CONSUMERS) or i in written_at:
                continue
            before = [w for w in written_at if w < i]
            if not before:  # (a tile only TMA writes: its mbarrier orders it)
                continue
            checked += 1
            assert "__syncthreads();" in lines[before[-1]:i], f"{name}: {tile} written at line {before[-1]} and read at {i} with no barrier"
    assert checked >= 4, f"{name}: only {checked} reads checked"


@pytest.mark.parametrize("name", sorted(n for n in VARIANTS if n.startswith("qk_grads")))
def test_qk_grads_keeps_q_and_k_raw_in_shared_memory(name):
    """q and k enter qk_grads' products as loaded: their inverse norms are factors of the
    fragments those products make or read (Q K^T's rows, dQK's columns, the row dots), not a
    pass over the two tiles before the first product (s44: each such pass on the CTA's path
    cost more than the multiplies on fragments)."""
    from tilelang import tvm

    with tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}):
        source = VARIANTS[name]().get_kernel_source()
    for tile in ("q_tile", "k_tile"):
        assert f"*){tile})" in source, f"{name}: no {tile} in the source"
        assert not _stores_into(source, tile), f"{name}: {tile} written by the threads"


def _assemble(source: str, tmp_path, *extra: str):
    """nvcc on a kernel's generated CUDA with the flags TileLang compiles it with here
    (``launch.sm90_nvcc_command``), to an object file (``-c``, or what ``extra`` asks for); the
    completed process (ptxas's report in stderr)."""
    import subprocess

    from flash_gdn.hopper.launch import sm90_nvcc_command

    path = tmp_path / "kernel.cu"
    path.write_text(source)
    out = subprocess.run(sm90_nvcc_command(str(path), str(tmp_path / "kernel.o"), *extra, "-c"), capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    return out


SERIALISATION_WARNINGS = ("C7512", "C7514", "C7515")  # ptxas: "wgmma.mma_async instructions are serialized"


@pytest.mark.parametrize("name", sorted(
    n for n in VARIANTS
    if n.startswith(ASYNC_PRODUCT_KERNELS + ("qk_grads", "wy_grads", "forward_fused")) and "bfloat16" in n and "K=V=128" in n
))
def test_ptxas_keeps_wgmma_asynchronous(name, tmp_path):
    """When element-wise code touches the registers of an accumulator while a wgmma may still
    be writing them (or the register budget forces ptxas to move them), ptxas serialises every
    wgmma of the kernel, which undoes the asynchronous issue, and only says so in a warning
    (pairing wy_grads' products at its 128-register cap did this). The kernels that issue
    products asynchronously are assembled here and the warning is an error."""
    from tilelang import tvm

    with tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}):
        source = VARIANTS[name]().get_kernel_source()
    out = _assemble(source, tmp_path, "-Xptxas", "-v")
    serialised = [line for line in out.stderr.splitlines() if any(w in line for w in SERIALISATION_WARNINGS)]
    assert not serialised, f"{name}: {serialised}"
    if name.startswith(GRADS_ROLES_KERNEL):
        from flash_gdn.hopper import state_grads_roles

        launch = state_grads_roles.ROLE_REGS[_grads_roles_state_warpgroups(name)][0]
        assert f"Used {launch} registers" in out.stderr, out.stderr[-2000:]
        assert "0 bytes spill stores" in out.stderr, out.stderr[-2000:]
        # (C7517: ptxas waits for the products before element-wise code it could not order after them)
        assert "C7517" not in out.stderr, out.stderr[-2000:]
    if name.startswith(("forward_fused", ROLES_KERNEL)):
        # Their roles' setmaxnreg counts only move registers within the launch count x threads
        # (an increase that cannot be met hangs): the launch count must stay what they assume.
        from flash_gdn.hopper import forward_fused, state_output_roles

        module = forward_fused if name.startswith("forward_fused") else state_output_roles
        assert f"Used {module.THREAD_REGS} registers" in out.stderr, out.stderr[-2000:]
        if module is state_output_roles:  # (the opt-in forward_fused spills today)
            assert "0 bytes spill stores" in out.stderr, out.stderr[-2000:]


@pytest.mark.parametrize("name", sorted(n for n in VARIANTS if n.startswith((ROLES_KERNEL, GRADS_ROLES_KERNEL, "forward_fused"))))
def test_setmaxnreg_moves_each_role_the_way_its_count_lies(name):
    """A role's ``setmaxnreg`` raises its registers (``warpgroup_reg_alloc``) only to a count above
    the launch count and lowers them (``warpgroup_reg_dealloc``) only to one below it: a decrease to
    a count above the current one is an illegal instruction on the GPU (s68: a producer set to 224
    of 168 by ``dealloc``). The launch count is the most 65536 registers give each of the
    ``__launch_bounds__`` threads (in steps of 8), the count ``test_ptxas_keeps_wgmma_asynchronous``
    pins where it assembles."""
    from tilelang import tvm

    with tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}):
        source = VARIANTS[name]().get_kernel_source()
    threads = int(re.search(r"__launch_bounds__\((\d+)", source).group(1))
    launch = min(255, 65536 // threads) // 8 * 8
    raised = [int(n) for n in re.findall(r"warpgroup_reg_alloc<(\d+)>", source)]
    lowered = [int(n) for n in re.findall(r"warpgroup_reg_dealloc<(\d+)>", source)]
    assert raised or lowered, f"{name}: no setmaxnreg"
    assert all(n > launch for n in raised) and all(n < launch for n in lowered), (name, launch, raised, lowered)


def test_exponentials_flush_denormals(tmp_path):
    """Every kernel compiles with -ftz=true (``launch.COMPILE_FLAGS``): an exponential is then one
    multiply and MUFU.EX2 in the PTX's ex2.approx.ftz, without the denormal range fix-up of the
    non-ftz form. Pinned on the forward's prepare_wu, whose exponentials are 32 a thread."""
    from tilelang import tvm

    from flash_gdn.hopper import prepare_wu

    with tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}):
        kernel = prepare_wu.build_prepare_wu(128, 128, "bfloat16", "float32", *prepare_wu.FORWARD_OUTPUTS)
    _assemble(kernel.get_kernel_source(), tmp_path, "-ptx")
    ptx = (tmp_path / "kernel.o").read_text()  # (-ptx: the "object" is the PTX)
    assert "ex2.approx.ftz.f32" in ptx
    assert "ex2.approx.f32" not in ptx


@pytest.mark.parametrize("outputs", ["FORWARD_OUTPUTS", "FORWARD_CP_OUTPUTS"])
def test_forward_prepare_inverts_the_gated_matrix(outputs):
    """The forward-only prepare_wu variants (A_r neither kept nor read) take the inverse of the
    gated L, so the pair decay's exponentials are in L's pass, before the inverse, and the pass
    after it has none: A_g = inv diag(beta)."""
    from tilelang import tvm

    from flash_gdn.hopper import prepare_wu

    with tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}):
        source = prepare_wu.build_prepare_wu(128, 128, "bfloat16", "float32", *getattr(prepare_wu, outputs)).get_kernel_source()
    # Where the inverse starts: the scaled mma inverse's call in the kernel body (the default since
    # s59: it writes A_g = inv diag(beta) itself, so the kernel has no pass after it), else the
    # blocked inverse's substitution chain.
    call = source.find("flash_gdn_inverse64_scaled<true>((")
    assert call >= 0 or not prepare_wu.MMA_INVERSE
    inverse = call if call >= 0 else source.index("* column[j]")
    assert source.count("__expf(") > 0
    assert source.rindex("__expf(") < inverse, "an exponential after the inverse"


@pytest.mark.parametrize("outputs", ["FORWARD_OUTPUTS", "FORWARD_CP_OUTPUTS"])
def test_forward_keeping_a_r_inverts_in_the_scaled_tiles(outputs):
    """The training forward's prepare_wu variants (``with_inverse`` of the forward's outputs, also
    the backward's recompute without W) take the scaled inverse that keeps A_r (s60): it writes A_g
    with the pair decay itself and leaves A_r in fp16 in its own tile, which goes to HBM by 16-byte
    stores, not through a TMA store from a staging tile; the kernel has no exponential pass after it."""
    from tilelang import tvm

    from flash_gdn.hopper import prepare_wu

    variant = prepare_wu.with_inverse(getattr(prepare_wu, outputs))
    with tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}):
        source = prepare_wu.build_prepare_wu(128, 128, "bfloat16", "float32", *variant).get_kernel_source()
    body = source[source.index("prepare_wu_kernel("):]
    call = body.find("flash_gdn_inverse64_scaled<true, true>((")
    assert call >= 0 or not prepare_wu.MMA_INVERSE
    if call >= 0:
        assert "a_r_desc" not in body, "A_r through a TMA store"
        assert "*(uint4*)(a_r + " in body, "A_r not by 16-byte stores"
        assert "__expf(" not in body[call:], "an exponential after the inverse"
