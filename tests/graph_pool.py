"""A torch.compile backend for CPU tests that keeps CUDA graphs' rules for outputs and inputs ("graph_pool").

On CUDA, compiled decoding replays CUDA graphs (inductor's "reduce-overhead", CUDA graph trees). Two of their rules
decide whether the decoders are right there, and neither shows with the eager backend on a CPU:
  - a graph's outputs live in one memory pool shared by every graph; once any graph runs again (each step marks a new
    one, torch.compiler.cudagraph_mark_step_begin), earlier outputs may be overwritten. Here every output that is not
    an input's own memory is poisoned (NaN, a huge integer, or flipped bools) when the next graph starts, so a caller
    that reads a stale output decodes something else than the eager path (or fails indexing);
  - a graph that writes into one of its inputs in place is recorded only if that input has a fixed address
    (torch._dynamo.mark_static_address, or a parameter or buffer of a module); otherwise inductor skips CUDA graphs
    for it and the step runs kernel by kernel. Here such a write raises, naming the input.
The graph itself runs as dynamo traced it (gm.forward).
"""

from __future__ import annotations

import torch

NAME = "graph_pool"
_POOL: list[torch.Tensor] = []  # outputs of the last graph run that live in the pool


def _poison(t: torch.Tensor) -> None:
    if t.dtype == torch.bool:
        t.logical_not_()
    elif t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    else:
        t.fill_(torch.iinfo(t.dtype).max // 3)


def _fixed_address(t: torch.Tensor) -> bool:
    return isinstance(t, torch.nn.Parameter) or getattr(t, "_dynamo_static_input_type", None) is not None


def graph_pool(gm: torch.fx.GraphModule, example_inputs):
    buffers = {id(b) for b in gm.buffers()}  # tensors the traced graph holds itself (constants)

    def run(*args):
        with torch.no_grad():
            for t in _POOL:
                _poison(t)
        _POOL.clear()
        inputs = [a for a in args if isinstance(a, torch.Tensor)]
        versions = [a._version for a in inputs]
        outs = gm.forward(*args)
        for a, v in zip(inputs, versions):
            if a._version != v and not _fixed_address(a) and id(a) not in buffers:
                raise AssertionError(f"a compiled graph wrote in place into an input {tuple(a.shape)} {a.dtype} "
                                     "without a fixed address (mark_static_address): CUDA graphs would be skipped")
        storages = {a.untyped_storage().data_ptr() for a in inputs}
        seen = set()
        for o in outs if isinstance(outs, (list, tuple)) else [outs]:
            if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in storages:
                where = (o.untyped_storage().data_ptr(), o.storage_offset(), tuple(o.shape), o.stride())
                if where not in seen:  # one poisoning per view (two flips of a bool would undo it)
                    seen.add(where)
                    _POOL.append(o)
        return outs

    return run


def register() -> str:
    """Register the backend with dynamo (once); returns its name for CacheMode(backend=...)."""
    from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend

    if NAME not in _COMPILER_FNS:
        register_backend(graph_pool, name=NAME)
    return NAME
