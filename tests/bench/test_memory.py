import pytest

from subquad.bench import memory


def test_plate_numbers():
    (row,) = memory.analytic([131072], head_dim=32)
    assert row["kv_numbers"] == 8_388_608 and row["state_numbers"] == 1_056


def test_chapter_numbers_float16_d128_at_128k():
    (row,) = memory.analytic([128_000], head_dim=128, dtype="float16")
    assert row["kv_bytes"] == 128_000 * 128 * 2 * 2 == 65_536_000          # "64 MB" per head
    assert row["state_bytes"] - 128 * 2 == 128 * 128 * 2 == 32_768         # "32 KB" (S; + z)
    (f,) = memory.flops([128_000], head_dim=128)
    assert f["softmax_flops"] == pytest.approx(2.1e12, rel=0.03)
    assert f["linear_flops"] == pytest.approx(2.1e9, rel=0.03)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_measured_bytes_match_the_formula(dtype):
    contexts = [256, 1024]
    for a, m in zip(memory.analytic(contexts, 16, dtype), memory.measure(contexts, 16, dtype)):
        assert m["kv_cache_bytes"] == a["kv_bytes"]
        # state is kept in float32 for 16-bit inputs
        assert m["state_bytes"] == a["state_numbers"] * 4


def test_state_is_flat_while_cache_grows():
    rows = memory.measure([128, 512, 2048], 8)
    assert len({r["state_bytes"] for r in rows}) == 1
    assert rows[0]["kv_cache_bytes"] * 16 == rows[2]["kv_cache_bytes"]


def test_bad_dtype():
    with pytest.raises(ValueError, match="dtype"):
        memory.analytic([1], 8, "int8")


def test_the_measured_header_names_the_contexts_measured():
    """`subquad memory` measures the shortest context even when every one is past --measure-max: the
    header says what was measured (T = 2,048), not the limit (T <= 1,024)."""
    rows = memory.measure(memory.measured_contexts([2048, 4096], measure_max=1024), 8)
    assert [r["context"] for r in rows] == [2048]
    assert memory.measured_title(rows) == "Measured from the tensors the ops keep (B=1, one head), T = 2,048:"
    rows = memory.measure(memory.measured_contexts([256, 1024, 4096], measure_max=1024), 8)
    assert [r["context"] for r in rows] == [256, 1024]
    assert memory.measured_title(rows).endswith("T = 256 to 1,024:")


def test_each_mixers_state_per_layer_measured_and_extrapolated():
    """``subquad memory --mixers``: a KV cache's bytes are 2 T d floats (capped at swa's window), extrapolated from
    two short reads and equal to a real read of 300 tokens; Mamba's state is d_inner d_state + d_inner
    (conv - 1) floats (expand 2, d_state 16, conv 4: the paper's) at every context; every fixed state is the size
    of its layer's empty_state."""
    import torch

    from subquad.layers import MIXERS, build_mixer, tensor_bytes
    from subquad.models.state import live_bytes

    d, contexts = 64, [32, 300, 1 << 20]
    rows = {r["mixer"]: r for r in memory.mixer_states(["softmax", "swa", "mamba", "gla", "rwkv7"], contexts, d, 4)}
    assert rows["softmax"]["bytes"] == {T: 2 * T * d * 4 for T in contexts} and rows["softmax"]["grows"] == "yes"
    window = MIXERS["swa"].defaults["window"]
    assert rows["swa"]["bytes"] == {T: 2 * min(T, window) * d * 4 for T in contexts}
    assert rows["swa"]["grows"] == f"up to {window} tokens"
    assert rows["mamba"]["bytes"][1 << 20] == (2 * d * 16 + 2 * d * 3) * 4 and rows["mamba"]["grows"] == "no"
    softmax = build_mixer("softmax", d, 4).eval()
    with torch.no_grad():
        _, state = softmax(torch.randn(1, 300, d), softmax.empty_state(1))
    assert live_bytes(state) == rows["softmax"]["bytes"][300]
    for name in ("mamba", "gla", "rwkv7"):
        assert set(rows[name]["bytes"].values()) == {tensor_bytes(build_mixer(name, d, 4).empty_state(1))}
    with pytest.raises(ValueError, match="--mixers: no decoding state for linformer, nope"):
        memory.mixer_states(["gla", "linformer", "nope"], [8], d, 4)


def test_the_memory_command_prints_each_mixers_state(capsys, tmp_path):
    from subquad.cli import main

    assert main(["memory", "--context", "1K,1M", "--measure-max", "1024", "--mixers", "mamba,softmax",
                 "--d-model", "768", "--n-heads", "12", "--out", str(tmp_path / "m.png")]) == 0
    out = capsys.readouterr().out
    assert (tmp_path / "m.png").stat().st_size > 10_000
    assert "Decoding state per layer of each mixer (B=1, d_model 768, 12 heads" in out
    mamba = next(line for line in out.splitlines() if line.strip().startswith("mamba "))
    assert "114.0 KiB" in mamba and "55,188.2x" in mamba        # (1536 x 16 + 1536 x 3) x 4 B; 6 GiB / that
    with pytest.raises(SystemExit):
        main(["memory", "--mixers", ","])
    assert main(["memory", "--context", "1K", "--mixers", "gla,nope"]) == 2
    assert "--mixers: no decoding state for nope" in capsys.readouterr().err
    assert main(["memory", "--out", str(tmp_path / "n.png")]) == 2
    assert "give --mixers too" in capsys.readouterr().err
