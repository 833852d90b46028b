"""The precision policy of a run, and how many bytes a parameter costs under it.

Three dtypes describe mixed precision (as Megatron's and FSDP2's MixedPrecisionPolicy do):

- `compute`: the dtype matrix multiplications run in (`train.dtype`; bf16 runs the forward
  and backward under autocast);
- `params`: the dtype the model's parameters and their gradients are stored in, which
  ZeRO-3 gathers (`train.param_dtype`). When it is not fp32 the optimizer keeps an fp32
  master copy of the weights beside Adam's two fp32 moments, sharded as the moments are;
- `reduce`: the dtype data parallel sums gradients in (`train.reduce_dtype`, default the
  parameters' dtype); the sum is stored back in the gradients' dtype.

Bytes per parameter before sharding (Rajbhandari et al. 2020, Section 3.1), with Adam:
fp32 4 + 4 + 8 (the weights are their own master copy); bf16 parameters 2 + 2 + 12 (fp32
master weights, momentum and variance). `train.dtype = "bf16"` alone keeps fp32 parameters
and gradients under bf16 autocast: 4 + 4 + 8, as before this policy existed.

The planner names a policy with a string: "fp32", "bf16" or "fp16" mean all three dtypes
equal (the ZeRO paper's mixed precision for the 16-bit ones); otherwise the compute dtype
followed by what differs, e.g. "bf16,params=fp32,reduce=fp32" for bf16 autocast over fp32
weights. `PrecisionPolicy.name` and `parse_policy` convert both ways.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from ..config import TrainConfig

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
RUNTIME_DTYPES = ("fp32", "bf16")  # what the training runtime implements (fp16 needs loss scaling)
MOMENT_BYTES = {"adam": 8, "adamw": 8, "sgd": 4}  # fp32 optimizer moments per parameter


class ElementBytes(NamedTuple):
    """Bytes per element of the two kinds of activation that collectives carry, under a
    precision policy (`PrecisionPolicy.element_bytes`).

    ``residual``: the residual stream and what is computed from it outside matrix
    multiplications (the embedding's and the norms' outputs, which the next matmul reads), and
    the gradients flowing back into them, in the wider of the parameter and compute dtypes.
    ``compute``: what matrix multiplications produce (attention and MLP outputs, projected
    keys and values, expert outputs) and its gradients, in the compute dtype. The two are equal
    in fp32 and with 16-bit parameters; bf16 autocast over fp32 weights keeps the residual
    stream in fp32 and casts only inside each matmul.
    """

    residual: int
    compute: int


class PrecisionError(ValueError):
    """A precision setting that cannot be used; the message says what to change."""


@dataclass(frozen=True)
class PrecisionPolicy:
    compute: str = "fp32"
    params: str = "fp32"
    reduce: str = "fp32"

    def __post_init__(self) -> None:
        for key in ("compute", "params", "reduce"):
            if getattr(self, key) not in DTYPE_BYTES:
                raise PrecisionError(f"{key} dtype {getattr(self, key)!r} is unknown; use one of {', '.join(DTYPE_BYTES)}")

    @classmethod
    def from_train(cls, train: TrainConfig) -> "PrecisionPolicy":
        """The runtime's policy from `train.dtype`, `train.param_dtype` and `train.reduce_dtype`."""
        for key in ("dtype", "param_dtype"):
            value = getattr(train, key)
            if value not in RUNTIME_DTYPES:
                raise PrecisionError(f"train.{key}='{value}' is unknown; use one of {', '.join(RUNTIME_DTYPES)}")
        reduce = train.reduce_dtype or train.param_dtype
        if reduce not in RUNTIME_DTYPES:
            raise PrecisionError(
                f"train.reduce_dtype='{train.reduce_dtype}' is unknown; use one of {', '.join(RUNTIME_DTYPES)}, "
                "or leave it empty to reduce in train.param_dtype"
            )
        if train.param_dtype != "fp32" and train.dtype != train.param_dtype:
            raise PrecisionError(
                f"train.param_dtype='{train.param_dtype}' computes in {train.param_dtype}: "
                f"set train.dtype='{train.param_dtype}' too (train.dtype='{train.dtype}' now)"
            )
        return cls(train.dtype, train.param_dtype, reduce)

    @property
    def name(self) -> str:
        """The planner's name of this policy (module docstring)."""
        differs = [f"{k}={getattr(self, k)}" for k in ("params", "reduce") if getattr(self, k) != self.compute]
        return ",".join([self.compute, *differs])

    @property
    def has_master_weights(self) -> bool:
        """Whether the optimizer keeps an fp32 copy of the weights apart from the parameters."""
        return self.params != "fp32"

    @property
    def param_bytes(self) -> int:
        return DTYPE_BYTES[self.params]

    @property
    def grad_bytes(self) -> int:
        return DTYPE_BYTES[self.params]  # gradients are stored in the parameters' dtype

    @property
    def reduce_bytes(self) -> int:
        return DTYPE_BYTES[self.reduce]

    @property
    def compute_bytes(self) -> int:
        return DTYPE_BYTES[self.compute]

    @property
    def residual(self) -> str:
        """The residual stream's dtype: the wider of the parameter and compute dtypes (bf16
        autocast over fp32 weights keeps it in fp32; bf16 weights make it bf16)."""
        return self.params if self.param_bytes >= self.compute_bytes else self.compute

    @property
    def residual_bytes(self) -> int:
        return DTYPE_BYTES[self.residual]

    def element_bytes(self) -> ElementBytes:
        """What each kind of activation a collective carries costs per element (`volumes.ElementBytes`)."""
        return ElementBytes(self.residual_bytes, self.compute_bytes)

    def optimizer_bytes(self, optimizer: str = "adam") -> int:
        """K: optimizer state per parameter, fp32 moments plus the fp32 master copy if any."""
        opt = optimizer.lower()
        if opt not in MOMENT_BYTES:
            raise PrecisionError(f"optimizer={optimizer!r} is unknown; use one of {', '.join(MOMENT_BYTES)}")
        return MOMENT_BYTES[opt] + (4 if self.has_master_weights else 0)


def parse_policy(precision: str) -> PrecisionPolicy:
    """The policy a planner precision name stands for ("bf16", "bf16,params=fp32,reduce=fp32", ...)."""
    compute, *rest = [part.strip() for part in precision.split(",")]
    if compute not in DTYPE_BYTES:
        raise PrecisionError(f"precision={precision!r} is unknown; use one of {', '.join(DTYPE_BYTES)}")
    dtypes = {"params": compute, "reduce": compute}
    for part in rest:
        key, _, value = part.partition("=")
        if key not in dtypes or value not in DTYPE_BYTES:
            raise PrecisionError(
                f"precision={precision!r}: '{part}' must be params=<dtype> or reduce=<dtype> "
                f"with a dtype of {', '.join(DTYPE_BYTES)}"
            )
        dtypes[key] = value
    return PrecisionPolicy(compute, dtypes["params"], dtypes["reduce"])
