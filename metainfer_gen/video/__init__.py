"""Video front end: diffusers pipelines, step-cache reuse, LoRA, export and quality metrics."""
