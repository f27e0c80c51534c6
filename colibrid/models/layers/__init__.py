"""Building blocks shared by the model families (norms, RoPE, attention, router, MoE)."""
