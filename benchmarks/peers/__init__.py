"""The peers benchmark: the same EAGLE-3 head trained by specdistill, speculators, SpecForge and ModelOpt on the same
regenerated store, each converted to the vLLM midlayer format with the target's embeddings and scored by
specdistill's decoder (docs/peers.md)."""
