"""Parameter shardings cut matrices only into whole 16-element units (NVFP4 tiles never straddle shards)."""
import types

from jax.sharding import PartitionSpec as P

from training import sharding


def _mesh(**axes):
  return types.SimpleNamespace(shape={"data": 1, "fsdp": 1, "tensor": 1, **axes})


def test_matrix_dims_shard_only_into_whole_tiles():
  mesh = _mesh(fsdp=64)
  # 128 rows over 64 shards would leave 2 rows per shard: a 16x16 tile would straddle 8 shards.
  assert sharding._fit(P("fsdp", None), (128, 256), mesh) == P(None, None)  # pylint: disable=protected-access
  # 5120 / 64 = 80 rows per shard = 5 whole tiles.
  assert sharding._fit(P("fsdp", None), (5120, 256), mesh) == P("fsdp", None)  # pylint: disable=protected-access


def test_vectors_need_only_divisibility():
  mesh = _mesh(fsdp=64)
  assert sharding._fit(P("fsdp"), (128,), mesh) == P("fsdp")  # pylint: disable=protected-access
  assert sharding._fit(P("fsdp"), (100,), mesh) == P(None)  # pylint: disable=protected-access
