"""The recall sweep follows Zoology's protocol: a short convolution in front of every attention-like mixer."""

from subquad.bench.recall import MIXERS, cell_model
from subquad.layers.conv import ShortConv


def test_every_fixed_state_mixer_of_the_sweep_has_a_short_convolution():
    for label, (pattern, options) in MIXERS.items():
        model = cell_model(pattern, options, vocab=32, d_model=32, T=16, mlp=False, seed=0)
        for block in model.blocks:
            mixer = block.mixer
            kind = type(mixer).__name__
            has_conv = any(isinstance(m, ShortConv) for m in mixer.modules())
            if kind == "SoftmaxAttention" or label.endswith("no conv)"):
                assert not has_conv, (label, kind)      # the deviation stated in bench/recall.py; the controls
            else:
                assert has_conv, (label, kind)
