"""`klotski-sim advise`: where a llama.cpp or KTransformers user should put a MoE model's experts
on their GPU and CPU, and what prompt and generation speed each placement gives (docs/advise.md)."""
