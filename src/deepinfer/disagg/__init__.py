"""Prefill/decode disaggregation: a prefill server computes a prompt's blocks and keeps them in
its host tier; a decode server asks it to prefill each request, then takes the blocks over
torch.distributed point-to-point (``transfer.py``) through its KV tiers' remote source
(``remote_blocks.py``), so the prefix cache's hit path places them (docs: "Disaggregated
serving")."""
