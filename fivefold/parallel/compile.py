"""Regional compilation: torch.compile applied to each transformer block's computation.

One block is compiled at a time (as torchtitan does) rather than the whole model: every
block of a model has the same code, so dynamo traces it once and reuses the compiled code
for the others, and compile time does not grow with depth.

What is compiled is `Block._forward` (the computation), not the module call. The hooks
that strategies install on a block (ZeRO-3's parameter gathers, activation recomputation's
checkpoint, the pipeline's bookkeeping) therefore stay eager around the compiled code.
Hooks on modules *inside* a block (tensor-parallel region entries and exits, the context
parallel attention core) run inside the compiled function; dynamo breaks the graph at their
collectives and runs those eagerly, so a block compiles into a few graphs between the
collectives.

A Mixture-of-Experts layer (router, dispatch, experts) runs eagerly inside the compiled
block: how many tokens each expert gets is data, so every step would bring new shapes to
compile, the expert-parallel all-to-all sizes are read back to Python, and torch's grouped
GEMM has no fp32 kernel for the compiler to trace. Attention and the norms stay compiled.

Without tensor parallelism, the end of the model is two more regions: the final norm with
the head (`Transformer.final`) and the token loss. They are separate only because the loss is applied outside the model
(by the training step and the pipeline); the head's matmul is an external kernel that no
element-wise work fuses into, so one region would fuse nothing more than these two do.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..model import Transformer
from ..model.llama import Block
from ..model.moe import MoE
from ..model.step import cross_entropy_sum, whole_cross_entropy_sum

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def compile_blocks(chunk: Transformer) -> None:
    """Replace each block's `_forward` with its compiled version, on this instance only."""
    for block in chunk.layers.values():
        if isinstance(block, Block):  # every layer is; the check tells the type checker
            compile_block(block)


def compile_model_end(chunks: list[Transformer], loss_fn: LossFn) -> LossFn:
    """Compile the final norm + head of the chunk that holds them, and return the loss compiled,
    where neither communicates: with the plain cross entropy (compiled whole: see
    `whole_cross_entropy_sum`). Tensor parallelism's head and
    vocabulary-parallel loss collect across ranks; they stay eager (a compiled region would
    break at every collective, adding graphs to compile for element-wise work on (B, T, V/tp))."""
    if loss_fn is not cross_entropy_sum:
        return loss_fn
    for chunk in chunks:
        if chunk.has_head:
            setattr(chunk, "final", torch.compile(chunk.final))
    return torch.compile(whole_cross_entropy_sum)


def compile_block(block: Block) -> None:
    # An instance attribute shadows the method: Block.forward (eager, with its hooks and
    # recomputation) calls self._forward, which is now the compiled computation.
    if isinstance(block.mlp, MoE):
        setattr(block.mlp, "forward", torch.compiler.disable(block.mlp.forward))
    setattr(block, "_forward", torch.compile(block._forward))
