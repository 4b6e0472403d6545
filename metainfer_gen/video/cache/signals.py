"""What the step cache's cheap per-step signal is measured on (``StepCacheConfig.signal``, a calibration's
``signal``): ``"input"``, the relative change of the timestep-modulated input of the first block; ``"first_block"``,
the relative change of the first block's residual (one block computed per step)."""

SIGNALS = ("input", "first_block")
