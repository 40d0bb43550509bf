"""benchmarks/bench_training.py --quick: every row measured or its error reported, MFU from the FLOP count."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def test_quick_training_benchmark(tmp_path):
    from benchmarks.bench_training import main

    main(["--quick", "--out", str(tmp_path), "--mixers", "softmax,mamba2,jamba", "--dtypes", "float32"])
    rows = json.loads((tmp_path / "training_quick.json").read_text())["rows"]
    assert len(rows) == 6 and all("error" not in r for r in rows)
    assert all(0 < r["mfu"] < 1 and r["tokens_s"] > 0 for r in rows)
    assert (tmp_path / "training_quick.png").exists() and "x softmax" in (tmp_path / "training_quick.md").read_text()
