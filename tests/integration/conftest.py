"""Fixtures of the integration tests that run the engine in this process."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def loaded():
    """The default model (SmolLM2-135M-Instruct, GGUF) and its tokenizer, loaded for real,
    once per test module: `(LoadedModel, Tokenizer)`; see default_engine.make_engine."""
    from engine.engine_builder import load_tokenizer
    from engine.loader import load_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the suite shares two cores; one thread is faster under load
    model = load_model("default")
    yield model, load_tokenizer(model.tokenizer_source)
    torch.set_num_threads(threads)
