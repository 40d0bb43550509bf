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
