"""Where each tensor of a Nemotron-H checkpoint comes from: the linear layers and tensors of a config,
their names on both sides and the fixed permutations between them (``layout``), MTP and MoE included."""
from __future__ import annotations

import dataclasses
import re
from typing import Callable

import numpy as np

from models import ModelConfig
from models.hf.files import ConversionError


PREFIX = "backbone."                       # NVIDIA's checkpoints; transformers also reads "model."
HF_LAYER_TYPES = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
MTP_BLOCKS = "*E"     # the MTP layer kinds vLLM's NemotronH MTP loader builds (attention, MoE)
GROUP = 16                                 # NVFP4 block: elements per E4M3 scale
E4M3_X_E2M1_MAX = 6.0 * 448.0
QUANTIZED_SUFFIXES = ("weight_scale", "weight_scale_2", "input_scale")   # ModelOpt's tensors beside a weight


def canonical_name(name: str) -> str:
  """A checkpoint tensor's name as the export writes it: transformers 5's ``model.`` prefix is ``backbone.``."""
  return PREFIX + name[len("model."):] if name.startswith("model.") else name


def _in_proj_rows(c: ModelConfig) -> np.ndarray:
  """For each row of Nemotron-H's in_proj [z | x | B | C | dt], the row of ours (group-major)."""
  G, N, P, R = c.n_groups, c.d_state, c.ssm_head_dim, c.ssm_n_heads // c.n_groups
  F = 2 * R * P + 2 * N + R                      # one group's share of the projection
  part = lambda start, width: [g * F + start + j for g in range(G) for j in range(width)]
  return np.array(part(0, R * P) + part(R * P, R * P) + part(2 * R * P, N) + part(2 * R * P + N, N)
                  + part(2 * R * P + 2 * N, R), np.int64)


def _conv_channels(c: ModelConfig) -> np.ndarray:
  """For each conv channel of Nemotron-H [x | B | C], the channel of ours (group-major)."""
  G, N, P, R = c.n_groups, c.d_state, c.ssm_head_dim, c.ssm_n_heads // c.n_groups
  E = R * P + 2 * N
  part = lambda start, width: [g * E + start + j for g in range(G) for j in range(width)]
  return np.array(part(0, R * P) + part(R * P, N) + part(R * P + N, N), np.int64)


def _qkv_rows(c: ModelConfig) -> dict[str, np.ndarray]:
  """Rows of our fused qkv output (per KV head k: R queries, key, value) for q_proj, k_proj, v_proj."""
  K, P, R = c.n_kv_heads, c.head_dim, c.n_heads // c.n_kv_heads
  row = lambda k, slot: [(k * (R + 2) + slot) * P + p for p in range(P)]
  return {"q_proj": np.array([i for k in range(K) for r in range(R) for i in row(k, r)], np.int64),
          "k_proj": np.array([i for k in range(K) for i in row(k, R)], np.int64),
          "v_proj": np.array([i for k in range(K) for i in row(k, R + 1)], np.int64)}


@dataclasses.dataclass(frozen=True)
class Linear:
  """One Nemotron-H linear weight: rows ``rows`` (None: all, in order) of our kernel ``path``, transposed."""
  hf_name: str
  path: tuple[str, ...]
  rows: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class Tensor:
  """Any other parameter: ``to_hf(ours) -> theirs`` and its inverse ``from_hf``."""
  hf_name: str
  path: tuple[str, ...]
  to_hf: Callable[[np.ndarray], np.ndarray]
  from_hf: Callable[[np.ndarray], np.ndarray]


def _same(x):
  return x


def layout(c: ModelConfig) -> tuple[list[Linear], list[Tensor]]:
  """Every Nemotron-H tensor of ``c`` and where it comes from in our parameter tree."""
  check_exportable(c)
  linears: list[Linear] = []
  tensors = [Tensor(f"{PREFIX}embeddings.weight", ("embed", "embedding"), _same, _same),
             Tensor(f"{PREFIX}norm_f.weight", ("final_norm", "scale"), _same, _same)]
  for i, char in enumerate(c.pattern):
    _block_layout(c, char, f"{PREFIX}layers.{i}.", (f"blocks_{i}",), linears, tensors)
  _mtp_layout(c, linears, tensors)
  linears.append(Linear("lm_head.weight", ("lm_head",)))
  return linears, tensors


def _block_layout(c: ModelConfig, char: str, layer: str, block: tuple[str, ...], linears: list[Linear],
                  tensors: list[Tensor]) -> None:
  """Appends the tensors of one block (``char``) at our ``block`` path, named ``<layer>norm.weight`` etc."""
  tensors.append(Tensor(layer + "norm.weight", (*block, "norm", "scale"), _same, _same))
  mixer = (*block, "mixer")
  if char == "M":
    channels = _conv_channels(c)
    inverse = np.argsort(channels)
    linears += [Linear(layer + "mixer.in_proj.weight", (*mixer, "in_proj"), _in_proj_rows(c)),
                Linear(layer + "mixer.out_proj.weight", (*mixer, "out_proj"))]
    tensors += [
        Tensor(layer + "mixer.conv1d.weight", (*mixer, "conv_weight"),
               lambda w_WxE, ch=channels: w_WxE[:, ch].T[:, None, :],
               lambda w_Ex1xW, inv=inverse: w_Ex1xW[:, 0, :].T[:, inv])]
    if c.conv_bias:
      tensors.append(Tensor(layer + "mixer.conv1d.bias", (*mixer, "conv_bias"),
                            lambda b_E, ch=channels: b_E[ch], lambda b_E, inv=inverse: b_E[inv]))
    tensors += [Tensor(layer + f"mixer.{name}", (*mixer, name), _same, _same) for name in ("dt_bias", "A_log", "D")]
    tensors.append(Tensor(layer + "mixer.norm.weight", (*mixer, "norm_scale"), _same, _same))
  elif char == "*":
    linears += [Linear(layer + f"mixer.{name}.weight", (*mixer, "qkv"), rows)
                for name, rows in _qkv_rows(c).items()]
    linears.append(Linear(layer + "mixer.o_proj.weight", (*mixer, "out")))
  elif char == "E":
    linears += _moe_linears(c, layer, mixer)
    tensors += _moe_tensors(layer, mixer)
  else:
    linears += [Linear(layer + "mixer.up_proj.weight", (*mixer, "up")),
                Linear(layer + "mixer.down_proj.weight", (*mixer, "down"))]


# The MTP modules as vLLM's NemotronH MTP loader reads them (vllm/model_executor/models/nemotron_h_mtp.py):
# module m's blocks are the flat layers mtp.layers.<m * P + j> (P = len(mtp_pattern)); the first of a module
# also holds enorm, hnorm and eh_proj [D, 2D] (input: [enorm(embedding) | hnorm(hidden)]), the last its
# final_layernorm; the embedding and lm_head are the main model's. Routed experts are written one tensor per
# expert, mixer.experts.<e>.up_proj.weight [out, in], the names its expert mapping looks for.
MTP_ROUTED = re.compile(r"(mtp\.layers\.\d+\.mixer\.experts)\.(up_proj|down_proj)")
# One routed expert's weight, in any layer: the MTP layers (above), and every layer of an NVFP4 export.
_EXPERT = re.compile(r"((?:backbone|mtp)\.layers\.\d+\.mixer\.experts)\.(\d+)\.(up_proj|down_proj)\.weight")


def _mtp_layout(c: ModelConfig, linears: list[Linear], tensors: list[Tensor]) -> None:
  P = len(c.mtp_pattern)
  for m in range(c.mtp_modules):
    module = f"mtp_{m}"
    for j, char in enumerate(c.mtp_pattern):
      layer = f"mtp.layers.{m * P + j}."
      if j == 0:
        tensors += [Tensor(layer + f"{norm}.weight", (module, norm, "scale"), _same, _same) for norm in ("enorm", "hnorm")]
        linears.append(Linear(layer + "eh_proj.weight", (module, "eh_proj")))
      _block_layout(c, char, layer, (module, f"layers_{j}"), linears, tensors)
      if j == P - 1:
        tensors.append(Tensor(layer + "final_layernorm.weight", (module, "final_norm", "scale"), _same, _same))


def split_mtp_experts(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """The MTP layers' stacked routed experts ``...experts.up_proj`` (E, out, in) as one tensor per expert."""
  out = {}
  for name, value in tensors.items():
    match = MTP_ROUTED.fullmatch(name)
    if match is None:
      out[name] = value
      continue
    out.update({f"{match.group(1)}.{e}.{match.group(2)}.weight": np.ascontiguousarray(value[e])
                for e in range(value.shape[0])})
  return out


def join_experts(named: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """Per-expert weights ``...experts.<e>.up_proj.weight`` stacked in expert order as ``...experts.up_proj``
  (E, out, in): the inverse of ``split_mtp_experts``, and of the per-expert layers of an NVFP4 export once
  dequantized."""
  out, groups = {}, {}
  for name, value in named.items():
    match = _EXPERT.fullmatch(name)
    if match is None:
      out[name] = value
    else:
      groups.setdefault(f"{match.group(1)}.{match.group(3)}", {})[int(match.group(2))] = value
  for name, experts in groups.items():
    if sorted(experts) != list(range(len(experts))):
      raise ConversionError(f"{name}: the checkpoint has experts {sorted(experts)[:8]}..., not 0 .. E-1")
    out[name] = np.stack([experts[e] for e in range(len(experts))])
  return out


def _moe_linears(c: ModelConfig, layer: str, mixer: tuple[str, ...]) -> list[Linear]:
  """An ``E`` block's dense linears: the shared expert and the latent projections."""
  out = [Linear(layer + "mixer.shared_experts.up_proj.weight", (*mixer, "shared_experts", "up")),
         Linear(layer + "mixer.shared_experts.down_proj.weight", (*mixer, "shared_experts", "down"))]
  if c.moe_latent_size:
    out += [Linear(layer + "mixer.fc1_latent_proj.weight", (*mixer, "fc1_latent_proj")),
            Linear(layer + "mixer.fc2_latent_proj.weight", (*mixer, "fc2_latent_proj"))]
  return out


def _swap_last(x):
  return np.swapaxes(x, -1, -2)


def _moe_tensors(layer: str, mixer: tuple[str, ...]) -> list[Tensor]:
  """An ``E`` block's router (transformers' ``gate``: weight [E, D], float32, and the bias buffer) and the
  routed experts, stored as transformers stores them, (E, out, in): ours are (E, in, out)."""
  return [Tensor(layer + "mixer.gate.weight", (*mixer, "router", "kernel"), _swap_last, _swap_last),
          Tensor(layer + "mixer.gate.e_score_correction_bias", (*mixer, "router", "e_score_correction_bias"),
                 _same, _same),
          Tensor(layer + "mixer.experts.up_proj", (*mixer, "experts", "up", "kernel"), _swap_last, _swap_last),
          Tensor(layer + "mixer.experts.down_proj", (*mixer, "experts", "down", "kernel"), _swap_last, _swap_last)]


ROUTER_TENSORS = (".mixer.gate.weight", ".mixer.gate.e_score_correction_bias")   # float32 in any export


def check_exportable(c: ModelConfig) -> None:
  if getattr(c, "scan_blocks", False):
    raise ConversionError("scan_blocks=True stacks the blocks' parameters; the conversion reads the per-block "
                          "tree (blocks_<i>): convert with models.lm.unscanned_params and scan_blocks=False "
                          "(python -m tools.hf export does this)")
  if c.rope:
    raise ConversionError("rope=True: Nemotron-H attention has no position encoding; only rope=False models "
                          "export")
  if "E" in c.pattern and not c.moe_shared_expert_intermediate_size:
    raise ConversionError("moe_shared_expert_intermediate_size=0: transformers' NemotronHMoE always has a shared "
                          "expert; only MoE models with one export")
  bad_mtp = sorted(set(c.mtp_pattern) - set(MTP_BLOCKS)) if c.mtp_depths else []
  if bad_mtp:
    raise ConversionError(f"mtp_pattern={c.mtp_pattern!r} has blocks {bad_mtp}: vLLM's NemotronH MTP loader builds "
                          "only attention ('*') and MoE ('E') MTP layers; use an mtp_pattern of those (Super: '*E')")
  if "-" in c.all_patterns and c.mlp_kind != "relu2":
    raise ConversionError(f"mlp_kind={c.mlp_kind!r}: Nemotron-H MLPs are squared ReLU without a gate; only "
                          "mlp_kind='relu2' models export")


