"""Token sampling from logits."""
