"""Training EAGLE-1 heads: data -> target features -> head -> SafeAILab-layout checkpoint.

tokenize.py  conversations -> token ids + assistant-only loss mask
features.py  the target's last hidden states (what the plugin feeds the draft), cached
head.py      the EAGLE-1 head in plain torch (same math as vLLM's EagleLlama layer)
trainer.py   loss, noise, optimiser, resumable loop, checkpoint export, curves
regenerate.py  optional: target-written answers through vLLM
"""
