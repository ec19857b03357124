"""Building blocks shared by the model files: norms, RoPE, mHC, attention, compressor, MoE."""
