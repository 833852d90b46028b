"""Model FLOPs, model FLOPs utilisation (MFU) and a measured matmul peak.

Definition used throughout fivefold (PaLM's, as torchtitan computes it):

    model FLOPs per token = 6 * N + 12 * L * H * Q * T

- N: parameters one token passes through in matrix multiplications, i.e. every parameter of
  the model except the input embedding table (a lookup, no FLOPs). The output head counts
  (with tied embeddings the shared matrix is counted once, as the head). Norm weights are
  included, as torchtitan does; they are about 1e-4 of N. For Mixture-of-Experts layers N
  counts the *active* parameters: router, top_k routed experts and the shared experts.
- 6 = 2 FLOPs per multiply-add x (1 forward + 2 backward matmuls: input and weight grads).
- 12 * L * H * Q * T: attention scores q k^T and the weighted sum of v, each 2 * Q * T
  FLOPs per token and head in the forward pass, times 3 for forward + backward; L layers,
  H query heads, Q head dimension, T sequence length. Like PaLM we do not halve it for the
  causal mask (a causal kernel does about half of this work), and recomputation
  (activation checkpointing, flash attention's backward) is not counted: MFU measures
  useful model work, not what the hardware executed.

Sources: Kaplan et al. 2020, "Scaling Laws for Neural Language Models", sec. 2.1 (C = 6N
per token); Chowdhery et al. 2022, "PaLM: Scaling Language Modeling with Pathways",
appendix B (6N + 12LHQT and the definition of MFU); torchtitan `get_num_flop_per_token`
(N = all parameters minus the input embedding).

    MFU = tokens/s * model FLOPs per token / peak FLOP/s

where tokens/s and the peak refer to the same devices (divide by the number of devices, or
multiply the peak by it). On CPUs there is no datasheet peak worth the name, so fivefold
uses the FLOP/s of a large GEMM measured on the same machine (`measure_matmul_flops`): an
achievable peak, which makes a CPU MFU an upper-bound-style ratio rather than a datasheet one.
"""

from __future__ import annotations

import time

import torch

from .config import ModelConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # train.dtype -> matmul dtype


def attention_params(m: ModelConfig) -> int:
    """wq, wk, wv, wo of one layer (grouped-query: k and v have n_kv_heads heads)."""
    q_width, kv_width = m.heads * m.head_dim, m.n_kv_heads * m.head_dim
    return m.hidden * q_width + 2 * m.hidden * kv_width + q_width * m.hidden


def mlp_params_per_token(m: ModelConfig, layer: int) -> int:
    """Parameters of layer `layer`'s MLP a token goes through: dense SwiGLU or active MoE."""
    if not m.is_moe_layer(layer):
        return 3 * m.hidden * m.ffn
    router = m.hidden * m.num_experts
    experts = (m.top_k + m.shared_experts) * 3 * m.hidden * m.expert_ffn
    return router + experts


def moe_layer_count(m: ModelConfig) -> int:
    """Layers i >= first_dense_layers with i % moe_every == moe_every - 1 (ModelConfig.is_moe_layer)."""
    if not m.is_moe:
        return 0
    every, first = max(m.moe_every, 1), min(m.first_dense_layers, m.layers)
    return m.layers // every - first // every


def parameter_count(m: ModelConfig) -> int:
    """Every parameter of the full model (all experts), in closed form: no loop over layers,
    so it also sizes configurations far too large to build."""
    shared = 3 * m.hidden * m.expert_ffn * m.shared_experts
    moe_mlp = m.hidden * m.num_experts + 3 * m.num_experts * m.hidden * m.expert_ffn + shared
    moe_layers = moe_layer_count(m)
    per_layer = attention_params(m) + 2 * m.hidden  # attention and its two norms
    layers = m.layers * per_layer + (m.layers - moe_layers) * 3 * m.hidden * m.ffn + moe_layers * moe_mlp
    embeddings = m.vocab_size * m.hidden * (1 if m.tied_embeddings else 2)
    return layers + embeddings + m.hidden  # + the final norm


def machine_memory_bytes(device: str = "cpu") -> tuple[int, str]:
    """Memory one machine offers a run, and what it is: the memory of its GPUs, or its RAM."""
    import os

    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        count = torch.cuda.device_count()
        total = sum(torch.cuda.get_device_properties(i).total_memory for i in range(count))
        return total, f"{count} GPU(s)"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "RAM"


def active_params_per_token(m: ModelConfig) -> int:
    """N of the PaLM formula: every parameter except the input embedding, MoE counted as active."""
    norms_per_layer = 2 * m.hidden
    layers = sum(attention_params(m) + norms_per_layer + mlp_params_per_token(m, i) for i in range(m.layers))
    head = m.hidden * m.vocab_size
    final_norm = m.hidden
    return layers + final_norm + head


def attention_flops_per_token(m: ModelConfig, seq_len: int) -> int:
    """12 * L * H * Q * T: scores and weighted values, forward + backward, no causal discount."""
    return 12 * m.layers * m.heads * m.head_dim * seq_len


def model_flops_per_token(model_config: ModelConfig, seq_len: int) -> int:
    """Training FLOPs (forward + backward) per token: 6 * N + 12 * L * H * Q * T (PaLM)."""
    return 6 * active_params_per_token(model_config) + attention_flops_per_token(model_config, seq_len)


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the peak FLOP/s of the same devices."""
    if peak_flops <= 0:
        raise ValueError(f"peak_flops must be positive, got {peak_flops}")
    return tokens_per_s * flops_per_token / peak_flops


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_operands(
    size: int | tuple[int, int, int], dtype: torch.dtype, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random operands of an (m, k) @ (k, n) GEMM; an int size means m = k = n."""
    m, k, n = (size, size, size) if isinstance(size, int) else size
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=generator).to(device=device, dtype=dtype)
    b = torch.randn(k, n, generator=generator).to(device=device, dtype=dtype)
    return a, b


def measure_matmul_flops(
    dtype: torch.dtype = torch.float32,
    size: int | tuple[int, int, int] = 1024,
    seconds: float = 0.25,
    device: torch.device | str = "cpu",
) -> float:
    """FLOP/s of repeated (m, k) @ (k, n) GEMMs, 2 * m * k * n FLOPs each, best of short bursts.

    `seconds` bounds the whole call, warm-up included (one untimed GEMM, then at least one
    timed one). The fastest burst is reported, since on a shared machine the slow ones
    measure other processes, not the hardware.
    """
    device = torch.device(device)
    start_all = time.perf_counter()
    a, b = matmul_operands(size, dtype, device)
    flops = 2 * a.shape[0] * a.shape[1] * b.shape[1]
    out = a @ b  # warm-up: thread pool, allocator, kernel selection
    _sync(device)
    best = 0.0
    while best == 0.0 or time.perf_counter() - start_all < seconds:
        start = time.perf_counter()
        torch.matmul(a, b, out=out)
        _sync(device)
        best = max(best, flops / (time.perf_counter() - start))
    return best


def peak_flops_for_log(dtype: torch.dtype, device: torch.device, world_size: int) -> float:
    """A cheap (~0.2 s) measured peak of all `world_size` devices, for the MFU of training logs.

    A 512-cube GEMM on CPU (quick even on a loaded machine), 4096 on accelerators (large
    enough to reach their matmul peak). Measured while the machine does whatever else it
    does, so on a shared CPU the logged MFU is indicative; `fivefold bench single`
    measures the peak alongside the model for a stated number.
    """
    size = 512 if device.type == "cpu" else 4096
    return world_size * measure_matmul_flops(dtype, size=size, seconds=0.2, device=device)
