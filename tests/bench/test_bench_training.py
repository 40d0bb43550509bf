"""benchmarks/bench_training.py --quick: every row measured or its error reported, MFU from the FLOP count."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def test_quick_training_benchmark(tmp_path):
    # one thread: at --quick's shapes (d_model 64, T <= 256) a second thread only waits on the first, and
    # it spins on a busy 2-core machine (23 s against 3 s here while another job ran)
    from benchmarks.bench_training import main

    main(["--quick", "--out", str(tmp_path), "--mixers", "softmax,mamba2,jamba", "--dtypes", "float32",
          "--threads", "1"])
    rows = json.loads((tmp_path / "training_quick.json").read_text())["rows"]
    assert len(rows) == 6 and all("error" not in r for r in rows)
    assert all(0 < r["mfu"] < 1 and r["tokens_s"] > 0 for r in rows)
    assert (tmp_path / "training_quick.png").exists() and "x softmax" in (tmp_path / "training_quick.md").read_text()


def test_quick_chunk_ops_benchmark(tmp_path):
    # every op runs and its useful FLOPs are the stated count: linear attention's C (K + V) + 4 K V per token
    # and head, at T = 256, H = 8, K = V = C = 64
    from benchmarks.bench_chunk_ops import main

    rows = main(["--quick", "--out", str(tmp_path), "--threads", "1"])
    assert len(rows) == 9 and all(r["ms"] > 0 and r["of_matmul"] > 0 for r in rows)
    lin = next(r for r in rows if r["op"] == "linear_attention")
    assert abs(lin["gflop"] - 8 * 256 * (64 * 128 + 4 * 64 * 64) / 1e9) < 1e-12
    assert "% of matmul" in (tmp_path / "chunk_ops_quick.md").read_text()


def test_training_benchmark_merges_runs_and_profiles(tmp_path):
    # a second run with --merge keeps the first run's rows and replaces only the rows it measures again
    from benchmarks.bench_training import main

    main(["--quick", "--out", str(tmp_path), "--mixers", "softmax,linear", "--dtypes", "float32", "--threads", "1"])
    main(["--quick", "--out", str(tmp_path), "--mixers", "linear", "--dtypes", "float32", "--threads", "1",
          "--merge", "--profile"])
    rows = json.loads((tmp_path / "training_quick.json").read_text())["rows"]
    assert sorted((r["mixer"], r["T"]) for r in rows) == [("linear", 128), ("linear", 256), ("softmax", 128),
                                                          ("softmax", 256)]
    assert all(r["threads"] == 1 for r in rows) and all("profile" in r for r in rows if r["mixer"] == "linear")
    prof = (tmp_path / "training_profile_quick.md").read_text()
    assert "linear" in prof and "mm" in prof
