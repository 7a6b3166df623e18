"""The deviceless compile: a GPU topology from a target file (gpu_targets/<target>.txtpb) and a program
compiled for it by XLA's GPU pipeline on a machine without a GPU (jax's CUDA plugin; the process made
deviceless by ``fp4jax._platform.enable_deviceless``)."""
from __future__ import annotations

import dataclasses
import os
import resource
import time

TARGETS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_targets")
TARGETS = ("h100", "h200", "b200")
PER_HOST = 8   # GPUs per host of the topology: an HGX node (bench/predict/cluster.py's gpus_per_node)


def target_config(target: str) -> str:
  with open(os.path.join(TARGETS_DIR, f"{target}.txtpb"), encoding="utf-8") as f:
    return f.read()


def gpu_devices(target: str, n: int):
  """N devices of a deviceless GPU topology (PER_HOST per host, as an HGX node; ids host-major, each device's
  ``process_index`` its host)."""
  from jax.experimental import topologies   # pylint: disable=import-outside-toplevel
  per_host = min(n, PER_HOST)
  if n % per_host:
    raise ValueError(f"--devices={n}: use up to {PER_HOST}, or a multiple of {PER_HOST}")
  topo = topologies.get_topology_desc(platform="cuda", target_config=target_config(target),
                                      topology=f"1x{n // per_host}x{per_host}")
  return topo.devices


def max_rss_bytes() -> int:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclasses.dataclass
class Program:
  """One function to compile: ``fn`` jitted over ``args`` (ShapeDtypeStructs with shardings);
  ``kernels``: Pallas kernels its HLO must hold (0 = none required); ``profile``: for a program that a GPU
  run compiles again with a profile of itself (``config.pgle_steps``, training/pgle.py), the function that
  writes one for the first compile's HLO (bench/predict/pgle_profile.py: the ruler's costs), the result being
  the second compile's."""
  name: str
  fn: object
  args: tuple
  kernels: int = 0
  profile: object = None   # (text, partition_devices) -> the path of a profile to compile again with


def program_devices(args) -> list:
  """The devices a program's arguments are placed on (their shardings'): what it is compiled for."""
  import jax   # pylint: disable=import-outside-toplevel
  for leaf in jax.tree.leaves(args):
    sharding = getattr(leaf, "sharding", None)
    if sharding is not None:
      return sorted(sharding.device_set, key=lambda d: d.id)
  return []


def _partition_devices(mesh) -> list[int] | None:
  """jit's device assignment: partition p runs on the mesh's p-th device (bench/predict/cluster.py's nodes)."""
  return [d.id for d in mesh.devices.flat] if mesh is not None else None


def compile_program(prog: Program, mesh=None) -> dict:
  """Lowers and compiles; returns the compiled executable's text, memory and times (never raises:
  an error is returned in ``error``). Every automatic choice (attention's kernel, the GEMM backend,
  the primitives' impl) is traced for the program's devices (``fp4jax.target``): the mesh's, else its
  arguments', the GPU topology's, as a GPU process would decide, not this CPU process's."""
  import jax   # pylint: disable=import-outside-toplevel
  import fp4jax   # pylint: disable=import-outside-toplevel
  t0, c0 = time.perf_counter(), time.process_time()
  try:
    fn = prog.fn if hasattr(prog.fn, "lower") else jax.jit(prog.fn)
    if mesh is not None:
      from training import sharding   # pylint: disable=import-outside-toplevel
      with sharding.mesh_context(mesh), fp4jax.target.use(mesh):
        lowered = fn.lower(*prog.args)
    else:
      with fp4jax.target.use(program_devices(prog.args) or None):
        lowered = fn.lower(*prog.args)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    first = None
    if prog.profile is not None:
      from training import pgle   # pylint: disable=import-outside-toplevel
      first = dict(compile_s=round(time.perf_counter() - t1, 2), text=compiled.as_text())
      first["profile"] = prog.profile(first["text"], _partition_devices(mesh))
      compiled = lowered.compile(pgle.compiler_options(first["profile"]))
  except Exception as e:   # pylint: disable=broad-except  (reported per program)
    return dict(name=prog.name, error=f"{type(e).__name__}: {str(e)[:2000]}",
                seconds=round(time.perf_counter() - t0, 2), max_rss_bytes=max_rss_bytes())
  t2, c2 = time.perf_counter(), time.process_time()
  mem = compiled.memory_analysis()
  text = compiled.as_text()
  return dict(name=prog.name, error=None, text=text, partition_devices=_partition_devices(mesh), unprofiled=first,
              lower_s=round(t1 - t0, 2),
              compile_s=round(t2 - t1, 2), seconds=round(t2 - t0, 2), cpu_s=round(c2 - c0, 2),
              max_rss_bytes=max_rss_bytes(),
              kernels=text.count('custom_call_target="__gpu$xla.gpu.triton"'),
              kernels_required=prog.kernels,
              memory=dict(argument_bytes=int(mem.argument_size_in_bytes),
                          output_bytes=int(mem.output_size_in_bytes),
                          alias_bytes=int(mem.alias_size_in_bytes),
                          temp_bytes=int(mem.temp_size_in_bytes)))
