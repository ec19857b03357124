"""Checkpoint reading: sharded safetensors, official names, fp8/fp4 block dequantization."""
