"""Model state on disk: hal's own checkpoints (save, resume into any plan, checks), the parent-side checks of
a Hugging Face checkpoint before a run starts, and ``hal export --to hf``."""
