"""CPU settings for ModelOpt 0.47.0's EAGLE-3 path (nothing in ModelOpt is patched).

ModelOpt's HF-Trainer example script is not part of the wheel, so the runner drives modelopt.torch.speculative
directly: mtsp.convert(model, [("eagle", config)]) on the target loaded with transformers, then AdamW over the
eagle_module's parameters, fed by ModelOpt's own OfflineSupervisedDataset and EagleOfflineDataCollator.
What it sets, and why:
1. eagle_use_torch_compile=False: its default compiles the EAGLE forward with mode="max-autotune" (CUDA graphs).
2. eagle_offline=True: the features come from our store (its offline .pt dump format), the target's decoder layers are
   dropped by ModelOpt itself.
3. The architecture config takes the target's head_dim, heads, RoPE and eps (ModelOpt's defaults are Llama-3-8B's).
"""


def config_overrides() -> dict:
    return {"eagle_use_torch_compile": False, "eagle_offline": True}
