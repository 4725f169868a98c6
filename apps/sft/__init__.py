"""SFT app: a short supervised warm-start on the embedded task, written as an HF checkpoint
(config.json + safetensors + tokenizer) that the GRPO app then loads like any user checkpoint.
"""
