"""Data, training, evaluation and diagnosis of the embedded demo models (run from a checkout, not installed).

The trained weights ship in :mod:`metainfer_gen.assets`; this folder is how they were made and how they are
checked: ``python -m demo_models.video.evaluate``, ``python -m demo_models.llm.evaluate``, ...
"""

from importlib import resources
from pathlib import Path

# Where the trained weights ship (the package's assets folder, in a checkout or an install).
ASSETS = Path(str(resources.files("metainfer_gen.assets")))
