"""``tacl_jax.flops``: its parts add up to the step's count, and the step-throughput bench takes
its MFU numerator from it (pure arithmetic: nothing compiles)."""

import os
import runpy
import types

import pytest

from tacl_jax.flops import encoder_flops_per_token, sequence_flops, step_flops
from tacl_jax.models import BertConfig

_BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "step_throughput.py")
CFG = BertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=256)


@pytest.mark.parametrize("gathered", [True, False])
@pytest.mark.parametrize("teacher", [True, False])
def test_step_is_the_batch_times_a_sequence_and_the_parts_add_up(gathered, teacher):
    kw = dict(length=32, predictions=5, teacher=teacher, gathered_last_layer=gathered)
    parts = sequence_flops(CFG, **kw)
    assert step_flops(CFG, batch=7, **kw) == 7 * parts["total"]
    assert parts["total"] == 3 * parts["student_forward"] + parts["teacher_forward"] + parts["tacl"]
    assert parts["layer_forward"] == encoder_flops_per_token(1, 64, 256, 32) * 32
    assert parts["teacher_forward"] == (3 * parts["layer_forward"] if teacher else 0)
    assert parts["mlm_head_forward"] == 2 * (64 * 64 + 64 * 1000) * 5
    if not gathered:
        assert parts["student_forward"] == 3 * parts["layer_forward"] + parts["mlm_head_forward"]


def test_anchors_count_the_scores_of_every_position():
    kw = dict(length=32, predictions=5, teacher=True)
    every = sequence_flops(CFG, anchors=32, **kw)
    assert every["tacl"] - sequence_flops(CFG, **kw)["tacl"] == 2 * 2 * 32 * 64 * (32 - 5)
    assert sequence_flops(CFG, anchors=32, length=32, predictions=5, teacher=False)["tacl"] == 0


def test_the_bench_counts_with_tacl_jax_flops():
    """The bench's FLOPs/token of its sizes, from ``tacl_jax.flops`` and the step's prediction
    slots: the values its MFU numbers were reported with (gathered; ``--full_flops``)."""
    bench = types.SimpleNamespace(**runpy.run_path(_BENCH))
    want = {"small": (30616488, 34411432), "base": (688671480, 720147192), "small_l512": (36065878, 41188438)}
    for size, (gathered, full) in want.items():
        fl = bench.model_flops_per_token(size)
        assert fl["total"] == gathered
        assert bench.model_flops_per_token(size, gathered_last_layer=False)["total"] == full
        sz = bench.SIZES[size]
        cfg = BertConfig(vocab_size=bench.VOCAB, hidden_size=sz["hidden"], num_hidden_layers=sz["layers"],
                         num_attention_heads=sz["heads"], intermediate_size=sz["intermediate"])
        p = fl["predictions_per_sequence"]
        assert p == round(0.15 * sz["seq"])
        assert fl["total"] * sz["batch"] * sz["seq"] == step_flops(
            cfg, batch=sz["batch"], length=sz["seq"], predictions=p, teacher=True, gathered_last_layer=True)
