"""MoE expert-selective distillation: routing profiles of HF MoE targets, drafts built from their most used experts,
expert-level distillation targets (objectives/moe_kd.py), and a real-weight upcycled MoE for tests and benchmarks."""
