"""Model building blocks for the engine: MLA attention, MoE, norms."""
