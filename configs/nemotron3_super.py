"""Nemotron 3 Super (models.presets.nemotron3_super, 120B total / 12B active): 88 blocks (40 Mamba-2, 40 LatentMoE
of 512 experts with 22 per token, 8 attention) and one MTP module (attention + LatentMoE), NVFP4 with Super's
precision rules (model.precision="nemotron3_super": the MTP module, the last 14 blocks, attention and the latent
projections in bf16, the Mamba out_proj in MXFP8). Sequence 8192.

The 64-GPU layout, 8 HGX nodes x 8 (docs/TRAINING.md, "Laying out a multi-node run"):
- within a node, expert=8: the routed experts split 8 ways over the node's NVLink (mesh.expert=8), so each E
  layer's dispatch and combine (the all-to-all of models.expert_parallel, the step's largest traffic) never
  leaves the node; the dense layers' weights are split over expert too (training.sharding's rules), so their
  gathers over it stay in the node as well;
- across the nodes, fsdp=8 (mesh.dcn_fsdp=8): parameters and optimizer state split 8 ways more. It is there for
  memory, not for traffic: the state is 21.61 GiB per GPU split 64 ways and would be 172.71 GiB split only 8 ways
  (data across the nodes instead of fsdp: more than a B200's 180 GB, 167.6 GiB, before any activation). So the
  weights are gathered over fsdp once per step, ahead of the micro-batches (mesh.fsdp_gather="per_step": 30 GiB
  per GPU over the network per step instead of 341 GiB, for about 27 GiB more memory per GPU); the gradients are
  still reduce-scattered over fsdp in every micro-batch, across the network (docs/PERF.md, "Super's communication";
  mesh.grad_reduce="per_step", once per step, is refused for NVFP4 under jax 0.10.2 and in bf16 takes 181.7 GiB
  per GPU: docs/PERF.md, "Super's gradients reduced once per step").
The flat mesh of this shape (fsdp major) puts the devices in the same order; the layout keys say it, and a
cluster whose nodes are not 8 GPUs is refused (mesh.devices_per_node).
Megatron-Bridge's global batch of 512 sequences of 8192 per optimizer step (batch_size 512) in 4 micro-batches
of two sequences per GPU (micro_batches 4: the gradients accumulate in float32, docs/TRAINING.md, "Micro-batches";
each micro-batch reduce-scatters every gradient across the nodes, so fewer, larger micro-batches pay that
less often: 8 of one sequence 19.7 s per step, 4 of two 14.5 s, 2 of four do not fit; docs/PERF.md, "Super's
micro-batches: two sequences per GPU"; an H200, 141 GB, holds one: --config.micro_batches=8 there),
blocks rematerialized (remat "full", set here: the 12B's save_linear_fp4 would keep every E block's expert
hidden) and the repeated block groups scanned. The state is
21.61 GiB per GPU (the dense layers' too split over fsdp x expert: training.sharding). The experts' receive
buffer is 1.5x each GPU's average traffic (model.moe_receive_factor; dropless it is 8x and the temp is
terabytes). XLA's latency-hiding scheduler is on, with a budget (xla_options below: the slop factor per GPU
kind). Compiled without a GPU, arguments + temp per GPU and the predicted step (flat roofline), measured before
micro-batches for a step of 64 sequences (one micro-batch, weights gathered per layer, the scheduler off;
docs/PERF.md, "nemotron3_super on 64 GPUs"):
  64 H200: nvfp4 64.17 GiB, 4.19 s; bf16 67.38 GiB, 2.89 s
  64 B200: nvfp4 (native) 62.55 GiB, 1.95 s; bf16 71.66 GiB, 1.53 s
and as configured (512 x 8192 in 4 micro-batches, the proved path with the experts on the grouped Mosaic GEMM,
on the ruler, regrouped, scheduled by the ruler's profile of the step, each layer's gradients sent during the
next: docs/PERF.md, "The exchange's gradient without its offsets' all-to-alls"): 64 B200 nvfp4 115.2 GiB,
9.6 s per step (6,843 tokens/s/GPU), 1.2 s of it exposed communication.
Compile it with (the batch of the config: 4 micro-batches of 2 x 64 sequences; --batch_per_device N for N per GPU):

  JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 JAX_PLATFORMS=cpu,cuda \
      python bench/predict/gpu_aot.py --target h200 --what step --config configs/nemotron3_super.py --devices 64 \
      --twin=false

(for --target b200 add XLA_FLAGS=--xla_gpu_enable_triton_gemm=false: the deviceless sm_100 compile of bf16 dots.)

Train (point the data at a pre-tokenized corpus of the 131072-token vocabulary):

  python train.py --config configs/nemotron3_super.py --config.data.sources='/data/tokens/*.bin' \
      --config.data.token_dtype=uint32 --workdir /ckpt/nemotron3_super

Sourced: the architecture (the preset's docstring), NVFP4 pretraining with MTP (the Nemotron 3 Super report's
abstract: 25T tokens). Not sourced (the report's schedule was not reachable from here): the learning rate,
warmup and decay are this repository's 12B choices; the 512-sequence batch is Megatron-Bridge's (its Super
performance rows); `steps` is 25T tokens at that batch.
"""
from ml_collections import config_dict

from configs import nemotron_h_12b


def get_config():
  """The 12B's training settings (schedule, data, logging, checkpoints) with Super's model, batch and mesh."""
  c = nemotron_h_12b.get_config()
  c.name = "nemotron3_super"
  c.model.preset = "nemotron3_super"
  c.batch_size = 512
  c.micro_batches = 4   # 128 sequences at a time, two per GPU: four per GPU do not fit (docstring)
  c.steps = 25_000_000_000_000 // (512 * 8192)
  c.mesh.expert = 8            # within a node: the expert all-to-all on NVLink
  c.mesh.dcn_fsdp = 8          # fsdp (8, from -1) spans the 8 nodes: the state split 64 ways fits (docstring)
  c.mesh.devices_per_node = 8  # HGX B200 / H200 nodes
  c.mesh.fsdp_gather = "per_step"   # the weights cross the nodes once per step, not per layer and micro-batch
  # Each block keeps its input only (remat "full"), not the 12B's save_linear_fp4: that policy keeps every
  # linear output, and an E block's expert hidden (S x 2688 bf16, 1.36 GiB per GPU at f = 1.5) alone would
  # be 56 GiB over Super's 41 E blocks (docs/PERF.md, "nemotron3_super on 64 GPUs").
  c.model.remat = "full"
  # Each quantized linear layer's and expert GEMM's dx and dw released apart (models.config.release_dx_with_dw;
  # the same values): with them together, the dense layers' gradients' reductions across the nodes stay in
  # their own layer's backward (XLA's pipeliner does not move a reduction the barrier reads), and each backward
  # iteration of the Mamba/MoE pairs waits for its own. Apart, they are sent during the next pair (the experts'
  # apart too: the dense layers' alone scheduled worse): 13,104 -> 12,806 ms per step on 64 B200, +2.9 GiB per
  # GPU (docs/PERF.md, "Super's gradients sent during the next layer"). The 12B keeps the barrier: apart, its
  # step is 353.9 -> 357.7 ms and +5.2 GiB.
  c.model.release_dx_with_dw = False
  # Each GPU's expert receive buffer: 1.5 x its average traffic (8192 x 22 pairs), not the dropless 8x; pairs
  # past it are dropped, lowest-ranked choices first, and counted (moe/<block>/dropped). 1.5 because a GPU's
  # load over its 64 experts is at most (1 + MaxVio) x the mean, and MaxVio after the router settles is
  # 0.43 +- 0.10 in the CPU MoE study (docs/STUDY.md; docs/PERF.md, "nemotron3_super's experts sized by traffic, and the tile rows").
  c.model.moe_receive_factor = 1.5
  # XLA's latency-hiding scheduler (off by default in XLA) issues each collective early and lets the kernels
  # run while it travels; without it every collective's done directly follows its start and all the step's
  # communication is exposed: 30.0 -> 26.6 s per step with the weights gathered per layer, 22.9 -> 20.6 s
  # with them gathered per step (the B200 nvfp4_proved step on the ruler, docs/PERF.md, "Super's
  # communication"). Double-buffered loops (two iterations per trip, so the scheduler can overlap one's
  # collectives with the next's kernels): 20.6 -> 20.4 s for 4.3 GiB. The scheduler trades memory for overlap
  # up to io + (0.8 x device memory - io) x slop / 100 (io: the 21.6 GiB of state per GPU): slop 80 plans
  # 119.5 GiB on a B200 (the step takes 128.0 GiB, XLA's rematerialization getting it no lower, under 90% of its
  # 180 GB; slop 100 gains 22 ms for 8.7 GiB more, not kept); the H200's 95 is XLA's default, 107.5 GiB. Kept in
  # the config so that train.py and bench/predict/gpu_aot.py compile the same program.
  overlap = {"xla_gpu_enable_latency_hiding_scheduler": True, "xla_gpu_enable_while_loop_double_buffering": True}
  # Pipelined all-reduces (B200): a layer's gradient summed across the nodes in the backward loop (the experts',
  # a psum in their shard_map that XLA turns into a reduce-scatter) is sent during the next layer's kernels
  # instead of its own layer's last few: XLA's collective pipeliner moves it into the next iteration (the
  # same values). XLA's reduce-scatter pipeliner, on by default, runs before the all-reduce + slice becomes a
  # reduce-scatter and so never sees these. 13,505 -> 13,104 ms per step on 64 B200 for 4.9 GiB more per GPU
  # (docs/PERF.md, "Super's gradients sent during the next layer"). Not on the H200: 32,750 -> 31,635 ms there,
  # but 81.0 -> 118.1 GiB per GPU, 90% of its 141 GB.
  pipelined = {"xla_gpu_enable_pipelined_all_reduce": True}
  # The scheduler's costs from a profile of the step itself (training/pgle.py): its analytical model does not
  # take the experts' ragged all-to-all, so without one it prices every kernel and collective alike, whatever
  # their sizes, and starts each gradient's reduce-scatter a few kernels before it is needed. Three steps after
  # the first are traced and the step compiled again: on the ruler, with the ruler's costs as the profile,
  # 14,020 -> 13,505 ms per step on 64 B200 (docs/PERF.md, "Super scheduled by a profile of itself").
  c.pgle_steps = 3
  c.xla_options = config_dict.ConfigDict({
      "h200": dict(overlap, xla_gpu_memory_limit_slop_factor=95),
      "b200": dict(overlap, **pipelined, xla_gpu_memory_limit_slop_factor=80),
  })
  return c
