import json

import pytest

from subquad.cli import main


def test_memory_command_prints_plate_numbers(capsys):
    assert main(["memory", "--context", "131072", "--measure-max", "1024", "--flops"]) == 0
    out = capsys.readouterr().out
    assert "8,388,608" in out and "1,056" in out and "N²d" in out


def test_workshop_writes_png_and_json(tmp_path, capsys):
    assert main(["workshop", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "workshop.json").read_text())
    assert res["parallel_vs_recurrent_max_abs_diff"] < 1e-14
    assert (tmp_path / "workshop.png").stat().st_size > 10_000
    assert "max |parallel - recurrent|" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["memory", "--context", "abc"], ["memory", "--context", "0"],
                                  ["memory", "--head-dim", "-1"], ["memory", "--dtype", "int8"], ["nope"]])
def test_bad_arguments_exit_with_usage(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert "error" in capsys.readouterr().err
