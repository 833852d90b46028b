"""FP8 GEMMs: which matrix multiplications run in FP8, and what is kept or sent in FP8.

The recipe is DeepSeek-V3's (arXiv 2412.19437, Section 3.3), which torchao's float8 training
follows for the same layers: the linear layers of attention (its projections), of the dense
MLP and of the experts run their forward, input-gradient and weight-gradient GEMMs in FP8;
the embedding, the output head, the MoE router, the norms and the attention core (scores,
softmax, weighted sum) keep the 16-bit compute dtype. Everything else is the bf16 mixed
precision policy (`BASE_POLICY`): 16-bit weights and gradients, fp32 master weights and moments.

Bytes in FP8 (`FP8_BYTES` per element, Section 3.3.3-3.3.4): the inputs the FP8 linear layers
keep for their weight gradient, the expert dispatch forward and the gradient that goes to the
experts backward (the combine's gradient); the combine itself stays in 16 bits.
"""

from __future__ import annotations

FP8 = "fp8"
FP8_BYTES = 1
BASE_POLICY = "bf16"

# The linear layers FP8 covers, by role, and those it leaves in the compute dtype.
FP8_LINEARS = ("attention projections", "dense MLP", "routed experts", "shared experts")
HIGH_PRECISION = ("embedding", "output head", "MoE router", "norms", "attention core")


def is_fp8(precision: str) -> bool:
    """Whether a precision name asks for FP8 GEMMs."""
    return str(precision).lower() == FP8


def base_policy(precision: str) -> str:
    """The precision policy of everything FP8 does not cover (the name itself otherwise)."""
    return BASE_POLICY if is_fp8(precision) else precision
