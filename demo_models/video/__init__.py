"""The embedded default model: procedural data, reproducible training and adherence evaluation."""
