"""plan_inference(): TTFT, TPOT and the KV-cache capacity of a tensor-parallel decoder."""
import pytest

from torchneuron.planner import plan_inference

from tests.planner.conftest import TINY


def test_inference_plan_figures_and_kv_capacity_arithmetic():
    report = plan_inference(dict(TINY), tp=2, batch=4, context=256)
    d, heads, layers = TINY["hidden_size"], TINY["num_attention_heads"], TINY["num_hidden_layers"]
    # K and V, every layer, this core's heads (4 KV heads over tp=2), bf16
    assert report.kv_bytes_per_token == 2 * layers * (TINY["num_key_value_heads"] / 2) * (d // heads) * 2
    usable = report.hbm_bytes * 0.9 - report.weight_bytes
    assert report.kv_capacity_tokens <= usable // report.kv_bytes_per_token
    assert report.kv_capacity_tokens > 0.99 * usable // report.kv_bytes_per_token
    assert report.ttft_s > report.tpot_s > 0
    text = str(report)
    assert "TTFT" in text and "TPOT" in text and "capacity" in text


def test_prefill_grows_with_context():
    short = plan_inference(dict(TINY), tp=1, batch=2, context=128)
    long = plan_inference(dict(TINY), tp=1, batch=2, context=2048)
    assert long.ttft_s > short.ttft_s
