"""The ruler's costs of a compiled step written as the profile XLA's latency-hiding scheduler reads.

  python bench/predict/pgle_profile.py --hlo step.hlo --json step.json --target b200 --cluster hgx_b200 \
      --out step.pgle.pbtxt

Without a profile, XLA's GPU scheduler prices a program with its "approximate" estimator wherever its
speed-of-light model does not take every collective of the module (a ragged all-to-all, for one): every kernel
1,000 cycles, every collective 5,000, whatever their sizes (docs/PERF.md, "Why XLA's schedule leaves Super's
gradients exposed"). So it starts a collective five kernels before its result is needed, and a reduce-scatter of
a gigabyte across the network is as exposed as if no scheduler ran. On a GPU, jax's automatic profile-guided
latency estimation (``jax_enable_pgle``: the first runs profiled, then the step compiled again with the measured
times) gives the scheduler each instruction's real cost; training.train turns it on with ``config.pgle_runs``.

This module writes that profile without a GPU: each kernel's time and each collective's time on the ruler
(bench/predict/ruler.py), in XLA's ``ProfiledInstructionsProto`` text form (``costs { name: ... cost_us: ... }``),
keyed by the name the scheduler knew the instruction by (its ``scheduling_name`` metadata, which later passes keep
when they rename). Compiling the same program again with ``--xla_gpu_pgle_profile_file_or_directory_path`` pointing
at it gives the schedule XLA would build from a device profile whose times are the ruler's: a prediction of what
the automatic profile buys, under that assumption, priced by the same ruler.
"""
from __future__ import annotations

import json
import os
import re
import sys

if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

# pylint: disable=wrong-import-position
from bench.predict import hlo_walk
from bench.predict import ruler

_SCHEDULING_NAME = re.compile(r'scheduling_name="([^"]+)"')


def costs(text: str, target: str, cluster_name: str, partition_devices=None) -> dict[str, float]:
  """Microseconds per execution of every instruction the ruler prices in the optimized HLO ``text``, by the
  name the scheduler gave it: kernels their time, collectives their time on the links (an async pair's
  latency from start to done)."""
  return from_prediction(text, ruler.predict(text, target, cluster_name, partition_devices=partition_devices))


def from_prediction(text: str, p: dict) -> dict[str, float]:
  """``costs`` from the ruler's prediction ``p`` of ``text`` (``ruler.predict``)."""
  seconds = dict(p["op_seconds"])
  seconds.update({c["name"]: c["seconds"] for c in p["each_collective"]})
  out = {}
  for comp in hlo_walk.Module(text).comps.values():
    for ins in comp:
      if ins.name in seconds:
        m = _SCHEDULING_NAME.search(ins.attrs)
        out[m.group(1) if m else ins.name] = seconds[ins.name] * 1e6
  return out


def write(profile: dict[str, float], path: str) -> None:
  """``profile`` (name -> microseconds) as a ``ProfiledInstructionsProto`` in text form."""
  with open(path, "w", encoding="utf-8") as f:
    for name, us in sorted(profile.items()):
      f.write(f'costs {{ name: "{name}" cost_us: {us:.3f} }}\n')


def main(argv=None) -> None:
  import argparse   # pylint: disable=import-outside-toplevel
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
  ap.add_argument("--hlo", required=True, help="the optimized HLO text (bench/predict/gpu_aot.py --hlo)")
  ap.add_argument("--json", help="bench/predict/gpu_aot.py --json of the same compile: the mesh's device order")
  ap.add_argument("--target", default="b200")
  ap.add_argument("--cluster", default=None, help="bench/predict/cluster.py's CLUSTERS key (default hgx_<target>)")
  ap.add_argument("--out", required=True, help="the profile to write (.pbtxt)")
  a = ap.parse_args(argv)
  with open(a.hlo, encoding="utf-8") as f:
    text = f.read()
  devices = None
  if a.json:
    with open(a.json, encoding="utf-8") as f:
      devices = json.load(f)["results"][0].get("partition_devices")
  profile = costs(text, a.target, a.cluster or f"hgx_{a.target}", devices)
  write(profile, a.out)
  print(f"{a.out}: {len(profile)} instructions, {sum(profile.values()) / 1e3:,.1f} ms summed over one "
        "execution of each")


if __name__ == "__main__":
  main()
