"""The ruler's charges (bench/predict/ruler.py, bench/predict/cluster.py, bench/predict/gemm_rates.py, bench/predict/calibration.py) on
hand-written HLO modules: the per-kernel floor, a collective whose group crosses nodes, overlap read from
the schedule, GEMM rates from the measured rows, and the calibration bias recomputed from its points.
No compile, no plugin: seconds."""
import math

import pytest

from bench.predict import calibration
from bench.predict import cluster
from bench.predict import gemm_rates
from bench.predict import peaks
from bench.predict import ruler

GiB = 2 ** 30


def _module(entry_body: str, extra: str = "", partitions: int = 8) -> str:
  return f"""HloModule m, is_scheduled=true, num_partitions={partitions}

%fused_neg (p0: f32[{N}]) -> f32[{N}] {{
  %p0 = f32[{N}]{{0}} parameter(0)
  ROOT %n = f32[{N}]{{0}} negate(%p0)
}}

%fused_tiny (q0: f32[4]) -> f32[4] {{
  %q0 = f32[4]{{0}} parameter(0)
  ROOT %e = f32[4]{{0}} exponential(%q0)
}}
{extra}
ENTRY %main (a: f32[{N}], g: bf16[1,4194304], t: f32[4]) -> f32[{N}] {{
{entry_body}
}}
"""


N = 1 << 26     # 256 MiB of f32: a fusion reading and writing it moves 512 MiB


# ------------------------------------------------------------------ the per-kernel floor

LOOP = """
%cond (s: (s32[], f32[4])) -> pred[] {
  %s = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %k = s32[] constant(10)
  ROOT %lt = pred[] compare(%i, %k), direction=LT
}

%body (s: (s32[], f32[4])) -> (s32[], f32[4]) {
  %s = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %v = f32[4]{0} get-tuple-element(%s), index=1
  %f1 = f32[4]{0} fusion(%v), kind=kLoop, calls=%fused_tiny
  %f2 = f32[4]{0} fusion(%f1), kind=kLoop, calls=%fused_tiny
  %f3 = f32[4]{0} fusion(%f2), kind=kLoop, calls=%fused_tiny
  %one = s32[] constant(1)
  %j = s32[] add(%i, %one)
  ROOT %out = (s32[], f32[4]{0}) tuple(%j, %f3)
}
"""


def test_the_floor_is_charged_once_per_kernel_launch():
  text = _module("""  %a = f32[67108864]{0} parameter(0)
  %g = bf16[1,4194304]{1,0} parameter(1)
  %t = f32[4]{0} parameter(2)
  %z = s32[] constant(0)
  %init = (s32[], f32[4]{0}) tuple(%z, %t)
  %w = (s32[], f32[4]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"10"}}
  ROOT %r = f32[67108864]{0} fusion(%a), kind=kLoop, calls=%fused_neg""", LOOP)
  with_floor = ruler.predict(text, "h200", "hgx_h200")
  without = ruler.predict(text, "h200", "hgx_h200", floor_s=0.0)
  # 3 fusions x 10 trips + the add (a standalone op: a kernel) x 10 + the compare x 11 + the entry's fusion
  assert with_floor["compute_kernels"] == 3 * 10 + 10 + 11 + 1 == 52
  assert with_floor["floor_s"] == pytest.approx(52 * ruler.KERNEL_FLOOR_S)
  assert with_floor["step_s"] - without["step_s"] == pytest.approx(52 * ruler.KERNEL_FLOOR_S, rel=1e-9)
  assert ruler.KERNEL_FLOOR_S == 1e-6      # XLA's kKernelLaunchOverhead
  # the big fusion: its bytes at the derated HBM bandwidth, plus one floor
  hbm = peaks.peaks("h200")["hbm"]
  assert without["step_s"] == pytest.approx(2 * 4 * N / hbm, rel=1e-3)


# ------------------------------------------------------------------ collectives on a cluster

def test_replica_groups_in_every_form():
  assert cluster.replica_groups("replica_groups=mesh['fsdp'=8,'expert'=8] {'fsdp'}", 64)[1] == \
      [1, 9, 17, 25, 33, 41, 49, 57]
  assert cluster.replica_groups("replica_groups=mesh['fsdp'=8,'expert'=8] {'expert'}", 64)[1] == list(range(8, 16))
  assert cluster.replica_groups("replica_groups=[2,4]<=[4,2]T(1,0)", 8) == [[0, 2, 4, 6], [1, 3, 5, 7]]
  assert cluster.replica_groups("replica_groups={{0,1},{2,3}}", 4) == [[0, 1], [2, 3]]
  assert cluster.replica_groups("replica_groups={}", 4) == [[0, 1, 2, 3]]
  with pytest.raises(ValueError, match="not in the mesh"):
    cluster.replica_groups("replica_groups=mesh['a'=2] {'b'}", 2)


def test_replica_groups_of_a_mesh_with_device_ids_and_sub_axes():
  """XLA prints a mesh whose devices are not in iota order with ``device_ids``, as an iota ``[dims]T(perm)`` or
  a list, and a factor of an axis as ``'a':(pre)size`` (the ``size`` factor after the major ``pre``)."""
  # device_ids iota(8).reshape(2, 4).T: mesh position (i, j) holds device 4j + i
  attrs = "replica_groups=mesh['a'=4,'b'=2], device_ids=([2,4]T(1,0)) {'a'}, dimensions={0}"
  assert cluster.replica_groups(attrs, 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
  assert cluster.replica_groups("replica_groups=mesh['a'=4,'b'=2], device_ids=([2,4]T(1,0)) {'b'}", 8) == \
      [[0, 4], [1, 5], [2, 6], [3, 7]]
  assert cluster.replica_groups("replica_groups=mesh['a'=2,'b'=2], device_ids=(0,2,1,3) {'b'}", 4) == [[0, 2], [1, 3]]
  assert cluster.replica_groups("replica_groups=mesh['a'=8] {'a':(2)2}", 8) == [[0, 2], [1, 3], [4, 6], [5, 7]]
  assert cluster.replica_groups("replica_groups=mesh['a'=8] {'a':(1)2,'a':(4)2}", 8) == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_a_group_spans_the_nodes_of_its_devices_not_of_its_partitions():
  """Partition p runs on the mesh's p-th device (``partition_devices``, recorded by gpu_aot): a mesh laid out in
  nodes puts partitions 0 and 1 on devices 0 and 8, in two HGX nodes, though 0 // 8 == 1 // 8."""
  c = cluster.CLUSTERS["hgx_b200"]
  groups = [[0, 1], [2, 3]]
  assert not cluster.placement(groups, c).crosses_nodes
  spread = [0, 8, 1, 9] + list(range(2, 8)) + list(range(10, 16))
  where = cluster.placement(groups, c, spread)
  assert where.crosses_nodes and (where.nodes, where.per_node) == (2, 1)
  text = _gather("mesh['fsdp'=8,'expert'=8] {'expert'}")
  order = [d for n in range(8) for d in range(n, 64, 8)]   # partition 8n + k on device 8k + n
  inside, across = ruler.predict(text, "b200", "hgx_b200"), ruler.predict(text, "b200", "hgx_b200",
                                                                          partition_devices=order)
  assert [r["crosses_nodes"] for r in inside["collectives"]] == [False]
  assert [r["crosses_nodes"] for r in across["collectives"]] == [True]
  assert across["comm_s"] > 15 * inside["comm_s"]


def _gather(groups: str) -> str:
  return f"""HloModule m, is_scheduled=true, num_partitions=64

ENTRY %main (g: bf16[1,4194304]) -> bf16[8,4194304] {{
  %g = bf16[1,4194304]{{1,0}} parameter(0)
  ROOT %ag = bf16[8,4194304]{{1,0}} all-gather(%g), channel_id=1, replica_groups={groups}, dimensions={{0}}, use_global_device_ids=true
}}
"""


def test_a_collective_whose_group_crosses_nodes_runs_at_the_network():
  across = ruler.predict(_gather("mesh['fsdp'=8,'expert'=8] {'fsdp'}"), "b200", "hgx_b200")
  inside = ruler.predict(_gather("mesh['fsdp'=8,'expert'=8] {'expert'}"), "b200", "hgx_b200")
  S = 8 * 4194304 * 2
  c = cluster.CLUSTERS["hgx_b200"]
  (row,) = across["collectives"]
  assert row["crosses_nodes"] and row["nodes"] == 8 and row["group_size"] == 8
  expect_across = c.inter_launch_s + c.inter_rtt_s * 7 + S * 7 / 8 / 50e9
  expect_inside = cluster.NCCL_LAUNCH_S + S * 7 / 8 / 900e9
  assert across["comm_s"] == pytest.approx(expect_across)
  assert inside["comm_s"] == pytest.approx(expect_inside)
  assert across["exposed_comm_s"] == pytest.approx(expect_across)    # synchronous: exposed whole
  assert across["comm_s"] > 15 * inside["comm_s"]
  # one NVLink domain of 72 holds the 8 nodes' worth of GPUs: the same groups stay on NVLink
  nvl72 = ruler.predict(_gather("mesh['fsdp'=8,'expert'=8] {'fsdp'}"), "b200", "gb200_nvl72")
  assert nvl72["comm_s"] == pytest.approx(expect_inside)


def test_ring_factors_by_kind():
  c = cluster.CLUSTERS["hgx_h200"]
  where = cluster.Placement(group_size=4, nodes=1, per_node=4)
  S = 1e9
  lat = cluster.NCCL_LAUNCH_S
  assert cluster.collective_seconds("all-gather", S, where, c) == pytest.approx(lat + S * 3 / 4 / 450e9)
  assert cluster.collective_seconds("reduce-scatter", S, where, c) == pytest.approx(lat + S * 3 / 4 / 450e9)
  assert cluster.collective_seconds("all-reduce", S, where, c) == pytest.approx(lat + 2 * S * 3 / 4 / 450e9)
  assert cluster.collective_seconds("all-to-all", S, where, c) == pytest.approx(lat + S * 3 / 4 / 450e9)
  assert cluster.collective_seconds("all-gather", S, cluster.Placement(1, 1, 1), c) == 0.0


def test_a_group_with_several_gpus_per_node_uses_their_nics():
  """NCCL's rings leave each node through different GPUs' NICs: a group of 8 nodes x 8 GPUs moves its share
  between nodes over 8 NICs, a group of one GPU per node over one, a send over one; never faster than NVLink."""
  c = cluster.CLUSTERS["hgx_b200"]
  S = 1e9
  every = cluster.Placement(group_size=64, nodes=8, per_node=8)
  one = cluster.Placement(group_size=8, nodes=8, per_node=1)
  lat = lambda where, steps: c.inter_launch_s + c.inter_rtt_s * steps
  assert cluster.collective_seconds("reduce-scatter", S, every, c) == pytest.approx(
      lat(every, 63 / 8) + S * 63 / 64 / (8 * 50e9))
  assert cluster.collective_seconds("all-reduce", S, every, c) == pytest.approx(
      c.inter_launch_s + 2 * c.inter_rtt_s * 63 / 8 + 2 * S * 63 / 64 / (8 * 50e9))
  assert cluster.collective_seconds("reduce-scatter", S, one, c) == pytest.approx(lat(one, 7) + S * 7 / 8 / 50e9)
  assert cluster.collective_seconds("collective-permute", S, cluster.Placement(2, 2, 1), c) == pytest.approx(
      lat(None, 1) + S / 50e9)
  slow_nvlink = cluster.dataclasses.replace(c, nvlink_Bps=200e9)     # 8 NICs' 400 GB/s past NVLink's 200
  assert cluster.collective_seconds("all-gather", S, every, slow_nvlink) == pytest.approx(
      lat(every, 63 / 8) + S * 63 / 64 / 200e9)


# ------------------------------------------------------------------ overlap read from the schedule

def _overlap(between: bool) -> str:
  work = "  %f = f32[67108864]{0} fusion(%a), kind=kLoop, calls=%fused_neg"
  start = ("  %ags = (bf16[1,4194304]{1,0}, bf16[8,4194304]{1,0}) all-gather-start(%g), channel_id=1, "
           "replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, use_global_device_ids=true")
  done = "  %agd = bf16[8,4194304]{1,0} all-gather-done(%ags)"
  order = [start, work, done] if between else [start, done, work]
  return _module("""  %a = f32[67108864]{0} parameter(0)
  %g = bf16[1,4194304]{1,0} parameter(1)
  %t = f32[4]{0} parameter(2)
""" + "\n".join(order) + "\n  ROOT %r = f32[67108864]{0} copy(%f)")


def test_an_async_collective_hides_behind_the_work_scheduled_inside_it():
  hidden = ruler.predict(_overlap(between=True), "h200", "hgx_h200")
  exposed = ruler.predict(_overlap(between=False), "h200", "hgx_h200")
  coll = cluster.NCCL_LAUNCH_S + 8 * 4194304 * 2 * 7 / 8 / 450e9
  work = 2 * 4 * N / peaks.peaks("h200")["hbm"] + ruler.KERNEL_FLOOR_S
  assert hidden["comm_s"] == pytest.approx(coll) and exposed["comm_s"] == pytest.approx(coll)
  assert exposed["exposed_comm_s"] == pytest.approx(coll)
  assert hidden["exposed_comm_s"] == pytest.approx(max(0.0, coll - work))
  assert exposed["step_s"] - hidden["step_s"] == pytest.approx(min(coll, work))
  assert exposed["step_s"] == pytest.approx(exposed["compute_s"] + coll)


PIPELINED = """
%cond (s: (s32[], (bf16[1,4194304], bf16[8,4194304]), bf16[1,4194304])) -> pred[] {
  %s = (s32[], (bf16[1,4194304]{1,0}, bf16[8,4194304]{1,0}), bf16[1,4194304]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %k = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %k), direction=LT
}

%body (s: (s32[], (bf16[1,4194304], bf16[8,4194304]), bf16[1,4194304])) -> (s32[], (bf16[1,4194304], bf16[8,4194304]), bf16[1,4194304]) {
  %s = (s32[], (bf16[1,4194304]{1,0}, bf16[8,4194304]{1,0}), bf16[1,4194304]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %prev = (bf16[1,4194304]{1,0}, bf16[8,4194304]{1,0}) get-tuple-element(%s), index=1
  %g = bf16[1,4194304]{1,0} get-tuple-element(%s), index=2
  %agd = bf16[8,4194304]{1,0} all-gather-done(%prev)
  %ags = (bf16[1,4194304]{1,0}, bf16[8,4194304]{1,0}) all-gather-start(%g), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, use_global_device_ids=true
  %one = s32[] constant(1)
  %j = s32[] add(%i, %one)
  ROOT %out = (s32[], (bf16[1,4194304]{1,0}, bf16[8,4194304]{1,0}), bf16[1,4194304]{1,0}) tuple(%j, %ags, %g)
}
"""


def test_a_collective_carried_to_the_next_trip_is_waited_for_there():
  """Started at the end of one trip, done at the top of the next with no work between: exposed whole,
  per trip, once the walk follows the loop's carried tuple (before, the done was not matched to its start
  and the collective counted as hidden)."""
  text = _module("""  %a = f32[67108864]{0} parameter(0)
  %g = bf16[1,4194304]{1,0} parameter(1)
  %t = f32[4]{0} parameter(2)
  %z = s32[] constant(0)
  %ags0 = (bf16[1,4194304]{1,0}, bf16[8,4194304]{1,0}) all-gather-start(%g), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, use_global_device_ids=true
  %init = (s32[], (bf16[1,4194304]{1,0}, bf16[8,4194304]{1,0}), bf16[1,4194304]{1,0}) tuple(%z, %ags0, %g)
  %w = (s32[], (bf16[1,4194304]{1,0}, bf16[8,4194304]{1,0}), bf16[1,4194304]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  ROOT %r = f32[67108864]{0} fusion(%a), kind=kLoop, calls=%fused_neg""", PIPELINED)
  p = ruler.predict(text, "h200", "hgx_h200", floor_s=0.0)
  coll = cluster.NCCL_LAUNCH_S + 8 * 4194304 * 2 * 7 / 8 / 450e9
  assert p["exposed_comm_s"] == pytest.approx(4 * coll, rel=1e-3)


# ------------------------------------------------------------------ GEMMs at measured rates

def test_gemm_rates_come_from_the_measured_rows():
  row = next(r for r in gemm_rates.ROWS if r[0] == "sm_100" and r[1] == "bf16" and r[3:6] == (4096, 4096, 4096)
             and r[2] == 4)
  frac, used = gemm_rates.fraction_of_peak("sm_100", "bf16", 4, 4096, 4096, 4096)
  assert used == [row] and frac == pytest.approx(row[6] / 2250.0)
  # larger than every row: clamped to the largest rows, never above the best measured fraction
  big, _ = gemm_rates.fraction_of_peak("sm_100", "bf16", 1, 65536, 20480, 5120)
  best = max(r[6] / 2250.0 for r in gemm_rates.ROWS if r[:2] == ("sm_100", "bf16"))
  assert 0.6 < big <= best
  # small shapes run far below the large ones (the flat 80% charged them at the large ones' rate)
  small, _ = gemm_rates.fraction_of_peak("sm_90", "bf16", 1, 512, 512, 512)
  assert small < 0.1
  # NVFP4 takes FP8's measured fraction (an assumption, named) of its own peak
  assert gemm_rates.rate("b200", "f4e2m1fnxf4e2m1fn", (4, 4096, 4096, 4096), 9e15) == pytest.approx(
      3279.7 / 4500 * 9e15)
  assert gemm_rates.rate("b200", "f32xf32", (4096, 4096, 4096), 1e15) is None
  for r in gemm_rates.ROWS:
    assert r[7] in gemm_rates.SOURCES and r[6] <= gemm_rates.ROW_PEAKS[(r[0], r[1])]


# ------------------------------------------------------------------ the calibration bias

def test_the_bias_is_recomputed_from_its_rows():
  points = [calibration.Point("a", "8 B200", "bf16", 20000.0, 25000.0),
            calibration.Point("b", "8 B200", "nvfp4", 30000.0, 33000.0),
            calibration.Point("c", "64 B200", "nvfp4", 5000.0, 4000.0)]
  b = calibration.bias(points)
  assert b == pytest.approx(math.exp((math.log(1.25) + math.log(1.1) + math.log(0.8)) / 3))
  text = calibration.render(points)
  assert f"{b:.2f}x" in text and "optimistic" in text and "| 1.25 |" in text
  moved = points[:2] + [calibration.Point("c", "64 B200", "nvfp4", 5000.0, 2000.0)]
  assert calibration.bias(moved) < 1 and "pessimistic" in calibration.render(moved)
  assert calibration.bias([]) is None and "unknown" in calibration.render([])


# ------------------------------------------------------------------ XLA's own estimate

SCHEDULE = """hlo_module {
  name: "jit_train_step"
  computations {
    name: "body"
    instructions {
      name: "f1"
      opcode: "fusion"
      id: 7
    }
    id: 3
    root_id: 7
  }
  computations {
    name: "main"
    id: 4
    root_id: 9
  }
}
computation_schedules {
  computation_id: 3
  instructions {
    id: 7
    start_timestamp_cycles: 0
    end_timestamp_cycles: 250
  }
  scheduler_statistics {
    total_cycles: 250
  }
  cycles_per_microsecond: 2
}
"""


def test_xla_estimate_is_read_from_the_dumped_schedule():
  from bench.predict import xla_schedule
  assert xla_schedule.estimates_us(SCHEDULE) == {"body": 125.0}
  pred = dict(leaf_bodies=["body", "other"], body_s={"body": 50e-6, "other": 1.0}, executions={"body": 10})
  out = xla_schedule.compare(pred, SCHEDULE)
  assert out["bodies"] == 1 and out["xla_ms"] == pytest.approx(1.25) and out["ruler_ms"] == pytest.approx(0.5)
  assert xla_schedule.compare(pred, None) is None


def test_a_combined_gather_counts_every_result():
  text = """HloModule m, is_scheduled=true, num_partitions=8

ENTRY %main (a: f32[512], b: f32[1024]) -> f32[4096] {
  %a = f32[512]{0} parameter(0)
  %b = f32[1024]{0} parameter(1)
  %s = ((f32[512]{0}, f32[1024]{0}), (f32[4096]{0}, f32[8192]{0})) all-gather-start(%a, %b), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %d = (f32[4096]{0}, f32[8192]{0}) all-gather-done(%s)
  ROOT %r = f32[4096]{0} get-tuple-element(%d), index=0
}
"""
  (row,) = ruler.predict(text, "h200", "hgx_h200")["collectives"]
  assert row["bytes_per_step"] == 4 * (4096 + 8192)


def test_a_gemm_is_charged_at_its_measured_rate_not_a_flat_fraction():
  text = """HloModule m, is_scheduled=true, num_partitions=1

%fused_dot (p0: bf16[4096,4096], p1: bf16[4096,4096]) -> bf16[4096,4096] {
  %p0 = bf16[4096,4096]{1,0} parameter(0)
  %p1 = bf16[4096,4096]{1,0} parameter(1)
  ROOT %d = bf16[4096,4096]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a: bf16[4096,4096], b: bf16[4096,4096]) -> bf16[4096,4096] {
  %a = bf16[4096,4096]{1,0} parameter(0)
  %b = bf16[4096,4096]{1,0} parameter(1)
  ROOT %g = bf16[4096,4096]{1,0} fusion(%a, %b), kind=kCustom, calls=%fused_dot, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
}
"""
  for target, measured in (("b200", 1416.9e12), ("h200", 783.3e12)):
    p = ruler.predict(text, target, f"hgx_{target}", floor_s=0.0)
    assert p["gemm_s"] == pytest.approx(2 * 4096 ** 3 / measured)
    assert p["step_s"] == pytest.approx(p["gemm_s"])


def test_a_combined_reduce_scatter_counts_its_inputs_once():
  text = """HloModule m, is_scheduled=true, num_partitions=8

%add (x: bf16[], y: bf16[]) -> bf16[] {
  %x = bf16[] parameter(0)
  %y = bf16[] parameter(1)
  ROOT %s = bf16[] add(%x, %y)
}

ENTRY %main (a: bf16[4096,64], b: bf16[8192,64]) -> bf16[512,64] {
  %a = bf16[4096,64]{1,0} parameter(0)
  %b = bf16[8192,64]{1,0} parameter(1)
  %s = ((bf16[4096,64]{1,0}, bf16[8192,64]{1,0}), (bf16[512,64]{1,0}, bf16[1024,64]{1,0})) reduce-scatter-start(%a, %b), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, to_apply=%add
  %d = (bf16[512,64]{1,0}, bf16[1024,64]{1,0}) reduce-scatter-done(%s)
  ROOT %r = bf16[512,64]{1,0} get-tuple-element(%d), index=0
}
"""
  (row,) = ruler.predict(text, "h200", "hgx_h200")["collectives"]
  assert row["kind"] == "reduce-scatter" and row["bytes_per_step"] == 2 * 64 * (4096 + 8192)


def test_a_ragged_all_to_all_counts_its_smaller_buffer_once():
  """Expert parallelism's dispatch: it sends at most its 1024 rows (every pair) into a receive buffer of 1536 (the
  receive factor's); its async start lists both buffers, the four offset / size vectors and the result. Priced on
  the smaller buffer alone (before: all seven arrays, 3.5x the send buffer here)."""
  text = """HloModule m, is_scheduled=true, num_partitions=8

ENTRY %main (x: bf16[1024,512], o: bf16[1536,512], a: s64[8], b: s64[8], c: s64[8], d: s64[8]) -> bf16[1536,512] {
  %x = bf16[1024,512]{1,0} parameter(0)
  %o = bf16[1536,512]{1,0} parameter(1)
  %a = s64[8]{0} parameter(2)
  %b = s64[8]{0} parameter(3)
  %c = s64[8]{0} parameter(4)
  %d = s64[8]{0} parameter(5)
  %s = ((bf16[1024,512]{1,0}, bf16[1536,512]{1,0}, s64[8]{0}, s64[8]{0}, s64[8]{0}, s64[8]{0}), bf16[1536,512]{1,0}) ragged-all-to-all-start(%x, %o, %a, %b, %c, %d), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}
  ROOT %r = bf16[1536,512]{1,0} ragged-all-to-all-done(%s)
}
"""
  p = ruler.predict(text, "b200", "hgx_b200")
  (row,) = p["collectives"]
  assert row["kind"] == "ragged-all-to-all" and row["bytes_per_step"] == 1024 * 512 * 2
  (one,) = p["each_collective"]
  assert one["dtype"] == "bf16" and one["exposed_s"] == pytest.approx(one["seconds"])   # done right after start


@pytest.mark.parametrize("scope", ["forward_backward", "forward_backward/shard_map"])
def test_the_breakdown_says_what_each_collective_moves_and_how_often(scope):
  """bench/predict/comm_breakdown.py on a step shaped like the trainer's: a weight gather issued once (the step's
  ``gather_weights``), a gradient reduce-scatter inside the loop over micro-batches (4 trips), nothing to hide
  either behind: each exposed whole, the gradients once per trip, and no schedule could hide them. The loop is
  found in its scope, or one level deeper inside the shard_map of the gradients reduced once per step
  (``config.mesh.grad_reduce``)."""
  from bench.predict import comm_breakdown   # pylint: disable=import-outside-toplevel
  loop = """
%add (x: bf16[], y: bf16[]) -> bf16[] {
  %x = bf16[] parameter(0)
  %y = bf16[] parameter(1)
  ROOT %s = bf16[] add(%x, %y)
}

%cond (s: (s32[], bf16[8,4194304])) -> pred[] {
  %s = (s32[], bf16[8,4194304]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %k = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %k), direction=LT
}

%body (s: (s32[], bf16[8,4194304])) -> (s32[], bf16[8,4194304]) {
  %s = (s32[], bf16[8,4194304]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %w = bf16[8,4194304]{1,0} get-tuple-element(%s), index=1
  %rs = (bf16[8,4194304]{1,0}, bf16[1,4194304]{1,0}) reduce-scatter-start(%w), channel_id=2, replica_groups={{0,8,16,24,32,40,48,56}}, dimensions={0}, to_apply=%add, metadata={op_name="jit(train_step)/SCOPE/while/body/transpose(jvp(LanguageModel))/dot_general"}
  %rd = bf16[1,4194304]{1,0} reduce-scatter-done(%rs)
  %one = s32[] constant(1)
  %j = s32[] add(%i, %one)
  ROOT %out = (s32[], bf16[8,4194304]{1,0}) tuple(%j, %w)
}
"""
  text = f"""HloModule m, is_scheduled=true, num_partitions=64
{loop.replace("SCOPE", scope)}
ENTRY %main (g: bf16[1,4194304]) -> bf16[8,4194304] {{
  %g = bf16[1,4194304]{{1,0}} parameter(0)
  %ags = (bf16[1,4194304]{{1,0}}, bf16[8,4194304]{{1,0}}) all-gather-start(%g), channel_id=1, replica_groups={{{{0,8,16,24,32,40,48,56}}}}, dimensions={{0}}, metadata={{op_name="jit(train_step)/gather_weights/sharding_constraint"}}
  %agd = bf16[8,4194304]{{1,0}} all-gather-done(%ags)
  %z = s32[] constant(0)
  %init = (s32[], bf16[8,4194304]{{1,0}}) tuple(%z, %agd)
  %loop = (s32[], bf16[8,4194304]{{1,0}}) while(%init), condition=%cond, body=%body, backend_config={{"known_trip_count":{{"n":"4"}}}}, metadata={{op_name="jit(train_step)/{scope}/while"}}
  ROOT %r = bf16[8,4194304]{{1,0}} get-tuple-element(%loop), index=1
}}
"""
  b = comm_breakdown.breakdown(text, "b200", "hgx_b200")
  rows = {(r["purpose"], r["per_micro_batch"], r["crosses_nodes"]): r for r in b["rows"]}
  assert set(rows) == {("weights", False, True), ("gradients", True, True)}
  grads, weights = rows["gradients", True, True], rows["weights", False, True]
  assert grads["count"] == 4 and weights["count"] == 1
  assert grads["exposed_s"] == pytest.approx(4 * grads["seconds"])
  assert weights["exposed_s"] == pytest.approx(weights["seconds"])
  assert b["exposed_comm_s"] == pytest.approx(grads["exposed_s"] + weights["exposed_s"])
  body = b["schedule"]["body"]
  assert body["floor_s"] == pytest.approx(body["comm_s"] - body["compute_s"]) and body["floor_s"] > 0
  text_report = comm_breakdown.report(b)
  assert "| gradients | across nodes | per micro-batch | 4 |" in text_report


def test_a_loop_without_a_stated_trip_count_runs_from_its_start_to_its_bound():
  """XLA's collective pipeliner peels iterations out of a loop: the rest starts at 1 (a copied constant in the
  initial tuple), its condition a fusion comparing with 7, and no known_trip_count. 6 trips (before: 1)."""
  from bench.predict import hlo_walk   # pylint: disable=import-outside-toplevel
  text = """HloModule m, is_scheduled=true, num_partitions=1

%fused_compare (p: s32[]) -> pred[] {
  %p = s32[] parameter(0)
  %k = s32[] constant(7)
  ROOT %lt = pred[] compare(%p, %k), direction=LT
}

%cond (s: (s32[], f32[4])) -> pred[] {
  %s = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  ROOT %c = pred[] fusion(%i), kind=kLoop, calls=%fused_compare
}

%body (s: (s32[], f32[4])) -> (s32[], f32[4]) {
  %s = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %v = f32[4]{0} get-tuple-element(%s), index=1
  %one = s32[] constant(1)
  %j = s32[] add(%i, %one)
  ROOT %out = (s32[], f32[4]{0}) tuple(%j, %v)
}

ENTRY %main (t: f32[4]) -> f32[4] {
  %t = f32[4]{0} parameter(0)
  %c1 = s32[] constant(1)
  %start = s32[] copy(%c1)
  %init = (s32[], f32[4]{0}) tuple(%start, %t)
  %w = (s32[], f32[4]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_induction_variable":{"tuple_index":"0"}}
  ROOT %r = f32[4]{0} get-tuple-element(%w), index=1
}
"""
  mod = hlo_walk.Module(text)
  assert mod.trip_count(mod.by_name["w"]) == 6
  assert mod.multipliers()["body"] == 6
