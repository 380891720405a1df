"""Small transformers configs the planner tests plan (written locally, no hub access)."""
import json

import pytest

TINY = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, vocab_size=256)


@pytest.fixture
def tiny_config(tmp_path):
    path = tmp_path / "tiny-llama.json"
    path.write_text(json.dumps(TINY))
    return str(path)
