"""CPU shim for SpecForge 0.2.0's EAGLE-3 training code (apply() before any specforge import).

What it changes, and why:
1. specforge.core.loss is replaced by a module whose LogSoftmaxLoss computes the same formula in eager torch
   (loss = mean over positions of -sum_v mask * target_p * log_softmax(logits)): the original imports triton at
   import time and runs Triton kernels, which need a GPU.
2. torch.compile is off (TORCHDYNAMO_DISABLE=1, set by the runner): SpecForge compiles its target-probability and metric
   helpers, and inductor on this CPU spends ~40 s compiling for no gain at these sizes.
Not patched but chosen by the runner: offline mode only (its online mode needs an SGLang server), the SDPA attention
backend, one process without FSDP sharding (its NO_SHARD setting), its BF16Optimizer (AdamW over fp32 master copies)
on an fp32 model, and the target's lm_head read from the target's own files (tied embeddings: the embedding matrix).
"""
import sys
import types


def apply():
    import torch

    class LogSoftmaxLoss(torch.autograd.Function):
        """SpecForge's Triton loss, in eager torch (same value, same gradient)."""

        @staticmethod
        def forward(ctx, logits, target, position_mask):
            with torch.enable_grad():
                x = logits.detach().float().requires_grad_(True)
                loss = -(position_mask * target * torch.log_softmax(x, dim=-1)).sum(-1).mean()
                (grad,) = torch.autograd.grad(loss, x)
            ctx.save_for_backward(grad.to(logits.dtype))
            return loss.detach()

        @staticmethod
        def backward(ctx, grad_output):
            (grad,) = ctx.saved_tensors
            return grad * grad_output, None, None

    module = types.ModuleType("specforge.core.loss")
    module.LogSoftmaxLoss = LogSoftmaxLoss
    sys.modules["specforge.core.loss"] = module
