"""fp4jax.partition_cache: a program with fp4jax's sharded ops is found in jax's persistent compilation cache by
another process (on today's main each process keyed it anew: the custom_partitioning ids), its ops' parameters
are part of the key, and a program with a custom_partitioning op of someone else's is keyed as jax keys it.

Two subprocesses on 2 simulated CPU devices share one fresh cache directory: the first compiles an nvfp4 dot's
gradient on a batch-sharded input; the second compiles the same program (a hit) and the mxfp4 one (a miss: only
the ops' parameters differ)."""
import json
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SCRIPT = textwrap.dedent(r"""
    import json, sys
    import jax, jax.numpy as jnp
    from jax.experimental.custom_partitioning import custom_partitioning
    from jax.sharding import NamedSharding, PartitionSpec as P
    jax.config.update("jax_compilation_cache_dir", sys.argv[1])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    import fp4jax
    from fp4jax import partition_cache

    hits = []
    jax.monitoring.register_event_listener(lambda event, **kw: hits.append(event))
    mesh = jax.make_mesh((2,), ("d",))
    x = jax.device_put(jnp.ones((64, 128), jnp.bfloat16), NamedSharding(mesh, P("d", None)))
    w = jax.device_put(jnp.ones((128, 64), jnp.bfloat16), NamedSharding(mesh, P(None, None)))

    def lowered(recipe, *others):
      loss = lambda x, w: fp4jax.dot(x, w, recipe=recipe, key=jax.random.key(0)).astype(jnp.float32).sum()
      return jax.jit(lambda x, w: (jax.grad(loss)(x, w), *(f(x) for f in others))).lower(x, w)

    def cached(recipe):
      hits.clear()
      partition_cache.compile(lowered(recipe))
      return "/jax/compilation_cache/cache_hits" in hits

    mine = custom_partitioning(lambda x: x * 2)   # someone else's op: no fp4jax attribute
    mine.def_partition(partition=lambda mesh, shapes, result: (mesh, lambda x: x * 2, result.sharding,
                                                              (shapes[0].sharding,)),
                       infer_sharding_from_operands=lambda mesh, shapes, result: shapes[0].sharding,
                       sharding_rule="i j -> i j")
    out = {"tagged": partition_cache.all_tagged(lowered("nvfp4").compiler_ir("stablehlo")),
           "with_another_op": partition_cache.all_tagged(lowered("nvfp4", mine).compiler_ir("stablehlo")),
           "calls": lowered("nvfp4").as_text().count("fp4jax_partitioned")}
    out.update({recipe: cached(recipe) for recipe in sys.argv[2:]})
    print("RESULT " + json.dumps(out))
""")


def _run(cache, *recipes) -> dict:
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
  p = subprocess.run([sys.executable, "-c", _SCRIPT, str(cache), *recipes], cwd=ROOT, env=env, capture_output=True,
                     text=True, timeout=600)
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
  return json.loads([l for l in p.stdout.splitlines() if l.startswith("RESULT ")][-1][len("RESULT "):])


def test_a_second_process_finds_the_sharded_program_and_the_params_are_in_the_key(tmp_path):
  first = _run(tmp_path, "nvfp4")
  assert first["calls"] > 0 and first["tagged"], first   # every custom_partitioning call is fp4jax's, tagged
  assert not first["with_another_op"], first             # a program with another one is keyed as jax keys it
  assert not first["nvfp4"], first                       # an empty cache
  second = _run(tmp_path, "nvfp4", "mxfp4")
  assert second["nvfp4"], "a second process compiled the same sharded nvfp4 program again"
  assert not second["mxfp4"], "a program differing only in its ops' parameters was served another's entry"
