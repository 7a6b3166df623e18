"""The paper's 8B hybrid (spec §7): 52 blocks (24 Mamba-2, 24 MLP, 4 attention), last 8 in bf16; the NVFP4
vs MXFP4 comparison on 1T tokens (sequence 8192, batch 736, warmup-stable-decay). Run it twice:

  python train.py --config configs/hybrid_8b.py --config.data.sources='/data/tokens/*.bin' \
      --config.data.token_dtype=uint32 --workdir /ckpt/hybrid_8b_nvfp4
  python train.py --config configs/hybrid_8b.py --config.recipe=mxfp4 --config.data.sources='/data/tokens/*.bin' \
      --config.data.token_dtype=uint32 --workdir /ckpt/hybrid_8b_mxfp4
"""
from configs import nemotron_h_12b


def get_config():
  c = nemotron_h_12b.get_config()
  c.name = "hybrid_8b"
  c.model.preset = "hybrid_8b"
  c.steps = 166_000  # 1T tokens / (736 * 8192)
  return c
