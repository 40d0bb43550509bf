"""The fused pre-norm Mamba-1 block (ops.mamba.fused_block, kernels/mamba_block.c) against its math written out in
float64 here (the norm, both products with and without biases, the layer's step as test_mamba_fused_step's
reference has it, the residual), and inside a model against the blocks' own PyTorch forward and a float64 copy:
odd widths, batch > 1, strong decays, Zamba's heads; where it is not taken the block runs its modules."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from subquad.kernels import qgemv
from subquad.models import stack
from subquad.models import LanguageModel, ModelConfig
from subquad.ops.mamba import fused_block, fused_step
from tests.ops.fused_harness import assert_quantized_block_agrees, assert_steps_agree, models
from tests.ops.test_mamba_fused_step import inputs, reference


@pytest.fixture(autouse=True)
def blocks_one_by_one(monkeypatch):
    """These tests hold each block's own call (and count it); tests/models/test_stack.py the blocks in one."""
    monkeypatch.setattr(stack, "ENABLED", False)


pytestmark = pytest.mark.skipif(not fused_block.KERNEL.available(), reason="no C compiler: the kernel cannot be built")


@pytest.mark.parametrize("B,d,D,N,R,K,bias,strong,heads,cm", [
    (1, 40, 64, 16, 4, 4, True, False, 1, (False, False)),
    (3, 29, 37, 16, 3, 4, False, True, 1, (True, False)),    # odd widths, strong decays, no biases, in_proj col-major
    (5, 33, 42, 16, 5, 4, True, True, 3, (False, True)),     # Zamba's heads; out_proj column-major
    (16, 70, 72, 8, 4, 4, True, False, 1, (True, True)),     # the most rows; a last group of < 64 outputs
])
def test_the_block_equals_its_math_in_float64(B, d, D, N, R, K, bias, strong, heads, cm):
    """``cm``: in_proj's and out_proj's weights stored column-major (decode_layout's small wide matrices)."""
    g = torch.Generator().manual_seed(B * 100 + d)
    _, conv_state, conv_w, conv_b, wx, wdt, bdt, A_log, Dp, ssm = inputs(B, D, N, R, K, g, bias, strong, heads)
    h = torch.randn(B, 1, d, generator=g) * 3
    norm_w = torch.rand(d, generator=g) + 0.5
    w_in, w_out = torch.randn(2 * D, d, generator=g) * d ** -0.5, torch.randn(d, D, generator=g) * D ** -0.5
    w_in, w_out = (w.T.contiguous().T if c else w for w, c in zip((w_in, w_out), cm))
    if heads == 1 and B > 1:
        wdt = wdt.t().contiguous().t()            # dt_proj column-major, as the layer's kept call passes it
    b_in, b_out = (torch.randn(2 * D, generator=g), torch.randn(d, generator=g)) if bias else (None, None)
    args = [h, norm_w, 1e-5, w_in, b_in, w_out, b_out, conv_state, conv_w, conv_b, wx, wdt, bdt, A_log, Dp, ssm]
    before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]

    hd = h.double()[:, 0]
    x = hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + 1e-5) * norm_w.double()
    xz = x @ w_in.double().T + (0 if b_in is None else b_in.double())
    y, conv_want, ssm_want = reference(xz, conv_state, conv_w, conv_b, wx, wdt, bdt, A_log, Dp, ssm)
    h_want = hd + y @ w_out.double().T + (0 if b_out is None else b_out.double())

    with torch.no_grad():
        h_got, conv_got, ssm_got = fused_block.block_step(*args)
    assert h_got.shape == (B, 1, d)
    for got, want in ((h_got[:, 0], h_want), (conv_got, conv_want), (ssm_got, ssm_want)):
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert (got.double() - want).abs().max() <= 2e-6 * want.abs().max() + 1e-30
    for a, b in zip(args, before):
        assert not isinstance(a, torch.Tensor) or torch.equal(a, b)    # the states (and weights) passed in unchanged


@pytest.mark.parametrize("T,B,d,D,N,R,K,strong,heads,cm", [
    (8, 1, 40, 64, 16, 4, 4, False, 1, (False, False)),      # a verification of 8 tokens of one row
    (3, 5, 29, 37, 16, 3, 4, True, 1, (True, False)),        # odd widths, strong decays; 5 rows of 3 tokens
    (5, 2, 33, 42, 5, 5, 2, True, 3, (False, True)),         # Zamba's heads, odd N, the shortest convolution
    (16, 1, 70, 72, 8, 4, 4, False, 1, (True, True)),        # the most rows
    (8, 2, 64, 1040, 16, 8, 4, True, 1, (False, False)),     # a state over STREAM_BYTES: the last rows streamed
])
def test_tokens_equal_the_math_token_by_token_in_float64(T, B, d, D, N, R, K, strong, heads, cm):
    """``TokensStep``: T tokens of B rows in one call equal the block's math in float64 run token by token from the
    state each token leaves - every token's h', conv state and ssm state (the states a verification keeps)."""
    g = torch.Generator().manual_seed(T * 100 + B)
    _, conv_state, conv_w, conv_b, wx, wdt, bdt, A_log, Dp, ssm = inputs(B, D, N, R, K, g, True, strong, heads)
    h = torch.randn(B, T, d, generator=g) * 3
    norm_w = torch.rand(d, generator=g) + 0.5
    w_in, w_out = torch.randn(2 * D, d, generator=g) * d ** -0.5, torch.randn(d, D, generator=g) * D ** -0.5
    w_in, w_out = (w.T.contiguous().T if c else w for w, c in zip((w_in, w_out), cm))
    b_in, b_out = torch.randn(2 * D, generator=g), torch.randn(d, generator=g)
    weights = [norm_w, 1e-5, w_in, b_in, w_out, b_out, conv_w, conv_b, wx, wdt, bdt, A_log, Dp]
    before = [t.clone() for t in (h, conv_state, ssm)]
    with torch.no_grad():
        h_got, conv_got, ssm_got = fused_block.TokensStep(T, B, *weights)(h, conv_state, ssm)
    assert h_got.shape == (B, T, d) and conv_got.shape == (B, T, K - 1, D) and ssm_got.shape == (B, T, D, N)
    conv, s = conv_state, ssm
    for t in range(T):
        hd = h[:, t].double()
        x = hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + 1e-5) * norm_w.double()
        y, conv, s = reference(x @ w_in.double().T + b_in.double(), conv, conv_w, conv_b, wx, wdt, bdt, A_log, Dp, s)
        h_want = hd + y @ w_out.double().T + b_out.double()
        for got, want in ((h_got[:, t], h_want), (conv_got[:, t], conv), (ssm_got[:, t], s)):
            assert got.dtype == torch.float32
            assert (got.double() - want).abs().max() <= 4e-6 * want.abs().max() + 1e-30, t
    for a, b in zip((h, conv_state, ssm), before):
        assert torch.equal(a, b)                                         # the inputs passed in unchanged
    with pytest.raises(ValueError, match="rows of .* tokens"):
        fused_block.TokensStep(T, B, *weights)(h[:, :-1], conv_state, ssm)   # not the tokens it holds


@pytest.mark.parametrize("mlp", [False, True])
@pytest.mark.parametrize("kind", ["mamba", "mamba2"])
def test_a_verification_takes_the_tokens_call_per_mamba_block(monkeypatch, kind, mlp):
    """``models.speculative.verify`` (states kept per token) of a Mamba (Mamba-2) + softmax model, 2 rows of 6
    tokens: each Mamba block runs as one ``TokensStep`` call (``ops.mamba.fused_block``'s, ``ops.decay``'s; blocks
    with an MLP too: the MLP follows), and its logits and the
    state after accepting j tokens (the same j for all rows, and one per row) equal the modules' under ``PerToken``
    and a prefill of exactly those tokens by a float64 copy. A prompt from a state, and a verification of more
    rows times tokens than ``layers.linear.C_ROWS``, run the modules."""
    from subquad.layers.rollback import same_state
    from subquad.models.speculative import verify

    from subquad.ops.decay import fused_block as fused_block2

    options = {"mamba2": {"d_state": 16, "head_dim": 16, "n_groups": 2}}
    m, m64 = models(d_model=48, n_layers=3, pattern=f"{kind},softmax,{kind}", mlp=mlp, mixer_options=options)
    calls = []
    tokens = (fused_block if kind == "mamba" else fused_block2).TokensStep
    real = tokens.__call__
    monkeypatch.setattr(tokens, "__call__", lambda *a: calls.append(1) or real(*a))
    g = torch.Generator().manual_seed(2)
    prompt, toks = torch.randint(0, 300, (2, 7), generator=g), torch.randint(0, 300, (2, 6), generator=g)
    with torch.no_grad():
        _, st = m.prefill(prompt)
        _, st64 = m64.prefill(prompt)
        logits, ver = verify(m, toks, st)                                 # how=None: states kept
        assert len(calls) == 2 and type(ver).__name__ == "KeptStates"
        monkeypatch.setenv("SUBQUAD_KERNELS", "0")
        want, ver_modules = verify(m, toks, st, how="states")
        monkeypatch.setenv("SUBQUAD_KERNELS", "1")
        want64, _ = m64.prefill(toks, st64)
        assert len(calls) == 2
        scale = want64.abs().max().item()
        assert (logits.double() - want64).abs().max() <= 1e-5 * scale
        assert (logits - want).abs().max() <= 1e-5 * scale
        got = ver.accept(2)
        for x, y in zip(got, ver_modules.accept(2), strict=True):
            assert same_state(x, y, atol=1e-5) is None
        nxt = torch.tensor([3, 4])
        want_next = m64.step(nxt, m64.prefill(toks[:, :2], st64)[1])[0]
        assert (m.step(nxt, got)[0].double() - want_next).abs().max() <= 1e-5 * want_next.abs().max()
        rows = [5, 1]                        # a prefix per row, from a new verification (the step above extended
        got_next = m.step(nxt, verify(m, toks, st, how="states")[1].accept(rows))[0]    # the first one's caches)
        for r, n in enumerate(rows):
            ids = torch.cat([prompt[r], toks[r, :n], nxt[r:r + 1]])[None]
            want_next = m64(ids)[0, -1]
            assert (got_next[r].double() - want_next).abs().max() <= 1e-5 * want_next.abs().max()
        calls.clear()
        m.prefill(toks, st)                                               # a prompt from a state: the modules
        _, st3 = m.prefill(torch.randint(0, 300, (3, 4), generator=g))
        verify(m, torch.randint(0, 300, (3, 6), generator=g), st3, how="states")   # 18 rows > C_ROWS: the modules
        assert not calls


@pytest.mark.parametrize("heads", [1, 4])
def test_a_model_without_mlps_takes_it_and_agrees_with_its_blocks(monkeypatch, heads):
    """mamba-130m's structure (pre-norm Mamba blocks, no MLP) at batch 3 and an odd prompt: the block kernel's logits
    within float32 rounding of the blocks' PyTorch forward and a float64 copy's, once per Mamba layer and step; a
    softmax layer between them keeps its modules; greedy continuations identical."""
    m, m64 = models(d_model=48, n_layers=3, pattern="mamba,softmax,mamba", mixer_options={"mamba": {"heads": heads}})
    step_calls = []
    monkeypatch.setattr(fused_step, "_run", lambda *a: step_calls.append(1))      # the layer's own kernel: unused
    assert assert_steps_agree(monkeypatch, fused_block.BlockStep, m, m64, 4, prompt=11, fn="__call__") == 4 * 2
    assert not step_calls
    ids = torch.randint(0, 300, (3, 11), generator=torch.Generator().manual_seed(1))
    monkeypatch.undo()
    monkeypatch.setenv("SUBQUAD_KERNELS", "1")
    with_kernel = m.generate(ids[0].tolist(), 16, temperature=0)[0]
    monkeypatch.setenv("SUBQUAD_KERNELS", "0")
    assert with_kernel == m.generate(ids[0].tolist(), 16, temperature=0)[0]


def test_where_it_is_not_taken(monkeypatch):
    """A prompt, more rows than layers.linear.C_ROWS, int8 projections of a width that is not a multiple of 32, a
    norm with a bias, a hook on the mixer, Falcon-Mamba's norms: the block runs its modules (the layer's own kernel
    where it applies)."""
    calls = []
    real = fused_block.BlockStep.__call__
    monkeypatch.setattr(fused_block.BlockStep, "__call__", lambda *a: calls.append(1) or real(*a))
    m, _ = models(d_model=48, n_layers=2, pattern="mamba")
    with torch.no_grad():
        _, st = m.prefill(torch.randint(0, 300, (2, 5)))
        assert not calls                                                # a prompt: the blocks' modules
        m.step(torch.tensor([1, 2]), st)
        assert len(calls) == 2
        calls.clear()
        m.step(torch.arange(17), m.empty_state(17))                     # 17 rows > C_ROWS
        assert not calls
        hook = m.blocks[0].mixer.register_forward_hook(lambda *a: None)
        m.step(torch.tensor([1, 2]), st)
        assert len(calls) == 1                                          # only the block without the hook
        hook.remove()
        calls.clear()
        m.blocks[0].norm1.bias = nn.Parameter(torch.zeros(48))
        m.step(torch.tensor([1, 2]), st)
        assert len(calls) == 1
    calls.clear()
    torch.manual_seed(0)
    falcon = LanguageModel(ModelConfig(vocab_size=300, d_model=48, n_layers=1, pattern="mamba", mlp=False,
                                       mixer_options={"mamba": {"bcdt_rms_eps": 1e-6}})).eval()
    int8 = LanguageModel(ModelConfig(vocab_size=300, d_model=48, n_layers=1, pattern="mamba", mlp=False)).eval()
    from subquad.models.quant import quantize

    quantize(int8, "int8", min_weights=0)
    with torch.no_grad():
        for model in (falcon, int8):
            model.step(torch.tensor([1, 2]), model.empty_state(2))
    assert not calls


def test_a_compiled_block_leaves_it_to_the_graph_without_a_guard_on_the_batch():
    """Inside torch.compile the block runs its modules (inductor fuses them itself) and tests no size on the way:
    one graph serves a batch of 2 and one of 20 (past C_ROWS), as compile_decode's one graph per regime needs."""
    import torch._dynamo

    m, _ = models(d_model=48, n_layers=1, pattern="mamba")
    blk = m.blocks[0]
    torch._dynamo.reset()
    counts = torch._dynamo.utils.counters
    counts.clear()
    f = torch.compile(lambda h, st: blk(h, st)[0], backend="eager", dynamic=True, fullgraph=True)
    with torch.no_grad():
        for B in (2, 20):
            st = blk.mixer.empty_state(B)
            assert f(torch.randn(B, 1, 48), st).shape == (B, 1, 48)
    assert counts["stats"]["unique_graphs"] == 1, dict(counts["stats"])


@pytest.mark.parametrize("kind,tol", [("int8", 5e-2), ("int4", 0.15), ("int8 blocks", 5e-2),
                                      ("int8 blocks of 16", 1e-5), ("q4_0", 5e-2), ("bf16", 1e-2),
                                      ("f16", 1e-5)])
def test_quantized_projections_take_it_for_a_few_rows(monkeypatch, kind, tol):
    """int8 (per channel) and int4 in_proj and out_proj, x rounded per block of 32 inside the kernel as their
    modules' products round it, bfloat16 (x rounded to bfloat16; where the CPU has the kernel), float16 (x exact),
    and int8 per block (a GGUF Q8_0 file's, x rounded per block; Q6_K's blocks of 16, x exact): the block in one
    call agrees with its modules and with a float64 copy of the dequantised weights (fused_harness)."""
    from subquad.layers.mamba import Mamba

    if kind == "bf16" and not qgemv.bf16() or kind == "f16" and not qgemv.f16():
        pytest.skip(f"no kernel for {kind} here: its blocks run as modules")
    assert assert_quantized_block_agrees(monkeypatch, fused_block, Mamba, "mamba", kind, tol) == 2 * 3 * 3


def test_the_step_is_kept_between_tokens_and_rebuilt_when_the_modules_change(monkeypatch):
    """layers.mamba.planned_block: one BlockStep per batch size, reused while the modules hold what it read; a
    weight's data swapped, a projection replaced, new values loaded in place: each step still equals the blocks'
    own PyTorch forward (the kept step reads the tensors themselves, a rebuilt one the new ones); a deep copy of
    the model decodes as the original (nothing kept inside the modules)."""
    import copy

    from subquad.kernels import source
    from subquad.layers.mamba import Mamba, kept_plan

    built = []
    init = fused_block.BlockStep.__init__
    monkeypatch.setattr(fused_block.BlockStep, "__init__", lambda s, *a: built.append(1) or init(s, *a))
    m, _ = models(d_model=48, n_layers=1, pattern="mamba")
    own = Mamba.fused_block

    def both(tok, st):
        a, new = m.step(tok, st)
        monkeypatch.setattr(Mamba, "fused_block", lambda *x: None)
        b, _ = m.step(tok, st)
        monkeypatch.setattr(Mamba, "fused_block", own)
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()
        return new

    with torch.no_grad():
        _, st = m.prefill(torch.randint(0, 300, (2, 5), generator=torch.Generator().manual_seed(0)))
        tok = torch.tensor([1, 2])
        for _ in range(3):
            st = both(tok, st)
        assert len(built) == 1                                           # kept between tokens
        _, st3 = m.prefill(torch.randint(0, 300, (3, 5)))
        both(torch.tensor([1, 2, 3]), st3)
        assert len(built) == 2                                           # another batch size: its own
        mixer = m.blocks[0].mixer
        mixer.in_proj.weight.data = torch.randn_like(mixer.in_proj.weight) * 0.1
        st = both(tok, st)
        assert len(built) == 3                                           # new data: rebuilt
        mixer.out_proj.load_state_dict({"weight": torch.randn_like(mixer.out_proj.weight)})
        st = both(tok, st)
        assert len(built) == 3                                           # in place: the same step, new values
        mixer.dt_proj.weight.data = mixer.dt_proj.weight.data.contiguous()   # row-major, as a model not laid out
        st = both(tok, st)                                                   # for decoding holds it
        assert len(built) == 4
        kept = kept_plan(mixer, m.blocks[0].norm1, 2)[1].tensors
        wdt = [t for t in kept if t is not None and source(t) is mixer.dt_proj.weight]
        assert wdt[0].stride(0) == 1                                     # read column-major (dt_columns)
        with torch.no_grad():
            mixer.dt_proj.weight.mul_(1.5)                               # the column-major copy's source edited
        st = both(tok, st)
        assert len(built) == 5                                           # a copy of it: rebuilt
        mixer.out_proj = nn.Linear(mixer.d_inner, 48, bias=False)
        st = both(tok, st)
        assert len(built) == 6                                           # a new module: rebuilt
        twin = copy.deepcopy(m)
        a, _ = twin.step(tok, st)
        assert torch.equal(a, m.step(tok, st)[0])
    from subquad.layers import mamba
    from subquad.models.quant import quantize

    assert mamba._PLANS.by.get(m.blocks[0].mixer)
    quantize(m, "int8", min_weights=0)                                   # the float weights no longer held
    assert not mamba._PLANS.by.get(m.blocks[0].mixer)
