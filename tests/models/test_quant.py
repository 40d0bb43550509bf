"""Quantised weights (models.quant): what is quantised and what stays float, the int8 and int4 products against
the dequantised weight, int4's packing against torch's own, models that stay close to float32, compiled
decoding with int8 and int4, quantised folders saved and loaded back, and the refusals."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from subquad.kernels import qgemv
from subquad.layers.linear import Linear
from subquad.models import (
    LanguageModel,
    ModelConfig,
    from_pretrained,
    quant,
    save_pretrained,
)
from subquad.models.decode import compile_decode
from subquad.models.quant import (
    DECODE_ROWS,
    INT4_ROWS,
    Bf16Linear,
    Int4Linear,
    Int8Linear,
    quantize,
)
from tests.kernels.test_qgemv import q8_rows


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def test_int8_weights_per_output_channel():
    w = torch.randn(40, 24, dtype=torch.float64) * torch.logspace(-3, 1, 40, dtype=torch.float64)[:, None]
    lin = Int8Linear(w)
    assert lin.q.dtype == torch.int8 and lin.q.abs().max() == 127 and lin.scale.dtype == torch.float32
    torch.testing.assert_close(lin.scale.double(), w.abs().amax(1) / 127, rtol=1e-6, atol=0)
    # each weight is within half a step of its channel's grid: per-channel, so small rows keep their precision
    assert ((lin.weight.double() - w).abs() <= lin.scale.double()[:, None] * 0.5 + 1e-12).all()


@pytest.mark.parametrize("rows", [1, 5, DECODE_ROWS, DECODE_ROWS + 1, 40])
def test_int8_product_against_the_dequantised_weight(rows):
    """Prefill rows (> DECODE_ROWS) multiply by the dequantised weight exactly; decoding rows take fbgemm's
    int8 kernel, whose 7-bit activations add at most ~1% of the output's scale (where fbgemm is gone, the C
    kernel's few rows are exact: x kept float32) - where the CPU has no packed int8 kernel; with one (AMX, VNNI)
    every row is rounded to 8 bits with a scale of its own, within ~1% too."""
    torch.manual_seed(0)
    w, b = torch.randn(300, 96), torch.randn(300)
    lin = Int8Linear(w, b)
    x = torch.randn(rows, 96)
    ref = x.double() @ lin.weight.double().T + b.double()
    got = lin(x)
    assert got.dtype == torch.float32 and got.shape == (rows, 300)
    exact = not qgemv.packed_int8() and (rows > DECODE_ROWS or (not quant.FBGEMM and qgemv.usable(qgemv.INT8, x,
                                                                                                     qgemv.INT8_ROWS)))
    assert _rel(got.double(), ref) <= (1e-6 if exact else 2e-2)
    assert _rel(lin(x.view(rows, 1, 96)).view(rows, 300), got) == 0       # any leading shape


def test_int8_decoding_takes_the_kernel_at_any_batch(monkeypatch):
    """A decoding step or a verification of more than DECODE_ROWS rows multiplies with fbgemm's kernel,
    DECODE_ROWS rows per call, or with AMX tiles where the CPU has them (``quant.decoding``), not with a float
    copy of each matrix: its logits are those of the same rows stepped in blocks of DECODE_ROWS, and near the
    float model's; a prompt of as many rows keeps the exact product, or takes the packed weights (AMX tiles or
    VNNI's vectors) where the CPU has them."""
    from subquad.kernels import qgemv
    from subquad.models.speculative import verify

    model = _model("mamba,softmax")
    q = quantize(copy.deepcopy(model), "int8", min_weights=0)
    kernel, packed, tiles = [], quant._packed, qgemv.amx_packed
    monkeypatch.setattr(quant, "_packed", lambda *a: kernel.append(1) or packed(*a))
    monkeypatch.setattr(qgemv, "amx_packed", lambda *a: kernel.append(1) or tiles(*a))
    B = 2 * DECODE_ROWS + 5
    ids = torch.randint(0, 200, (B, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        _, state = q.prefill(ids[:, :4])
        assert bool(kernel) == bool(qgemv.packed_int8())            # the prompts: exact, or the packed weights
        kernel.clear()
        got, _ = q.step(ids[:, 4], state)
        assert kernel
        blocks = [q.step(ids[i:i + DECODE_ROWS, 4], q.prefill(ids[i:i + DECODE_ROWS, :4])[1])[0]
                  for i in range(0, B, DECODE_ROWS)]
        torch.testing.assert_close(got, torch.cat(blocks), rtol=1e-4, atol=1e-5)
        assert _rel(got, model.step(ids[:, 4], model.prefill(ids[:, :4])[1])[0]) <= 0.06
        kernel.clear()
        logits, _ = verify(q, ids[:, 4:6], state)
        assert kernel and _rel(logits[:, 0], got) <= 2e-2          # its blocks of 16 rows: other scales


@pytest.mark.parametrize("pattern,mlp", [("mamba,softmax", True), ("mamba", False)])
def test_an_int8_rows_logits_do_not_depend_on_the_rows_beside_it(pattern, mlp):
    """Where the CPU has the packed int8 kernel (AMX tiles or AVX-512 VNNI: ``qgemv.packed_int8``) every row count
    takes it - one rounding per row and exact integer sums - so a row stepped alone, beside one other row or beside
    two has the same logits bit for bit (the modules' products, and a Mamba block's one C call: ``mlp=False``), and
    a verification of 3 tokens gives the logits of 3 steps to float rounding (the served batch, ``n`` and speculation
    once took 1-2 rows per block of 32 and more per row: 0.2 of the logits' scale apart). Without it the rows round
    as they are grouped: within int8's error."""
    from subquad.kernels import qgemv
    from subquad.models.speculative import verify

    q = quantize(copy.deepcopy(_model(pattern, mlp=mlp)), "int8", min_weights=0)
    ids = torch.randint(0, 200, (3, 8), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        _, state = q.prefill(ids[:, :5])
        rows = [q.step(ids[:n, 5], q.prefill(ids[:n, :5])[1])[0] for n in (1, 2, 3)]
        steps, s = [], q.prefill(ids[:1, :5])[1]
        for t in range(5, 8):
            logits, s = q.step(ids[:1, t], s)
            steps.append(logits)
        verified, _ = verify(q, ids[:1, 5:8], q.prefill(ids[:1, :5])[1])
    if qgemv.packed_int8():
        assert torch.equal(rows[0][0], rows[1][0]) and torch.equal(rows[0][0], rows[2][0])
        assert torch.equal(rows[1][1], rows[2][1])
        torch.testing.assert_close(verified[0], torch.cat(steps), rtol=1e-4, atol=1e-4)
    else:
        assert _rel(rows[2][0], rows[0][0]) <= 0.06 and _rel(verified[0], torch.cat(steps)) <= 0.06


def test_the_custom_op_checks_out():
    """The op's fake (meta) implementation and its real one agree (torch.library's own check)."""
    lin = Int8Linear(torch.randn(8, 16))
    torch.library.opcheck(torch.ops.subquad.int8_linear.default, (torch.randn(2, 16), lin.q, lin.scale, None, lin.key),
                          test_utils=("test_schema", "test_faketensor"))
    blocked = Int8Linear.from_blocks(lin.q, torch.rand(8, 2) + 0.1, torch.randn(8, 2), torch.randn(8))
    for rows in (2, 40):                                        # the C kernel's rows and the dequantising path's
        torch.library.opcheck(torch.ops.subquad.int8_block_linear.default,
                              (torch.randn(rows, 16), blocked.q, blocked.scale, blocked.offset, blocked.bias),
                              test_utils=("test_schema", "test_faketensor"))
        x = torch.randn(rows, 16)
        ref = x.double() @ blocked.weight.double().T + blocked.bias.double()
        assert _rel(blocked(x).double(), ref) <= 1e-6


def _model(pattern="mamba,softmax", **over):
    torch.manual_seed(0)
    cfg = ModelConfig(**{"vocab_size": 200, "d_model": 64, "n_layers": len(pattern.split(",")), "n_heads": 4,
                         "pattern": pattern, **over})
    return LanguageModel(cfg).eval()


def test_what_is_quantised_and_what_stays_float():
    model = _model("mamba,mamba2,softmax", moe={"experts": 4, "top_k": 2, "every": 2, "offset": 1})
    q = quantize(copy.deepcopy(model), "int8", min_weights=0)
    assert not any(isinstance(m, nn.Linear) for m in q.modules())
    assert isinstance(q.head, Int8Linear) and q.embed.weight.dtype == torch.float32          # tied: own head
    moe = q.blocks[1].mlp
    assert len(moe.quantized_experts["w_gate"]) == 4 and isinstance(moe.quantized_experts["w_down"][3], Int8Linear)
    kept = {n for n, p in q.named_parameters()}
    for name in ("blocks.0.mixer.A_log", "blocks.0.mixer.D", "blocks.0.mixer.conv.weight", "blocks.1.mixer.dt_bias",
                 "blocks.1.mixer.norm.weight", "blocks.0.norm1.weight", "norm.weight", "embed.weight"):
        assert name in kept and q.get_parameter(name).dtype == torch.float32, name
    assert not any(p.requires_grad for p in q.parameters())
    small = quantize(copy.deepcopy(model), "int8")            # the default keeps matrices under MIN_WEIGHTS float
    assert isinstance(small.blocks[0].mixer.in_proj, nn.Linear) and isinstance(small.head, Int8Linear)
    state = q.empty_state(2)
    assert all(t.dtype == torch.float32 for s in state for t in s.values() if isinstance(t, torch.Tensor))
    assert all(isinstance(m, Bf16Linear) for m in quantize(copy.deepcopy(model), "bf16", min_weights=0).modules()
               if type(m).__name__.endswith("Linear"))


@pytest.mark.parametrize("kind,tol", [("int8", 3e-2), ("bf16", 1e-2)])
@pytest.mark.parametrize("pattern", ["mamba,softmax", "mamba2,gated_deltanet", "mla,retention"])
def test_quantised_models_stay_close_to_float(kind, tol, pattern):
    """Logits of a prefill and of token-by-token decoding within a few % of the float model's. On a CPU without
    VNNI fbgemm's activations keep 7 bits, not 8 (``quant.REDUCE_RANGE``: its 16-bit pair sums would saturate),
    so their quantisation step - and the int8 tolerance - doubles there (measured on such a host, an AMD EPYC
    with AVX2 only: mamba2,gated_deltanet decodes 4.9% off; 8 bits elsewhere keep it under 3%). With AMX tiles a
    prompt's rows are rounded to 8 bits too, each with a scale of its own (``quant.int8_linear``), where the
    product is exact elsewhere: the prefill's error roughly doubles (Sapphire Rapids: 1.1, 3.4 and 0.7% for the
    three patterns against 0.3, 1.8 and 0.4% with exact prompts), so its tolerance is 4% there - and with VNNI's
    vectors, which take a prompt's rows the same way (Zen 4: 1.1, 3.4 and 0.7% too)."""
    if kind == "int8" and quant.REDUCE_RANGE:
        tol *= 2
    if kind == "int8" and qgemv.packed_int8():
        tol = max(tol, 4e-2)
    model = _model(pattern, moe={"experts": 4, "top_k": 2, "every": 2, "offset": 1})
    q = quantize(copy.deepcopy(model), kind, min_weights=0)
    ids = torch.randint(0, 200, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids)
        assert _rel(q(ids), ref) <= tol
        logits, state = q.prefill(ids[:, :12])
        steps = [logits]
        for t in range(12, 24):
            lt, state = q.step(ids[:, t], state)
            steps.append(lt[:, None])
    assert _rel(torch.cat(steps, 1), ref) <= tol


@pytest.mark.parametrize("kind", ["int8", "int4", "bf16"])
def test_a_model_made_and_quantised_under_inference_mode_decodes_as_one_made_outside(kind):
    """Tensors made under ``torch.inference_mode`` keep no version counter (``_version`` raises): the kept calls'
    and the packed weights' checks (``kernels.version``) must not ask it. Two rows of a hybrid, its decoding
    steps' logits equal to the same model's made and quantised outside the mode."""
    ids = torch.randint(0, 200, (2, 9), generator=torch.Generator().manual_seed(2))

    def run():
        q = quantize(_model("mamba2,softmax,mamba"), kind, min_weights=0, group_size=32)
        logits, state = q.prefill(ids[:, :5])
        out = [logits[:, -1]]
        for t in range(5, 9):
            lt, state = q.step(ids[:, t], state)
            out.append(lt)
        return torch.stack(out)

    with torch.no_grad():
        ref = run()
    with torch.inference_mode():
        got = run()
        assert next(quantize(_model(), kind, min_weights=0, group_size=32).buffers()).is_inference()
    torch.testing.assert_close(got, ref, rtol=0, atol=0)


def test_compiled_quantised_decoding_equals_eager():
    """The int8 and int4 products are custom ops, so the compiled step keeps fbgemm's and torch's int4 kernels
    and gives the same logits. One model holds both (int8 in the mixers, int4 in the MLPs and the head): one
    compile, which costs most of this test. Eagerly the blocks' norms run in C, compiled in inductor's graph:
    float32's rounding apart, which can move one input of a product across a rounding boundary of the int8 codes
    x is rounded to - one code step of one input, ~1e-3 of the logits (seen at one of the 16 steps on Zen 4) -
    so at most two steps may differ that much; the rest agree to float32's rounding."""
    q = quantize(_model("mamba,softmax", mlp_size=128), "int8", min_weights=0)
    for block in q.blocks:
        for name in ("w_gate", "w_up", "w_down"):
            setattr(block.mlp, name, Int4Linear(getattr(block.mlp, name).weight, None, 32))
    q.head = Int4Linear(q.head.weight, None, 32)
    fast = compile_decode(copy.deepcopy(q))
    ids = torch.randint(0, 200, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, state = q.prefill(ids)
        s1 = s2 = state
        tok = ids[:, -1]
        rels = []
        for _ in range(16):
            a, s1 = q.step(tok, s1)
            b, s2 = fast.step(tok, s2)
            rels.append(float(_rel(b, a)))
            tok = a.argmax(-1)
    assert max(rels) <= 5e-3 and sum(r > 1e-5 for r in rels) <= 2, rels


@pytest.mark.parametrize("kind", [None, "int8"])
def test_weights_loaded_in_place_under_inference_mode_are_read_afresh(kind):
    """An inference tensor has no version counter: a ``load_state_dict`` into a model made under
    ``torch.inference_mode`` kept the copies kernels had made of its old weights (int8's AMX tiles and fbgemm's
    packing, Mamba's column-major dt_proj) and the kept calls holding them - logits of the old weights (off by
    their own size, a new user's trial on the Intel host). Now the model decodes as one built with the new weights,
    at one row and at 8 (fbgemm's rows), after caches were made at both."""
    def build(seed):
        torch.manual_seed(seed)
        m = LanguageModel(ModelConfig(vocab_size=200, d_model=64, n_layers=2, n_heads=4, pattern="mamba,softmax"))
        return m.eval() if kind is None else quantize(m.eval(), kind, min_weights=0)

    ids = torch.randint(0, 200, (8, 7), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        a, b = build(1), build(2)
        for rows in (1, 8):                                    # a's copies and kept calls made at both
            a.step(ids[:rows, -1], a.prefill(ids[:rows])[1])
        a.load_state_dict(b.state_dict())
        for rows in (1, 8):
            state = b.prefill(ids[:rows])[1]
            want = b.step(ids[:rows, -1], state)[0]
            for _ in range(2):                                 # and again: kept calls made from the new weights
                got = a.step(ids[:rows, -1], a.prefill(ids[:rows])[1])[0]
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
        if kind is None:                                        # the copy the Mamba block kernel reads
            from subquad.layers.mamba import dt_columns

            layer = a.blocks[0].mixer
            assert torch.equal(dt_columns(layer, layer.dt_proj.weight), b.blocks[0].mixer.dt_proj.weight)


@pytest.mark.parametrize("cls", ["Bf16Linear", "F16Linear"])
def test_bf16_and_f16_linears_compile_without_a_graph_break(cls):
    """Inside a graph the 16-bit linears look at nothing of their C path (``_direct`` first): asking whether the CPU
    has the kernel broke the graph there, and on an AVX512-BF16 host inductor then miscompiled the piece after it
    in a Mamba-2 model (every logit NaN under ``--quantize bf16 --compile-decode``). fullgraph refuses a break;
    the graph's product is the 16-bit weights' (bfloat16: y rounded to bfloat16)."""
    lin = getattr(quant, cls)(torch.randn(48, 64, generator=torch.Generator().manual_seed(0)))
    x = torch.randn(1, 1, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        y = torch.compile(lin, fullgraph=True)(x)
    want = x.double() @ lin.w.double().T
    tol = 2 ** -8 if cls == "Bf16Linear" else 1e-6
    torch.testing.assert_close(y.double(), want, rtol=tol, atol=tol * want.abs().max().item())


# ---- int4 ----

def test_int4_weights_per_group():
    """Codes in [0, 15]; each weight within half a step of its group's grid (plus bfloat16's rounding of the
    zero); groups of very different scale each keep their own precision; a constant group keeps its value."""
    w = torch.randn(48, 256, dtype=torch.float64) * torch.logspace(-3, 1, 8, dtype=torch.float64).repeat(32)[None]
    w[5, :128] = 0.75                                                         # a constant group
    for g in (32, 128):
        codes, scale, zero = quant.int4_quantize(w, g)
        assert codes.dtype == torch.uint8 and codes.max() <= 15 and scale.dtype == zero.dtype == torch.bfloat16
        W = quant.int4_dequantize(codes, scale, zero, torch.float64)
        err = (W - w).view(48, 256 // g, g).abs()
        step = scale.double()[..., None]
        assert (err <= step / 2 + zero.double().abs()[..., None] * 2 ** -8 + 1e-30).all()
        # the half step is 1/30 of the group's range (4 bits, asymmetric)
        rng = (w.view(48, -1, g).amax(-1) - w.view(48, -1, g).amin(-1))[..., None]
        assert (err <= rng / 30 * 1.02 + zero.double().abs()[..., None] * 2 ** -8).all()
        assert (W[5, :128] - 0.75).abs().max() <= 0.75 * 2 ** -8


@pytest.mark.skipif(not quant._layout(), reason="this torch has no CPU int4 kernel: products dequantise")
@pytest.mark.parametrize("N", [16, 48, 112, 160, 304])
def test_int4_packing_equals_torchs_own(N):
    """kernel_pack writes what aten._convert_weight_to_int4pack_for_cpu writes (whole blocks and a short last
    one), and kernel_unpack reads it back."""
    codes = torch.randint(0, 16, (N, 96), generator=torch.Generator().manual_seed(N), dtype=torch.uint8)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.int(), 1)
    assert torch.equal(quant.kernel_pack(codes, quant._layout()), packed)
    assert torch.equal(quant.kernel_unpack(packed, quant._layout()), codes)


@pytest.mark.parametrize("g", [32, 128])
@pytest.mark.parametrize("rows", [1, 3, qgemv.INT4_ROWS + 1, INT4_ROWS, INT4_ROWS + 1])
def test_int4_product_against_the_dequantised_weight(g, rows):
    """An odd output width (300: not a multiple of 16, the kernel pads it), a bias, batch > 1. Up to
    qgemv.int4_rows() float32 rows (any with AVX-512 VNNI, else 16) take the C kernel (kernels/qgemv.c: x rounded
    to int8 per block of 32, then float32's rounding of the sums only: against x~ times the dequantised
    weights); more decoding rows (<= INT4_ROWS) torch's int4 kernel, which rounds x to bfloat16 and y to
    bfloat16: within 2^-8 of |y| plus float32's rounding of the sum against float64 over the dequantised weights;
    prefill rows (and a CPU without the kernel) multiply by the dequantised weights in float32: float32's
    rounding only."""
    torch.manual_seed(0)
    K = 3 * g
    w, b = torch.randn(300, K), torch.randn(300)
    lin = Int4Linear(w, b, g)
    x = torch.randn(rows, K)
    W = quant.int4_dequantize(lin.codes(), lin.scale, lin.zero, torch.float64)
    got = lin(x)
    assert got.dtype == torch.float32 and got.shape == (rows, 300)
    sums = 1e-6 * (x.double().abs() @ W.abs().T)                              # float32's rounding of the sums
    if quant._layout() and qgemv.usable(qgemv.INT4, x, qgemv.int4_rows()):
        c, d = q8_rows(x)
        xr = (c.view(rows, -1, 32) * d[..., None]).view(rows, K)
        ref = xr @ W.T + b.double()
        assert ((got.double() - ref).abs() <= 1e-6 * (xr.abs() @ W.abs().T) + 1e-6).all()
    elif quant._layout() and rows <= INT4_ROWS:
        ref = x.bfloat16().double() @ W.T
        assert ((got.double() - b.double() - ref).abs() <= ref.abs() * 2 ** -8 + sums).all()      # u = 2^-8
    else:
        ref = x.double() @ W.T + b.double()
        assert ((got.double() - ref).abs() <= sums + 1e-6).all()
    assert torch.equal(lin(x.view(rows, 1, K)).view(rows, 300), got)                      # any leading shape


def test_int4_without_the_kernel_and_across_layouts(monkeypatch):
    """Where torch has no int4 kernel (layout 0) the codes stay in pair_k's layout and every product dequantises:
    the dequantised reference within float32's rounding. A state dict moves between the two layouts (a folder
    saved on a CPU without the kernel, loaded on one with it, and back) with the same codes, scales and zeros."""
    torch.manual_seed(0)
    w, b = torch.randn(40, 64), torch.randn(40)
    packed = Int4Linear(torch.randn(40, 64), torch.randn(40), 32)            # this CPU's layout, other weights
    monkeypatch.setattr(quant, "_layout", lambda: 0)
    plain = Int4Linear(w, b, 32)
    assert plain.layout == 0 and plain.w.shape == (40, 32) and "dequantising" in repr(plain)
    x = torch.randn(3, 64)
    W = quant.int4_dequantize(plain.codes(), plain.scale, plain.zero, torch.float64)
    ref = x.double() @ W.T + b.double()
    assert ((plain(x).double() - ref).abs() <= 1e-6 * (x.double().abs() @ W.abs().T) + 1e-6).all()
    packed.load_state_dict(plain.state_dict())
    back = Int4Linear.empty(40, 64, True, 32)
    back.load_state_dict(packed.state_dict())
    for sd in (packed.state_dict(), back.state_dict()):
        assert all(torch.equal(sd[k], v) for k, v in plain.state_dict().items())
    assert torch.equal(back(x), plain(x))

def test_int4_custom_op_checks_out():
    lin = Int4Linear(torch.randn(20, 64), torch.randn(20), 32)
    torch.library.opcheck(torch.ops.subquad.int4_linear.default,
                          (torch.randn(2, 64), lin.w, lin.scale_zero, lin.bias, 20, lin.layout),
                          test_utils=("test_schema", "test_faketensor"))


def test_int4_what_stays_float(tmp_path):
    """Beyond what int8 keeps: routers, the shared expert's gate, Mamba's x_proj and dt_proj, the delta rule's
    beta and decay projections; a matrix whose input width the group size does not divide takes 8 bits per
    output channel (experts: stay float32), named in a warning - and its folder loads back as it was saved."""
    model = _model("mamba,gated_deltanet,kda", moe={"experts": 4, "top_k": 2, "every": 2, "offset": 1, "shared": 32},
                   mlp_size=80)
    with pytest.warns(UserWarning) as said:
        q = quantize(copy.deepcopy(model), "int4", min_weights=0, group_size=32)
    said = [str(w.message) for w in said]
    assert any(m.startswith("int4 with group_size=32: 3 matrices") and "8 bits per output channel" in m
               and "blocks.0.mlp.w_down" in m for m in said)
    assert any("stay float32 (experts): blocks.1.mlp.w_down" in m for m in said)
    assert q.quantized == "int4" and isinstance(q.head, Int4Linear) and q.head.group_size == 32
    for name in ("blocks.0.mixer.x_proj", "blocks.0.mixer.dt_proj", "blocks.1.mixer.a_proj", "blocks.1.mixer.b_proj",
                 "blocks.2.mixer.b_proj", "blocks.2.mixer.f_a_proj", "blocks.1.mlp.router", "blocks.1.mlp.shared_gate"):
        assert type(q.get_submodule(name)) in (nn.Linear, Linear), name      # float: not quantised
    for name in ("blocks.0.mlp.w_down", "blocks.2.mlp.w_down", "blocks.2.mixer.g_b_proj"):   # 80 and 16 inputs
        assert type(q.get_submodule(name)) is Int8Linear, name
    for name in ("blocks.0.mixer.in_proj", "blocks.1.mixer.q_proj", "blocks.2.mixer.o_proj", "blocks.0.mlp.w_up"):
        assert isinstance(q.get_submodule(name), Int4Linear), name
    assert "blocks.1.mlp.quantized_experts" not in dict(q.named_modules())   # experts' w_down: 80 inputs too
    x = torch.randn(3, 80)                                                    # the int8 one: 8 bits of the float's
    w_down = model.get_submodule("blocks.0.mlp.w_down")
    assert _rel(q.get_submodule("blocks.0.mlp.w_down")(x), w_down(x)) < 0.02
    q.save_pretrained(tmp_path / "q")
    back, _ = from_pretrained(tmp_path / "q")
    assert type(back.get_submodule("blocks.0.mlp.w_down")) is Int8Linear
    a, b = q.state_dict(), back.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ids = torch.randint(0, 200, (2, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(back(ids), q(ids))


@pytest.mark.parametrize("pattern", ["mamba,softmax", "mamba2,gated_deltanet", "mla,retention"])
def test_int4_models_stay_close_to_float(pattern):
    """Logits of a prefill and of token-by-token decoding within 30% of the float model's scale: 4 bits, groups of
    32, every projection quantised, random weights (measured 3.7%, 24% and 7% for the three patterns - ~10x int8's
    0.3%, 2.7% and 1.2% on the same models: 15 steps per group's range against 254 per row's)."""
    model = _model(pattern, moe={"experts": 4, "top_k": 2, "every": 2, "offset": 1}, mlp_size=128)
    q = quantize(copy.deepcopy(model), "int4", min_weights=0, group_size=32)
    assert isinstance(q.blocks[1].mlp.quantized_experts["w_up"][0], Int4Linear)
    ids = torch.randint(0, 200, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids)
        assert _rel(q(ids), ref) <= 0.3
        logits, state = q.prefill(ids[:, :12])
        steps = [logits]
        for t in range(12, 24):
            lt, state = q.step(ids[:, t], state)
            steps.append(lt[:, None])
    assert _rel(torch.cat(steps, 1), ref) <= 0.3

@pytest.mark.parametrize("kind", ["int8", "int4", "bf16"])
def test_a_quantised_folder_loads_as_it_was_saved(tmp_path, kind):
    """save_pretrained of a quantised model, then from_pretrained of its folder: the same quantised weights and
    scales bit for bit (int4's saved in a CPU-independent layout, packed again on loading), the same logits
    and the same greedy tokens; experts, a tied head and float matrices (the router) included."""
    model = _model("mamba,softmax", moe={"experts": 4, "top_k": 2, "every": 2, "offset": 1}, mlp_size=128)
    q = quantize(model, kind, min_weights=0, group_size=32)
    q.save_pretrained(tmp_path / "q")
    back, _ = from_pretrained(tmp_path / "q")
    assert back.quantized == kind and type(back.head) is type(q.head)
    assert type(back.blocks[1].mlp.quantized_experts["w_down"][3]) is type(q.head)
    a, b = q.state_dict(), back.state_dict()
    assert a.keys() == b.keys() and any(k.endswith(".w" if kind == "bf16" else ".q") for k in a)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    ids = torch.randint(0, 200, (2, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(back(ids), q(ids))
    assert back.generate(ids[0].tolist(), 12, temperature=0)[0] == q.generate(ids[0].tolist(), 12, temperature=0)[0]
    other = "int4" if kind == "int8" else "int8"
    with pytest.raises(ValueError, match=f"quantised to {kind}: it loads as it is .*got quantize='{other}'$"):
        from_pretrained(tmp_path / "q", quantize=other)           # what was asked, and nothing that was not
    with pytest.raises(ValueError, match="got dtype=torch.bfloat16$"):
        from_pretrained(tmp_path / "q", dtype=torch.bfloat16)


def test_loading_a_quantised_folder_makes_no_float_weight(tmp_path):
    """Loading an int4 folder streams it into the quantised modules: no float32 tensor of a quantised matrix's
    shape is ever made (every op's outputs watched; the model's skeleton lives on the meta device)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    model = _model("mamba2,softmax", mlp_size=160, d_model=96, vocab_size=224)
    q = quantize(model, "int4", min_weights=0, group_size=32)
    shapes = {(m.out_features, m.in_features) for m in q.modules() if isinstance(m, Int4Linear)}
    shapes.discard(tuple(q.embed.weight.shape))              # the tied head: the embedding itself stays float32
    q.save_pretrained(tmp_path / "q")
    seen = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor) and not t.is_meta and t.is_floating_point() and t.dim() == 2 and \
                        (tuple(t.shape) in shapes or tuple(t.shape[::-1]) in shapes):
                    seen.append((func, tuple(t.shape)))
            return out

    with Watch():
        back, _ = from_pretrained(tmp_path / "q")
    assert len(shapes) >= 4 and not seen, seen
    with torch.no_grad():
        ids = torch.randint(0, 224, (1, 6), generator=torch.Generator().manual_seed(4))
        assert torch.equal(back(ids), q(ids))


def test_quantising_a_float_folder_hands_the_float_pages_back(tmp_path, monkeypatch):
    """from_pretrained(quantize=...) of a float folder frees the float matrices it quantised and hands their pages
    back (``heap.release_freed``), once the float weights are gone: a server's resident memory is not left at the
    float size (302 -> 62 MB for a 61 MB int8 model; benchmarks/RESULTS.md)."""
    import subquad.models.hf.loader as loader

    _model("mamba2").save_pretrained(tmp_path / "f")
    calls = []
    monkeypatch.setattr(loader, "release_freed", lambda: calls.append("trim"))
    from_pretrained(tmp_path / "f")
    assert calls == []
    from_pretrained(tmp_path / "f", quantize="int8")
    assert calls == ["trim"]


def test_refusals_name_the_problem(tmp_path):
    model = _model()
    with pytest.raises(ValueError, match="quantize must be one of int8, int4, bf16"):
        quantize(copy.deepcopy(model), "int3")
    with pytest.raises(ValueError, match="group_size must be one of 32, 64, 128, 256"):
        quantize(copy.deepcopy(model), "int4", group_size=48)
    with pytest.raises(ValueError, match="input width 96 is not a multiple of group_size=64"):
        Int4Linear(torch.randn(8, 96), None, 64)
    with pytest.raises(ValueError, match="Int4Linear needs a"):
        Int4Linear(torch.randn(3, 4, 64), None, 32)
    with pytest.raises(ValueError, match="needs a float32 model"):
        quantize(copy.deepcopy(model).to(torch.bfloat16), "int8")
    q = quantize(copy.deepcopy(model), "int8", min_weights=0)
    with pytest.raises(ValueError, match="already quantised"):
        quantize(q, "bf16", min_weights=0)
    with pytest.raises(ValueError, match="written in subquad's own format"):
        save_pretrained(q, tmp_path / "out", model_type="mamba")
    with pytest.raises(ValueError, match="Int8Linear needs a"):
        Int8Linear(torch.randn(3, 4, 5))


def test_from_pretrained_and_the_cli_quantise(tmp_path, capsys):
    pytest.importorskip("transformers")
    from subquad.cli import main
    from subquad.models import from_pretrained
    from tests.models.test_hf import _hf_mamba

    _, folder = _hf_mamba(tmp_path)
    model, _ = from_pretrained(folder, quantize="int8")
    assert model.quantized == "int8" and isinstance(model.head, Int8Linear)
    # from_pretrained(quantize="int4") with groups of 32 (these matrices are 32 wide), saved and loaded back: the same
    # logits bit for bit (its float matrices laid out for decoding both times), and its tokenizer beside it
    q4 = quantize(from_pretrained(folder)[0], "int4", min_weights=0, group_size=32)
    q4.save_pretrained(tmp_path / "q4")
    back, _ = from_pretrained(tmp_path / "q4")
    assert (tmp_path / "q4" / "tokenizer.json").exists() == (folder / "tokenizer.json").exists()
    ids = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert back.quantized == "int4" and torch.equal(back(ids), q4(ids))
    with pytest.raises(ValueError, match="with float32 weights"):
        from_pretrained(folder, dtype=torch.bfloat16, quantize="int8")
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(folder), "--quantize", "int3", "--prompt", "x"])
    assert "invalid choice: 'int3'" in capsys.readouterr().err
    # int4's group size from from_pretrained and the command line; refused where there are no groups to size
    g32, _ = from_pretrained(folder, quantize="int4", group_size=32)
    fours = [m for m in g32.modules() if isinstance(m, Int4Linear)]
    assert g32.quant_group_size == 32 and fours and all(m.group_size == 32 for m in fours)
    with pytest.raises(ValueError, match="group_size is int4's"):
        from_pretrained(folder, quantize="int8", group_size=32)
    with pytest.raises(ValueError, match="int4's group_size must be one of"):
        from_pretrained(folder, quantize="int4", group_size=100)
    with pytest.raises(ValueError, match="group_size=32"):
        from_pretrained(tmp_path / "q4", group_size=32)                    # loads as it was saved
    assert main(["export", "--model", str(folder), "--out", str(tmp_path / "q4cli"), "--quantize", "int4",
                 "--group-size", "32"]) == 0
    assert from_pretrained(tmp_path / "q4cli")[0].quant_group_size == 32
    assert main(["generate", "--model", str(folder), "--quantize", "int8", "--group-size", "32", "--prompt", "x"]) == 2
    assert "group_size is int4's" in capsys.readouterr().err


def test_cli_generate_and_eval_take_the_compiled_step_and_int8(tmp_path, capsys):
    """`subquad generate --temperature 0` prints the prompt and then exactly transformers' greedy continuation
    of the same checkpoint, 12 tokens, eager, with `--compile-decode` and with `--quantize int8` alike;
    `--quantize int8` also runs through eval (eval names the precision beside the perplexity)."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    from subquad.cli import main
    from subquad.models import from_pretrained
    from tests.models.test_hf import _hf_mamba

    hf, folder = _hf_mamba(tmp_path)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(64)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    # the expected continuation, independently: transformers' own model, a full forward per token, argmax
    prompt, n_new = "w36 w7 w23", 12          # a prompt whose greedy continuation is not one token repeated
    ids = tok.encode(prompt).ids
    margins = []
    with torch.no_grad():
        for _ in range(n_new):
            top = hf(torch.tensor([ids])).logits[0, -1].topk(2)
            margins.append((top.values[0] - top.values[1]).item())
            ids.append(top.indices[0].item())
    expected_ids = ids[3:]
    assert len(expected_ids) == n_new and len(set(expected_ids)) > 1
    # int8 moves these logits (|logit| <= ~3.5) by a few hundredths; each greedy choice leads by far more, so
    # the int8 model must make the same choices (checked, not assumed: the int8 model's own full forward)
    assert min(margins) > 0.3, margins
    q, _ = from_pretrained(folder, quantize="int8")
    assert q.quantized == "int8" and isinstance(q.head, Int8Linear)
    with torch.no_grad():
        assert q(torch.tensor([ids[:-1]]))[0, 2:].argmax(-1).tolist() == expected_ids
    expected = prompt + tok.decode(expected_ids) + "\n"
    outs = []
    for extra in ([], ["--compile-decode"], ["--quantize", "int8"]):
        assert main(["generate", "--model", str(folder), "--prompt", prompt, "--max-new-tokens", str(n_new),
                     "--temperature", "0", *extra]) == 0
        outs.append(capsys.readouterr().out)
    for out in outs:
        assert out == expected
        assert tok.encode(out[len(prompt):]).ids == expected_ids          # exactly n_new tokens generated
    # a quantised folder: `generate --model` loads it as saved (its tokenizer beside it) and decodes as the model
    # it was saved from
    q4 = quantize(from_pretrained(folder)[0], "int4", min_weights=0, group_size=32)
    q4.save_pretrained(tmp_path / "q4")
    want = q4.generate(tok.encode(prompt).ids, n_new, temperature=0)[0]
    assert main(["generate", "--model", str(tmp_path / "q4"), "--prompt", prompt, "--max-new-tokens", str(n_new),
                 "--temperature", "0"]) == 0
    assert capsys.readouterr().out == prompt + tok.decode(want) + "\n"
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"w{(7 * i) % 64}" for i in range(200)))
    assert main(["eval", "--model", str(folder), "--data", str(text), "--quantize", "int8"]) == 0
    assert "int8)" in capsys.readouterr().out


def test_eager_modules_call_their_products_directly_and_the_op_otherwise(monkeypatch):
    """Eagerly an Int8Linear (per channel or blocked) and an Int4Linear call their product's function itself (the
    dispatcher costs ~12 us a call); with x requiring grad or under autocast the op runs, as in a compiled graph:
    the same values either way."""
    from subquad.models import quant

    g = torch.Generator().manual_seed(0)
    lins = {"int8_linear": quant.Int8Linear(torch.randn(64, 96, generator=g)),
            "int8_block_linear": quant.Int8Linear.from_blocks(torch.randint(-127, 128, (64, 96), dtype=torch.int8,
                                                                            generator=g), torch.rand(64, 3) + 0.1),
            "int4_linear": quant.Int4Linear(torch.randn(64, 96, generator=g), None, 32)}
    calls = []
    for name in lins:
        monkeypatch.setattr(quant, name, (lambda f, n: lambda *a: calls.append(n) or f(*a))(getattr(quant, name), name))
    x = torch.randn(3, 96, generator=g)
    with torch.no_grad():
        direct = [lin(x) for lin in lins.values()]
        assert calls == list(lins)
        calls.clear()
        through_op = [lin(x.clone().requires_grad_()) for lin in lins.values()]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            autocast = [lin(x) for lin in lins.values()]
    assert calls == []
    for a, b, c in zip(direct, through_op, autocast):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_a_small_model_is_told_its_projections_stay_float32():
    """Below MIN_WEIGHTS weights a projection stays float32 (fbgemm's cost per call exceeds its time saved): on a
    small model `--quantize int8` quantised the head alone and said nothing (a new user's trial). quantize now
    warns with the count; with min_weights=0 every projection is quantised and nothing is said."""
    import warnings

    model = _model("mamba,softmax")
    small = sum(isinstance(m, nn.Linear) and m.weight.numel() < quant.MIN_WEIGHTS for m in model.modules())
    total = sum(isinstance(m, nn.Linear) for m in model.modules()) - (model.head is not None)
    with pytest.warns(UserWarning, match=f"int8: {small} of {total} projections have fewer than 262,144 weights"):
        quantize(copy.deepcopy(model), "int8")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quantize(copy.deepcopy(model), "int8", min_weights=0)
