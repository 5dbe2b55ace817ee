"""CPU settings for ModelOpt 0.47.0's EAGLE-3 path (nothing in ModelOpt is patched).

ModelOpt's HF-Trainer example script is not part of the wheel, so the runner drives modelopt.torch.speculative
directly: mtsp.convert(model, [("eagle", config)]) on the target loaded with transformers, then AdamW over the
eagle_module's parameters, fed by ModelOpt's own OfflineSupervisedDataset and EagleOfflineDataCollator.
What it sets, and why:
1. eagle_use_torch_compile=False: its default compiles the EAGLE forward with mode="max-autotune" (CUDA graphs).
2. eagle_offline=True: the features come from our store (its offline .pt dump format), the target's decoder layers are
   dropped by ModelOpt itself.
3. The architecture config takes the target's head_dim, heads, RoPE and eps (ModelOpt's defaults are Llama-3-8B's).
Its validator (HFARValidation.validate_online, run by peer_train.modelopt_validator_ars):
4. eagle_offline=False for the validator's model: validate_online runs the target's decoder layers, which offline
   conversion drops, so a second model is converted online and given the trained eagle_module's weights.
5. Prompts go in as CPU input_ids: its tokenize() and get_ground_truth() move tensors to torch.cuda.current_device(),
   and validate_online calls neither when input_ids are given.
6. A tokenizer without a chat template gets "": its __init__ calls tokenizer.chat_template.replace(...), and the
   template is never rendered when input_ids are given.
"""


def config_overrides() -> dict:
    return {"eagle_use_torch_compile": False, "eagle_offline": True}


def validation_overrides() -> dict:
    """The training config's changes for the validator's model (4, and 1 again)."""
    return {"eagle_use_torch_compile": False, "eagle_offline": False}


def validation_tokenizer(tokenizer):
    """The tokenizer HFARValidation's __init__ accepts (6)."""
    if tokenizer.chat_template is None:
        tokenizer.chat_template = ""
    return tokenizer
