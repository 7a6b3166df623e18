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


def test_several_mesh_axes_fall_back_to_their_leading_run():
  mesh = _mesh(fsdp=8, expert=8)
  # 4096 / 64 = 64 rows per shard: both axes; 1024 / 64 = 16: both; 512 / 64 = 8 rows: fsdp alone (64 rows).
  for dim, want in ((4096, ("fsdp", "expert")), (1024, ("fsdp", "expert")), (512, "fsdp"), (8, None)):
    assert sharding._fit(P(("fsdp", "expert"), None), (dim, 256), mesh) == P(want, None), dim  # pylint: disable=protected-access
  # A mesh axis of size 1 is dropped: the spec of a mesh without it (a 1-axis tuple becomes its name).
  assert sharding._fit(P(("fsdp", "expert"), None), (4096, 256), _mesh(fsdp=8, expert=1)) == P("fsdp", None)  # pylint: disable=protected-access


def test_expert_ranks_share_the_dense_state_and_experts_gather_along_their_leading_axis():
  """On a (fsdp 8, expert 8) mesh the dense layers' d_model is split 64 ways (the expert axis is data
  parallel for them), and the stored experts' leading axis over (expert, fsdp) with their other axes whole
  but tensor's, so each layer's gather over fsdp runs along the major axis (docs/DESIGN.md, "Super's memory")."""
  import flax.linen as nn   # pylint: disable=import-outside-toplevel
  rules = sharding.LOGICAL_RULES
  specs = {name: nn.logical_to_mesh_axes(axes, rules) for name, axes in (
      ("dense", ("embed", "mlp")), ("latent_proj", ("embed", "moe_latent")),
      ("latent_experts", ("expert_kernels", "moe_latent", "mlp")), ("experts", ("expert_kernels", "embed", "mlp")))}
  assert specs["dense"] == P(("fsdp", "expert"), "tensor")
  assert specs["latent_proj"] == P(("fsdp", "expert"), None)
  assert specs["latent_experts"] == P(("expert", "fsdp"), None, "tensor")
  assert specs["experts"] == P(("expert", "fsdp"), None, "tensor")
  # Expert parallelism's own split (models.expert_parallel.layout reads "experts") stays the expert axis.
  assert nn.logical_to_mesh_axes(("experts",), rules) == P("expert")


def test_a_batch_with_segment_ids_goes_on_the_mesh_as_one_pytree():
  """Document masking's batches ({"tokens", "segment_ids"}) go on the mesh like a plain tokens_BxW: every array
  split over the batch axes, and a jitted function takes them under the batch sharding as a prefix."""
  import jax   # pylint: disable=import-outside-toplevel
  import numpy as np   # pylint: disable=import-outside-toplevel
  mesh = sharding.make_mesh({"data": -1, "fsdp": 1, "expert": 1, "tensor": 1})
  host = {"tokens": np.arange(4 * 9, dtype=np.int32).reshape(4, 9), "segment_ids": np.zeros((4, 9), np.int32)}
  batch = sharding.host_batch_to_global(host, mesh)
  assert set(batch) == {"tokens", "segment_ids"}
  for name, x in batch.items():
    assert x.sharding == sharding.batch_sharding(mesh) and x.shape == (4, 9), name
    np.testing.assert_array_equal(x, host[name])
  fn = jax.jit(lambda b: b["tokens"] + b["segment_ids"], in_shardings=(sharding.batch_sharding(mesh),))
  np.testing.assert_array_equal(fn(batch), host["tokens"])
  plain = sharding.host_batch_to_global(host["tokens"], mesh)
  assert plain.sharding == sharding.batch_sharding(mesh)
