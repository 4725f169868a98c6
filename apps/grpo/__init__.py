"""GRPO app: multi-digit addition as a verifiable task, trained with GRPO.

``task`` (problems, rewards, accuracy), ``tokenizer`` (the character-level tokenizer),
``episode`` (one sampled completion, and packing a batch of them for the engine).
"""
