"""The registry of draft kinds: each kind registers its adapter (drafts/base.py) with one frozen record of what it is
(DraftKind), and shared code asks the registry instead of keeping a table of kinds.

A kind registers itself where it is written:

    @register_kind(name="eagle3", inits={"eagle3": ("intermediate_size",)}, ..., exporters={"vllm": export_eagle3})
    class Eagle3Draft(DraftAdapter): ...

The registry is filled by importing the kinds' modules: drafts/__init__.py imports the built-in ones (lm.py, eagle3/,
dflash/); a test or an extension imports its own before it composes a config naming it. Lookups (kind_for_init,
draft_adapter, saved_kind, exported_kind, draft_in_folder) try the specific kinds in registration order and the
catch-all kind (any causal LM) last. Knows nothing of objectives, the evaluator or the pipeline.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional

import torch

from specdistill.tensors import unwrap

if TYPE_CHECKING:
    from specdistill.config import DraftConfig
    from specdistill.drafts.base import DraftAdapter
    from specdistill.export import ExportResult

# The draft.* size settings a kind may honour (the fields of config.DraftConfig that size a draft)
SIZE_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")

# writer(draft_dir, out_dir, fmt=..., target_path=..., overwrite=..., dtype=..., **the format's options) -> ExportResult
Writer = Callable[..., "ExportResult"]


@dataclass(frozen=True)
class Card:
    """What the model card (hub/card.py) says of a pushed draft of this kind."""
    title: str = "A draft model"      # how the card names it
    library: str = "transformers"     # the card's library_name: who loads the folder
    tags: tuple[str, ...] = ()        # the card's extra hub tags


@dataclass(frozen=True)
class DraftLength:
    """The most tokens one proposal of a draft holds, in the words of a refusal of a longer one."""
    most: int                   # tokens one proposal holds at most
    limit: str                  # what bounds it, after "eval.gamma=6 exceeds ": "what a DFlash block drafts (...)"
    fix: Callable[[int], str]   # tokens asked -> the kind's setting that would hold them ("draft.dflash.block_size=7")


@dataclass(frozen=True)
class DraftKind:
    """One kind of draft: what it is (fields) and the kind-level work (exports, checks of a saved draft).
    The per-draft work (build, load, drafting, losses) is its adapter's."""
    name: str                                 # in reports and messages ("draft", "eagle3", "dflash")
    adapter: type[DraftAdapter]
    inits: Mapping[str, tuple[str, ...]]      # draft.init values that build it -> the draft.* sizes (SIZE_KEYS) each
                                              # honours; a size it does not honour is refused by validation
    path_inits: tuple[str, ...] = ()          # draft.init values that read draft.path (a warm start, the weights)
    num_layers: Optional[int] = None          # the draft.num_layers it must have (None: any)
    decodes_alone: bool = True                # can generate without the target (the assist=false rollout ablation)
    needs_data_to_build: bool = False         # building needs training data (so no untrained one can be evaluated)
    trains_trees: bool = True                 # Draft-OPD can train it on token-tree rollouts (objective.tree_topk)
    serves_trees: bool = True                 # serving engines decode its token trees (SGLang's EAGLE tree flags)
    data_objective: str = "kd"                # the objective (objectives/) that trains it on data batches: Draft-OPD's
                                              # kd_weight term and its warm-up use it
    warmup_objective: Optional[Mapping[str, Any]] = None  # a warm-up objective (name + settings) replacing a recipe's
                                              # warmup.objective that names another objective (None: the recipe's)
    card: Card = Card()
    exporters: Mapping[str, Writer] = field(default_factory=dict)  # serving format -> its writer; {}: the checkpoint
                                              # folder is served as is
    export_architectures: tuple[str, ...] = ()  # config.json architectures of its exports (--check finds the kind)
    validator: Optional[Callable[..., ExportResult]] = None  # (path, target_path=None) -> ExportResult, or raises
    fits: Optional[Callable[..., None]] = None  # (draft, path, target_model, target_name, log): checks of a saved draft
                                              # beyond its vocabulary (widths, layers, missing embeddings)
    max_draft_length: Optional[Callable[[DraftConfig, Optional[Path]], Optional[DraftLength]]] = None
                                              # (draft_cfg, the folder at eval.draft_path or None): the most tokens one
                                              # proposal holds, of the draft saved in that folder (its config.json)
                                              # when given, else of the one draft_cfg builds; None: no bound
    describe_folder: Optional[Callable[[dict], Optional[str]]] = None  # config.json -> what a folder of its drafts is,
                                              # in words ("a DFlash block drafter (architectures [...])"), or None;
                                              # no hook: the folders its saved_in or export_architectures claim
    catch_all: bool = False                   # takes any model and folder no other kind claims (tried last; one kind)

    def __post_init__(self):
        object.__setattr__(self, "inits", MappingProxyType(dict(self.inits)))
        object.__setattr__(self, "exporters", MappingProxyType(dict(self.exporters)))
        if self.warmup_objective is not None:
            object.__setattr__(self, "warmup_objective", MappingProxyType(dict(self.warmup_objective)))

    @property
    def formats(self) -> tuple[str, ...]:
        """The serving formats it exports to, in its exporters' order."""
        return tuple(self.exporters)

    def export(self, draft_dir, out_dir, fmt: str, target_path: Optional[str] = None, **options) -> ExportResult:
        """Write a checkpoint's draft folder in serving format `fmt` (validated, nothing written on a problem)."""
        if not self.exporters:
            raise ValueError(f"a {self.name} draft has no serving export formats: serve its checkpoint folder as is")
        if fmt not in self.exporters:
            raise ValueError(f"format {fmt!r}: a {self.name} draft exports to {list(self.formats)}")
        return self.exporters[fmt](draft_dir, out_dir, fmt=fmt, target_path=target_path, **options)

    def validate_export(self, path, target_path: Optional[str] = None) -> ExportResult:
        """Re-read an export of this kind and check it as its writer does; raises ValueError listing every problem."""
        if self.validator is None:
            raise ValueError(f"a {self.name} draft has no serving export to validate: its checkpoint folder is served "
                             "as is")
        return self.validator(path, target_path=target_path)

    def check_against_target(self, draft: torch.nn.Module, path, target_model: torch.nn.Module,
                             target_name: str = "the target", log=print) -> None:
        """A draft of this kind loaded from `path`, against the target it will run with: the vocabulary it scores
        (its adapter's check_target), then the kind's own checks (fits). Raises ValueError naming the folder, the
        problem and the target it was trained for."""
        from specdistill.drafts.readback import unfit

        try:
            self.adapter(draft).check_target(target_model, "a draft must share the target's tokenizer and output "
                                                           "layer size")
        except ValueError as e:
            raise unfit(path, target_name, str(e)) from None
        if self.fits is not None:
            self.fits(unwrap(draft), path, target_model, target_name, log)

    def holds(self, path, config: dict) -> Optional[str]:
        """What the folder `path` (its config.json read as `config`) is, in words, when it holds a draft of this kind
        (its checkpoint, its export); None otherwise. The catch-all kind holds none: its drafts are causal LMs."""
        if self.catch_all:
            return None
        if self.describe_folder is not None:
            return self.describe_folder(config)
        archs = list(config.get("architectures") or [])
        if self.adapter.saved_in(path) or set(archs) & set(self.export_architectures):
            return f"a {self.name} draft (architectures {archs})"
        return None


_KINDS: dict[str, DraftKind] = {}


def register_kind(**fields) -> Callable[[type[DraftAdapter]], type[DraftAdapter]]:
    """Class decorator: register the decorated adapter as the draft kind DraftKind(adapter=it, **fields) and give it
    that record as `spec`. A second kind of the same name, an init another kind builds, or a second catch-all kind
    is refused, naming the kind registered first."""
    def register(adapter: type[DraftAdapter]) -> type[DraftAdapter]:
        spec = DraftKind(adapter=adapter, **fields)
        if spec.name in _KINDS:
            raise ValueError(f"draft kind {spec.name!r} is registered already (by "
                             f"{_KINDS[spec.name].adapter.__qualname__}): give {adapter.__qualname__} another name")
        for other in _KINDS.values():
            shared = sorted(set(spec.inits) & set(other.inits))
            if shared:
                raise ValueError(f"draft kind {spec.name!r}: draft.init {shared} already builds the {other.name!r} "
                                 "kind: give it inits of its own")
            if spec.catch_all and other.catch_all:
                raise ValueError(f"draft kind {spec.name!r}: {other.name!r} is the catch-all kind already")
        adapter.spec = spec
        _KINDS[spec.name] = spec
        return adapter
    return register


def unregister_kind(name: str) -> None:
    """Remove a kind (a test's own kind, after the test)."""
    del _KINDS[name]


def registered() -> tuple[DraftKind, ...]:
    """Every registered kind, in the order lookups try them: the specific kinds as registered, the catch-all last."""
    return tuple(sorted(_KINDS.values(), key=lambda k: k.catch_all))


def kind_named(name: str) -> DraftKind:
    if name not in _KINDS:
        raise ValueError(f"unknown draft kind {name!r}; the registered kinds are {sorted(_KINDS)}")
    return _KINDS[name]


def known_inits() -> list[str]:
    return [init for kind in registered() for init in kind.inits]


def inits_honouring(size: str) -> list[str]:
    """The draft.init values whose drafts take the draft.<size> setting (one of SIZE_KEYS)."""
    return [init for kind in registered() for init, sizes in kind.inits.items() if size in sizes]


def kind_for_init(init: str) -> type[DraftAdapter]:
    """The adapter of the draft kind that `draft.init=<init>` builds; an unknown init is refused, naming them all."""
    for kind in registered():
        if init in kind.inits:
            return kind.adapter
    raise ValueError(f"unknown draft.init {init!r}; choose one of {' | '.join(known_inits())}")


def reads_draft_path(init: str) -> bool:
    """Whether `draft.init=<init>` reads draft.path (a pretrained draft, a warm-started head)."""
    return init in kind_for_init(init).spec.path_inits


def draft_adapter(model: torch.nn.Module) -> DraftAdapter:
    """The adapter for a built draft (bare or inside a DDP / accelerate wrapper)."""
    inner = unwrap(model)
    for kind in registered():
        if kind.adapter.matches(inner):
            return kind.adapter(model)
    raise TypeError(f"no draft kind handles a {type(inner).__name__}; the registered kinds are {sorted(_KINDS)}")


def saved_kind(path) -> type[DraftAdapter]:
    """The adapter of the draft kind saved in a draft folder written by training (checkpoint/draft)."""
    for kind in registered():
        if kind.adapter.saved_in(path):
            return kind.adapter
    raise ValueError(f"{path}: no draft kind reads this folder; the registered kinds are {sorted(_KINDS)}")


def draft_length(draft_cfg: DraftConfig, saved: Optional[Path] = None) -> Optional[DraftLength]:
    """The most tokens one proposal of the evaluated draft holds: the one saved in the folder `saved` (eval.draft_path)
    when given, by its kind, else the one draft_cfg builds; None when its kind has no bound, or no kind reads the
    folder (the draft loader names that folder)."""
    try:
        kind = (saved_kind(saved) if saved is not None else kind_for_init(draft_cfg.init)).spec
    except (OSError, ValueError):
        return None
    return kind.max_draft_length(draft_cfg, saved) if kind.max_draft_length is not None else None


def draft_in_folder(path) -> Optional[str]:
    """What the local folder `path` holds, in words, when a registered draft kind claims it (its checkpoint, its
    export; the first kind to claim it); None for any other folder, a hub id or an embedded model."""
    config_file = Path(str(path)).expanduser() / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return None  # no folder, or not one: the loader names it
    if not isinstance(config, dict):
        return None
    for kind in registered():
        what = kind.holds(config_file.parent, config)
        if what:
            return what
    return None


def load_trained_draft(path) -> torch.nn.Module:
    """A draft folder written by training, loaded by its kind's adapter (an EAGLE-3 head, a standalone HF LM)."""
    return saved_kind(path).load(path)


def check_readable(path) -> None:
    """Refuse, by name, a folder that no draft kind reads back (an EAGLE-3 head's speculators-format export), which
    would otherwise be opened as a plain causal LM and fail inside transformers."""
    for kind in registered():
        problem = kind.adapter.unreadable(path)
        if problem:
            raise ValueError(problem)


def export_formats() -> tuple[str, ...]:
    """Every serving format some registered kind writes (the export CLI's and the hub's choices)."""
    return tuple(dict.fromkeys(f for kind in registered() for f in kind.formats))


def exported_kind(path) -> DraftKind:
    """The kind that wrote the export in `path`, from its config.json's architectures."""
    try:
        archs = json.loads((Path(path).expanduser() / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: no readable config.json ({type(e).__name__}): not an export folder") from None
    for kind in registered():
        if set(archs) & set(kind.export_architectures):
            return kind
    known = {k.name: list(k.export_architectures) for k in registered() if k.export_architectures}
    raise ValueError(f"{path}: architectures {archs} is no export of a registered draft kind (exports by kind: "
                     f"{known})")
