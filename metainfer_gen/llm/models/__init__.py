"""Engine model implementations, loaded from Hugging Face checkpoints."""
