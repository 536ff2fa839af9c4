"""The deterministic Triton attention (CUDA's --enable-deterministic-inference attention) on CPU:
in Triton's interpreter it matches a float64 reference (causal, GQA, sliding window, soft-cap,
FP8 pool with scales), and a query row's output has the same bits alone, beside decode
companions (both split into segment programs), inside extend tiles after a cached prefix
(sequential) and from the decode graph's tables (sequential and split variants). The
interpreter's arithmetic is not the GPU's (test_gpu_deterministic.py checks that); what this
checks is the masking, the guard for blocks a row does not see, and the tables. It also
compiles the kernel for Hopper (sm_90) without a GPU. fp16 and float32 only: the interpreter
multiplies bf16 as raw bits.
"""

from __future__ import annotations

import os
import subprocess
import tempfile

import pytest
import torch

from triton_interpreter import ROW_BY_ROW_DOT, run_in_interpreter

TESTS = os.path.dirname(os.path.abspath(__file__))

# Segments of one key block, so that the rows checked (up to 320 keys) span several: a split
# decode merges them in the combine kernel, a sequential one in the attention kernel.
SMALL_SEGMENTS = "from radixlm.srt.executor.attention import deterministic_triton; deterministic_triton.SEGMENT = 64\n"

REFERENCE_CHECK = SMALL_SEGMENTS + f"""
import sys, torch
sys.path.insert(0, {TESTS!r})
from deterministic_attention_checks import FP8, SPECS, Setup, worst_error
worst = {{}}
for heads, kv_heads, head_dim, dtype, pool, specs in [
        (8, 2, 32, torch.half, torch.half, SPECS), (6, 2, 24, torch.half, torch.half, SPECS[3:]),
        (4, 4, 16, torch.float32, torch.float32, SPECS[:2]), (8, 2, 32, torch.half, FP8, SPECS[::2])]:
    setup = Setup(heads, kv_heads, head_dim, dtype, pool, max_len=256, scales=(0.5, 1.5))
    for spec in specs:
        worst[(str(dtype), str(pool), heads, spec)] = worst_error(setup, spec)
print(max(worst.values()) if all(v < (1e-5 if k[0] == "torch.float32" else 4e-3) for k, v in worst.items()) else worst)
"""

INVARIANCE_CHECK = ROW_BY_ROW_DOT + SMALL_SEGMENTS + f"""
import sys, torch
sys.path.insert(0, {TESTS!r})
from deterministic_attention_checks import FP8, SPECS, Setup, differing, variants_of_one_row
bad = {{}}
# float32 too: its outputs keep the rounding of the merges that fp16 outputs round away.
for dtype, pool, specs in ((torch.half, torch.half, SPECS[::3]), (torch.half, FP8, SPECS[::3]),
                           (torch.float32, torch.float32, SPECS[:1])):
    setup = Setup(8, 2, 32, dtype, pool, rows=12, max_len=320, scales=(0.5, 1.5))
    for spec in specs:
        found = variants_of_one_row(setup, spec, trials=3, max_companions=6)
        if differing(found):
            bad[(str(dtype), str(pool), spec)] = differing(found)
print(bad or f"ok {{len(found)}}")
"""

# Fewer cascade and split programs than pairs and segments: each program takes several.
FEW_PROGRAMS = "deterministic_triton.CASCADE_PROGRAMS = 3; deterministic_triton.SPLIT_BELOW_PROGRAMS = 16\n"

CASCADE_CHECK = ROW_BY_ROW_DOT + SMALL_SEGMENTS + FEW_PROGRAMS + f"""
import sys, torch
sys.path.insert(0, {TESTS!r})
from deterministic_attention_checks import FP8, SPECS, Setup, cascade_variants, differing
bad = {{}}
for dtype, pool, spec in ((torch.half, FP8, SPECS[2]), (torch.float32, torch.float32, SPECS[0])):
    setup = Setup(8, 2, 32, dtype, pool, rows=40, max_len=320, scales=(0.5, 1.5))
    found = cascade_variants(setup, spec, max_len=320)
    if differing(found):
        bad[(str(dtype), str(pool), spec)] = differing(found)
print(bad or f"ok {{len(found)}}")
"""


def test_kernel_matches_a_float64_reference():
    """fp16: GQA 4:1 with every spec (the blocks a window starts in, soft-caps, both), a group of
    3 with head_dim 24 (padded to 32), float32 (IEEE products) and an FP8 pool with its scales."""
    result = run_in_interpreter(REFERENCE_CHECK)
    assert float(result) < 4e-3, result


def test_a_row_has_the_same_bits_alone_in_batches_in_extend_tiles_and_graph_tables():
    result = run_in_interpreter(INVARIANCE_CHECK)
    assert result.startswith("ok"), result


def test_a_row_has_the_same_bits_in_cascade_decode_steps():
    """Decode steps whose requests share segments of slots (a cached prefix) read those once
    per group tile; the row's bits equal its own split computation (an FP8 pool with a soft-cap,
    float32)."""
    result = run_in_interpreter(CASCADE_CHECK)
    assert result == "ok 6", result


def test_backend_plans_graph_tables_with_padding_and_falls_back_when_they_are_full(monkeypatch):
    from deterministic_attention_checks import Setup, decode_batch

    from radixlm.srt.executor.attention import deterministic_cuda
    from radixlm.srt.executor.attention.deterministic_cuda import TritonDeterministicBackend
    from radixlm.srt.executor.mem_pool import KVPool

    setup = Setup(8, 2, 16, torch.half, torch.half, rows=8, max_len=64)
    pool = KVPool(40, 1, 2, 16, torch.half, "cpu")
    backend = TritonDeterministicBackend(pool, setup.table, 0.25, 8)
    assert backend.supports_cuda_graph
    backend.init_cuda_graph_state(4, 16)
    # Room for 4 requests at full context (64 tokens), though that is more than twice the pool:
    # requests on one cached prefix list its slots once each.
    assert backend._graph.slots.numel() == 4 * 64
    monkeypatch.setattr(deterministic_cuda, "GRAPH_SLOT_TABLE_BYTES", 4 * 50)
    backend.init_cuda_graph_state(4, 16)
    assert backend._graph.slots.numel() == 80  # twice the pool, above the (patched) byte cap
    loc = torch.zeros(4, dtype=torch.int64)
    handle = backend.capture_cuda_graph_plan("decode", 4, loc)
    assert backend._tables.kv_indptr[:5].tolist() == [0, 1, 2, 3, 4]  # all padding: one key each
    batch = decode_batch([2, 5], [10, 30])
    backend.replay_cuda_graph_plan("decode", handle, batch, 4, loc)
    tables = backend._tables
    assert tables.num_tiles == 4 and tables.kv_indptr[:5].tolist() == [0, 10, 40, 41, 42]
    assert tables.slots[:40].tolist() == setup.table[2, :10].tolist() + setup.table[5, :30].tolist()
    assert tables.slots[40:42].tolist() == [0, 0]  # the padding rows' key, on the padding page
    assert backend.graph_can_replay(batch)
    assert not backend.graph_can_replay(decode_batch([1, 2], [50, 40]))  # 90 keys: more than the table holds


def test_backend_runs_a_decode_step_with_shared_segments_as_a_cascade_step(monkeypatch):
    """Requests holding the same slots for whole segments: once the reads saved pass the
    threshold, plan() makes a cascade step (group tiles, each member skipping the shared
    segments) and a graph bucket replays its cascade variant, whose fixed tables hold the same
    plan; windows and --disable-cascade-attention keep the step plain."""
    from deterministic_attention_checks import Setup, decode_batch

    from radixlm.srt.executor.attention import deterministic_cuda
    from radixlm.srt.executor.attention import deterministic_triton as kernel
    from radixlm.srt.executor.attention.deterministic_cuda import CASCADE_GRAPH_VARIANT, TritonDeterministicBackend
    from radixlm.srt.executor.attention.layer_spec import LayerAttention
    from radixlm.srt.executor.mem_pool import KVPool

    monkeypatch.setattr(kernel, "SEGMENT", 64)
    setup = Setup(8, 2, 16, torch.half, torch.half, rows=8, max_len=256)
    setup.table[1:6, :150] = setup.table[0, :150]  # rows 0-5 share 150 slots: two whole segments
    pool = KVPool(2048, 1, 2, 16, torch.half, "cpu")
    batch = decode_batch([0, 1, 6, 2, 3, 4, 5], [200, 180, 100, 256, 151, 170, 160])
    key_bytes = 2 * 2 * 16 * 2  # K and V, 2 KV heads of 16 halves
    saved = 5 * 128  # five members read the two segments the first one reads for them

    def backend(min_saved_bytes, **kwargs):
        monkeypatch.setattr(deterministic_cuda, "CASCADE_MIN_SAVED_BYTES", min_saved_bytes)
        made = TritonDeterministicBackend(pool, setup.table, 0.25, 8, **kwargs)
        made.init_cuda_graph_state(8, 16)
        made.plan(batch)
        return made

    made = backend(saved * key_bytes)
    tables = made._tables
    assert tables.cascade_programs == 2 and tables.cascade_items.tolist() == [0, 0, 0, 1]  # tile 0, segments 0, 1
    assert tables.cascade_count.tolist() == [2] and tables.group_members.tolist() == [0, 1, 3, 4, 5, 6] + [-1] * 10
    assert tables.tile_skip.tolist() == [2, 2, 0, 2, 2, 2, 2] and tables.segments == 4 and tables.split_programs == 2
    assert CASCADE_GRAPH_VARIANT in made.cuda_graph_variants(8)
    assert made.choose_cuda_graph_variant(batch, 8) == CASCADE_GRAPH_VARIANT
    loc = torch.zeros(8, dtype=torch.int64)
    handle = made.capture_cuda_graph_plan(CASCADE_GRAPH_VARIANT, 8, loc)
    assert made._tables.cascade_count.tolist() == [0]  # captured with nothing shared
    made.replay_cuda_graph_plan(CASCADE_GRAPH_VARIANT, handle, batch, 8, loc)
    graph = made._tables
    assert graph.cascade_count.tolist() == [2] and graph.cascade_items[:4].tolist() == [0, 0, 0, 1]
    assert graph.group_members[:16].tolist() == [0, 1, 3, 4, 5, 6] + [-1] * 10
    assert graph.tile_skip.tolist() == [2, 2, 0, 2, 2, 2, 2, 0]  # the padding row skips nothing
    assert graph.segments == 4 and graph.split_programs == 16 and graph.cascade_programs == kernel.CASCADE_PROGRAMS
    made = backend(saved * key_bytes + 1)
    assert made._tables.cascade_programs == 0 and made.choose_cuda_graph_variant(batch, 8) != CASCADE_GRAPH_VARIANT
    for plain in (backend(1, cascade=False), backend(1, layers=[LayerAttention(100, None)])):
        assert plain._tables.cascade_programs == 0 and CASCADE_GRAPH_VARIANT not in plain.cuda_graph_variants(8)


def test_kernel_compiles_for_hopper_without_spilling():
    """Both kernels for sm_90 at the 8B shape (head_dim 128, groups of 4): sequential and split,
    bf16 and an FP8 pool with soft-cap and window; tensor-core products, no spills."""
    triton = pytest.importorskip("triton")

    from radixlm.srt.executor.attention import deterministic_kernels as kernels
    from radixlm.srt.executor.attention import deterministic_triton as kernel

    pointer_types = {"q_ptr": "*bf16", "out_ptr": "*bf16", "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32"}
    for kv_type, softcap, window, split in (("*bf16", False, False, False), ("*fp8e4nv", True, True, False),
                                            ("*bf16", False, False, True), ("*fp8e4nv", True, True, True)):
        compiled = _compile(triton, kernels.attend_kernel, {**pointer_types, "k_ptr": kv_type, "v_ptr": kv_type},
                            dict(GROUP=4, HEADS_PER_TILE=4, CHUNKS=1, HEAD_DIM=128, BLOCK_D=128, BLOCK_M=kernel.BLOCK_M,
                                 KEY_BLOCK=kernel.KEY_BLOCK, SEGMENT=kernel.SEGMENT, SPLIT=split, SOFTCAP=softcap,
                                 WINDOW=window, PRECISION="tf32"),
                            kernel.num_warps(128), kernel.NUM_STAGES)
        assert "wgmma" in compiled.asm["ptx"]  # Hopper's tensor-core products
        assert " 0 bytes spill stores" in _ptxas_report(compiled.asm["ptx"])
    for kv_type, softcap in (("*bf16", False), ("*fp8e4nv", True)):
        compiled = _compile(triton, kernels.cascade_kernel, {**pointer_types, "k_ptr": kv_type, "v_ptr": kv_type},
                            dict(GROUP=4, HEADS_PER_TILE=4, CHUNKS=1, HEAD_DIM=128, BLOCK_D=128, BLOCK_M=kernel.BLOCK_M,
                                 KEY_BLOCK=kernel.KEY_BLOCK, SEGMENT=kernel.SEGMENT, SOFTCAP=softcap, PRECISION="tf32"),
                            kernel.num_warps(128), kernel.NUM_STAGES)
        assert "wgmma" in compiled.asm["ptx"]
        assert " 0 bytes spill stores" in _ptxas_report(compiled.asm["ptx"])
    combine = _compile(triton, kernels.combine_kernel, pointer_types,
                       dict(HEAD_DIM=128, BLOCK_D=128, KEY_BLOCK=kernel.KEY_BLOCK, SEGMENT=kernel.SEGMENT, WINDOW=True),
                       1, 1)
    assert " 0 bytes spill stores" in _ptxas_report(combine.asm["ptx"])


def _compile(triton, fn, pointer_types: dict, constexprs: dict, warps: int, stages: int):
    """`fn` compiled for sm_90 with FMA contraction off (as attend launches it), pointers and
    strides marked 16-aligned as the launch's arguments are."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    params = fn.params
    signature = {p.name: "constexpr" if p.is_constexpr else pointer_types.get(p.name, "*i32") if p.name.endswith("_ptr")
                 else "fp32" if p.name in ("qk_scale", "v_scale", "softcap") else "i32" for p in params}
    hints = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params)
             if not p.is_constexpr and (p.name.endswith("_ptr") or p.name.startswith("stride"))}
    compiled = triton.compile(ASTSource(fn, signature, constexprs, hints), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": stages, "enable_fp_fusion": False})
    assert compiled.asm["cubin"]
    return compiled


def _ptxas_report(ptx: str) -> str:
    """ptxas -v's register and spill lines for the PTX, by the ptxas Triton compiles with."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as source:
        source.write(ptx)
        source.flush()
        done = subprocess.run([get_ptxas(90).path, "-v", "-arch=sm_90a", source.name, "-o", os.devnull],
                              capture_output=True, text=True, check=True)
    return done.stderr
