"""Profile-guided scheduling of the train step (``config.pgle_steps``).

XLA's latency-hiding scheduler decides which kernels run while a collective travels. Without measured times it
prices the step with a size-blind estimate wherever its analytical model does not take every collective of the
program (a ragged all-to-all, for one): each kernel 1,000 cycles, each collective 5,000, so a gigabyte's
reduce-scatter across the network is started a few kernels before its result is needed (docs/PERF.md, "Why XLA's
schedule leaves Super's gradients exposed"). Given a profile of the program (each instruction's time), it
schedules with those times instead: XLA's profile-guided latency estimation.

With ``config.pgle_steps = N`` the loop traces the N steps after each start's first one, turns the trace into
XLA's ``ProfiledInstructionsProto`` (``jax.experimental.profiler.get_profiled_instructions_proto``: the
instructions' times, measured on NVIDIA GPUs only) and compiles the step again with it
(``xla_gpu_pgle_profile_file_or_directory_path``); later steps run that program. The profile is kept in
``<workdir>/pgle/<fingerprint>.pb``, named by the program's fingerprint before scheduling (XLA's
``fingerprint_before_lhs``), so a resume of the same program compiles with it at once and a changed program
(another mesh, config or fp4jax) profiles itself again. Every process compiles with process 0's profile: the
processes of one program must schedule it alike. The numerics do not change: the schedule orders the same
computations.
"""
from __future__ import annotations

import os
import re
import tempfile

import jax
import numpy as np

OPTION = "xla_gpu_pgle_profile_file_or_directory_path"
DIRECTORY = "pgle"
_FINGERPRINT = re.compile(r'fingerprint_before_lhs="([0-9a-f]+)"')


def fingerprint(hlo_text: str) -> str | None:
  """The fingerprint XLA gave a compiled program before scheduling it (its HLO text's module attribute), or
  None when the compiler records none (XLA's CPU backend schedules without one)."""
  m = _FINGERPRINT.search(hlo_text.split("\n", 1)[0])   # the HloModule line (its layout lists every parameter)
  return m.group(1) if m else None


def profile_path(workdir: str, program_fingerprint: str) -> str:
  return os.path.join(workdir, DIRECTORY, f"{program_fingerprint}.pb")


def compiler_options(path: str) -> dict:
  """The compile options that schedule a program with the profile at ``path``."""
  return {OPTION: path}


def collect(trace_dir: str) -> bytes:
  """The serialized ``ProfiledInstructionsProto`` of a ``jax.profiler`` trace written to ``trace_dir``: empty
  where the devices are not NVIDIA GPUs."""
  from jax.experimental import profiler   # pylint: disable=import-outside-toplevel
  return profiler.get_profiled_instructions_proto(trace_dir)


def share(profile: bytes) -> bytes:
  """Process 0's ``profile`` on every process (a no-op in a single-process run)."""
  if jax.process_count() == 1:
    return profile
  from jax.experimental import multihost_utils   # pylint: disable=import-outside-toplevel
  size = int(multihost_utils.broadcast_one_to_all(np.int64(len(profile))))
  buf = np.zeros(size, np.uint8)
  if jax.process_index() == 0:
    buf[:] = np.frombuffer(profile, np.uint8)
  return multihost_utils.broadcast_one_to_all(buf).tobytes()


def write(path: str, profile: bytes) -> None:
  """``profile`` to ``path``, atomically (a reader never sees half a file)."""
  os.makedirs(os.path.dirname(path), exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
  with os.fdopen(fd, "wb") as f:
    f.write(profile)
  os.replace(tmp, path)
